"""What the job-end scenarios measure with, checked on its own: the graders fail when they
should (a matrix run mostly shows them passing), storage is read the way the scenarios assume,
and the stand-in replica records exact bytes and notices a request abandoned by its caller."""

from __future__ import annotations

import asyncio

import pytest

from fleet_sim.sim.job_queries import (
    Telling,
    committed_by,
    job_notices,
    job_reads,
    told_exactly_once,
)
from fleet_sim.sim.rawhttp import callback_request, chunked, request_bytes, send_raw
from fleet_sim.sim.standin import Backend
from replica.history import History, SegmentSummary
from replica.transcript import Message, Transcript
from tests.harness import eventually


def test_told_exactly_once_fails_on_a_missing_or_a_second_notice() -> None:
    once = Telling("a07-s1.a", "j1", 1, 0.4, "r1", (200,))
    never = Telling("a07-s1.b", "j2", 0, None, None, (202,))
    twice = Telling("a07-s1.c", "j3", 2, 0.1, "r2", (200,))
    assert told_exactly_once("c", [once]).verdict == "pass"
    result = told_exactly_once("c", [once, never, twice])
    assert result.verdict == "fail"
    assert result.figures["never_told"] == 1 and result.figures["told_more_than_once"] == 1
    assert any("j2 was told never (callback answers [202])" in e for e in result.errors)


def _segment(epoch: int, messages: int, owner: str) -> SegmentSummary:
    return SegmentSummary(epoch, epoch - 1 or None, None, None, 0, 0, 1, messages, 0, False, owner)


def test_storage_views_find_notices_reads_and_who_committed_them() -> None:
    transcript = Transcript()
    transcript.apply_batch(
        [
            Message("m1", None, "tool", "started background job j1", 1.0, {"job_id": "j1"}),
            Message("m2", "m1", "tool", "line-1\nline-2\n\n[read 0-14]", 2.0, {"job_id": "j1"}),
            Message(
                "m3",
                "m2",
                "tool",
                "line-3\n\n[read 14-21 (job ended, end of output)]",
                3.0,
                {"job_id": "j1"},
            ),
            Message(
                "m4",
                "m3",
                "event",
                "background job j1 exited",
                4.0,
                {"job_end": {"job_id": "j1", "status": "exited", "exit_code": 0}},
            ),
            Message("m5", "m4", "user", "job_end j1 in prose is not a notice", 5.0),
        ]
    )
    history = History([_segment(1, 2, "r1"), _segment(2, 3, "r2")], transcript)
    assert [m.id for m in job_notices(history, "j1")] == ["m4"]
    assert job_notices(history, "j2") == []
    reads = job_reads(history, "j1")
    assert [(r.start, r.end, r.ended, r.by) for r in reads] == [
        (0, 14, False, "r1"),
        (14, 21, True, "r2"),
    ]
    assert reads[0].data + reads[1].data == "line-1\nline-2\nline-3\n"
    assert committed_by(history, "m4") == "r2" and committed_by(history, "nope") is None


def test_the_stand_in_records_exact_bytes_and_sees_a_caller_give_up() -> None:
    answers = {"a07-s1.ok": (410, b"gone")}
    backend = Backend(lambda wire: answers.get(wire.target.rpartition("=")[2]))
    url = backend.start()
    try:
        body = b'{"type":"job_ended","job_id":"j1"}'
        headers = [
            (b"Host", b"h"),
            (b"Authorization", b"Bearer  bjn_v1.x.y"),
            (b"Transfer-Encoding", b"chunked"),
            (b"Connection", b"close"),
        ]
        sent = request_bytes("POST", "/_beyond/agent?session_id=a07-s1.ok", headers, chunked(body))
        got = asyncio.run(send_raw(url, sent))
        assert (got.status, got.body) == (410, b"gone")
        wire = backend.received[0].wire
        assert wire.headers == headers and wire.body == body and wire.raw_body == chunked(body)
        with pytest.raises(TimeoutError):
            asyncio.run(
                send_raw(url, callback_request("/?session_id=a07-s1.hang", b"x"), timeout_s=0.3)
            )
        eventually(lambda: backend.received[-1].cancelled_at is not None, timeout=5)
        assert backend.received[-1].cancelled_at is not None
    finally:
        backend.stop()
