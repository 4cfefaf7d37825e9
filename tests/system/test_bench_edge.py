"""The edge bench's streamed-turn measurement: a turn whose stream is cut (the replica told its
reader to reconnect) is measured again on a fresh session, a bounded number of times."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bench.edge_bench import STREAM_ATTEMPTS, StreamCut, StreamResult, _measured_turn

Stream = Callable[[str, str, str, int | None], StreamResult]


class Grants:
    def __init__(self) -> None:
        self.asked: list[str] = []

    def __call__(self, session_id: str) -> str:
        self.asked.append(session_id)
        return f"grant-for-{session_id}"


def cut_first(cuts: int) -> tuple[list[tuple[str, str]], Stream]:
    calls: list[tuple[str, str]] = []

    def stream(url: str, sid: str, grant: str, pid: int | None) -> StreamResult:
        calls.append((sid, grant))
        if len(calls) <= cuts:
            raise StreamCut("the event stream closed before the turn ended")
        return StreamResult(frames=120, seconds=0.5, proxy_cpu_s=0.01)

    return calls, stream


def test_an_uncut_turn_is_measured_once() -> None:
    grants = Grants()
    calls, stream = cut_first(0)
    result, cut = _measured_turn(grants, "sse", stream, "http://127.0.0.1:1", 42)
    assert (result.frames, cut, len(calls)) == (120, 0, 1)
    assert calls[0] == (grants.asked[0], f"grant-for-{grants.asked[0]}")
    assert grants.asked[0].startswith("a07-s1.sse")


def test_a_cut_turn_is_measured_again_on_a_fresh_session() -> None:
    grants = Grants()
    calls, stream = cut_first(STREAM_ATTEMPTS - 1)
    result, cut = _measured_turn(grants, "ws", stream, "http://127.0.0.1:1", None)
    assert (result.frames, cut, len(calls)) == (120, STREAM_ATTEMPTS - 1, STREAM_ATTEMPTS)
    assert len(set(grants.asked)) == STREAM_ATTEMPTS  # a new session each time


def test_a_turn_cut_every_time_fails_the_run() -> None:
    grants = Grants()
    calls, stream = cut_first(STREAM_ATTEMPTS)
    with pytest.raises(StreamCut, match=f"every one of {STREAM_ATTEMPTS} ws turns"):
        _measured_turn(grants, "ws", stream, "http://127.0.0.1:1", None)
    assert len(calls) == STREAM_ATTEMPTS
