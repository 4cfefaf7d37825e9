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


def test_deltas_wait_for_a_flush_and_go_out_as_one() -> None:
    coalescer = Coalescer(max_chars=100)
    assert not coalescer.pending and coalescer.flush() is None
    assert coalescer.append("r1", "hel") == []
    assert coalescer.append("r1", "lo ") == []
    assert coalescer.append("r1", "wörld") == []
    assert coalescer.pending
    assert coalescer.flush() == Gathered("r1", "hello wörld", 3)
    assert not coalescer.pending and coalescer.flush() is None


def test_the_size_bound_sends_everything_gathered_at_once() -> None:
    coalescer = Coalescer(max_chars=10)
    assert coalescer.append("r1", "abcd") == []
    assert coalescer.append("r1", "efgh") == []
    # Reaching the bound sends the delta that reached it too, in order, and starts afresh.
    assert coalescer.append("r1", "ij") == [Gathered("r1", "abcdefghij", 3)]
    assert not coalescer.pending
    assert coalescer.append("r1", "k") == []
    # A delta is never split: one larger than the bound goes out whole, after what preceded it.
    assert coalescer.append("r1", "0123456789xyz") == [Gathered("r1", "k0123456789xyz", 2)]
    assert coalescer.append("r1", "0123456789xyz") == [Gathered("r1", "0123456789xyz", 1)]
    assert not coalescer.pending


def test_a_run_never_shares_a_frame_with_another() -> None:
    coalescer = Coalescer(max_chars=5)
    assert coalescer.append("r1", "ab") == []
    assert coalescer.append("r2", "cd") == [Gathered("r1", "ab", 1)]
    assert coalescer.append("r3", "efghij") == [
        Gathered("r2", "cd", 1),
        Gathered("r3", "efghij", 1),
    ]
    assert not coalescer.pending


def test_an_empty_delta_says_nothing() -> None:
    coalescer = Coalescer()
    assert coalescer.append("r1", "") == [] and not coalescer.pending
    coalescer.append("r1", "a")
    assert coalescer.append("r1", "") == []
    assert coalescer.flush() == Gathered("r1", "a", 1)


def test_the_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_chars"):
        Coalescer(max_chars=0)


@pytest.mark.parametrize("seed", range(20))
def test_any_delta_sequence_comes_out_whole_and_in_order(seed: int) -> None:
    rng = random.Random(seed)
    bound = rng.randint(1, 64)
    coalescer = Coalescer(max_chars=bound)
    deltas = ["".join(rng.choices("ab é\n", k=rng.randint(0, 20))) for _ in range(200)]
    frames: list[Gathered] = []
    for delta in deltas:
        frames += coalescer.append("r1", delta)
        if rng.random() < 0.1:  # a window closing, or another frame, at any moment
            flushed = coalescer.flush()
            frames += [flushed] if flushed is not None else []
    last = coalescer.flush()
    frames += [last] if last is not None else []
    assert "".join(f.text for f in frames) == "".join(deltas)
    assert sum(f.deltas for f in frames) == sum(1 for d in deltas if d)
    assert all(f.text for f in frames)  # never an empty frame
    # Nothing is held past the bound: a frame is over it only by the delta that reached it.
    assert all(len(f.text) < bound + 20 for f in frames)
