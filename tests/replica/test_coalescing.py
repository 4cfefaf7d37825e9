from __future__ import annotations

import random

import pytest

from replica.coalescing import (
    DEFAULT_COALESCING,
    DEFAULT_MAX_CHARS,
    Coalescer,
    Coalescing,
    Gathered,
)


def test_the_default_is_a_short_window_and_zero_turns_it_off() -> None:
    assert Coalescing(0.025, 4096) == DEFAULT_COALESCING and DEFAULT_MAX_CHARS == 4096
    assert DEFAULT_COALESCING.enabled
    assert not Coalescing(0.0).enabled


W = 0.025  # the window in these tests


def _opened(max_chars: int = 100) -> Coalescer:
    """A coalescer whose window has just opened: a first delta went out at t=0."""
    coalescer = Coalescer(max_chars=max_chars, window_s=W)
    assert coalescer.append("r0", "first", 0.0) == [Gathered("r0", "first", 1)]
    return coalescer


def test_a_delta_after_a_quiet_window_goes_out_at_once() -> None:
    coalescer = Coalescer(window_s=W)
    assert not coalescer.pending and coalescer.due_at is None
    # The first delta of a reply waits for nothing.
    assert coalescer.append("r1", "hel", 5.0) == [Gathered("r1", "hel", 1)]
    assert not coalescer.pending and coalescer.due_at is None
    # Nor does one that comes a window or more after the last frame (a timer a hair early
    # counts as on time).
    assert coalescer.append("r1", "lo", 5.0 + W - 0.001) == [Gathered("r1", "lo", 1)]
    assert coalescer.append("r1", "!", 9.0) == [Gathered("r1", "!", 1)]


def test_deltas_within_the_window_wait_for_its_end_and_go_out_as_one() -> None:
    coalescer = _opened()
    assert coalescer.append("r1", "hel", 0.005) == []
    assert coalescer.due_at == W  # a window after the last frame, not after this delta
    assert coalescer.append("r1", "lo ", 0.010) == []
    assert coalescer.append("r1", "wörld", 0.020) == []
    assert coalescer.pending and coalescer.due_at == W
    assert coalescer.flush(W) == Gathered("r1", "hello wörld", 3)
    assert not coalescer.pending and coalescer.flush(W) is None and coalescer.due_at is None
    # The flush opened the next window.
    assert coalescer.append("r1", "a", W + 0.01) == []
    assert coalescer.due_at == 2 * W


def test_a_late_timer_is_made_up_by_the_next_delta() -> None:
    coalescer = _opened()
    assert coalescer.append("r1", "a", 0.010) == []
    # The window closed with its timer not yet run: the next delta takes everything with it.
    assert coalescer.append("r1", "b", 0.040) == [Gathered("r1", "ab", 2)]


def test_the_size_bound_sends_everything_gathered_at_once() -> None:
    coalescer = _opened(max_chars=10)
    assert coalescer.append("r1", "abcd", 0.001) == []
    assert coalescer.append("r1", "efgh", 0.002) == []
    # Reaching the bound sends the delta that reached it too, in order, and starts afresh.
    assert coalescer.append("r1", "ij", 0.003) == [Gathered("r1", "abcdefghij", 3)]
    assert not coalescer.pending
    assert coalescer.append("r1", "k", 0.004) == []
    # A delta is never split: one larger than the bound goes out whole, after what preceded it.
    assert coalescer.append("r1", "0123456789xyz", 0.005) == [Gathered("r1", "k0123456789xyz", 2)]
    assert coalescer.append("r1", "0123456789xyz", 0.006) == [Gathered("r1", "0123456789xyz", 1)]
    assert not coalescer.pending


def test_a_run_never_shares_a_frame_with_another() -> None:
    coalescer = _opened(max_chars=5)
    assert coalescer.append("r1", "ab", 0.001) == []
    assert coalescer.append("r2", "cd", 0.002) == [Gathered("r1", "ab", 1)]
    assert coalescer.due_at == 0.002 + W  # the earlier run's frame opened a window
    assert coalescer.append("r3", "efghij", 0.003) == [
        Gathered("r2", "cd", 1),
        Gathered("r3", "efghij", 1),
    ]
    assert not coalescer.pending


def test_an_empty_delta_says_nothing() -> None:
    coalescer = _opened()
    assert coalescer.append("r1", "", 0.001) == [] and not coalescer.pending
    coalescer.append("r1", "a", 0.002)
    assert coalescer.append("r1", "", 0.003) == []
    assert coalescer.append("r1", "", 1.0) == []  # not even after the window
    assert coalescer.flush(1.0) == Gathered("r1", "a", 1)


def test_a_window_of_zero_gathers_nothing() -> None:
    coalescer = Coalescer(window_s=0.0)
    assert coalescer.append("r1", "a", 1.0) == [Gathered("r1", "a", 1)]
    assert coalescer.append("r1", "b", 1.0) == [Gathered("r1", "b", 1)]


def test_the_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_chars"):
        Coalescer(max_chars=0)
    with pytest.raises(ValueError, match="window_s"):
        Coalescer(window_s=-0.001)


@pytest.mark.parametrize("seed", range(20))
def test_any_delta_sequence_comes_out_whole_and_in_order(seed: int) -> None:
    rng = random.Random(seed)
    bound = rng.randint(1, 64)
    coalescer = Coalescer(max_chars=bound, window_s=W)
    deltas = ["".join(rng.choices("ab é\n", k=rng.randint(0, 20))) for _ in range(200)]
    frames: list[Gathered] = []
    now = 0.0
    for delta in deltas:
        now += rng.choice((0.0, 0.001, 0.01, 0.03))
        frames += coalescer.append("r1", delta, now)
        if rng.random() < 0.1:  # a window closing, or another frame, at any moment
            flushed = coalescer.flush(now)
            frames += [flushed] if flushed is not None else []
    last = coalescer.flush(now)
    frames += [last] if last is not None else []
    assert "".join(f.text for f in frames) == "".join(deltas)
    assert sum(f.deltas for f in frames) == sum(1 for d in deltas if d)
    assert all(f.text for f in frames)  # never an empty frame
    # Nothing is held past the bound: a frame is over it only by the delta that reached it.
    assert all(len(f.text) < bound + 20 for f in frames)
