"""Owners in real processes: killed mid-append, paused past a lost lock, racing without one."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from replica.store import SessionStore
from tests.replica.store_owner import DEK, Owner
from wire.names import parse_session_id


def transcript_ids(root: Path, sid: str) -> list[str]:
    history = SessionStore(root).read("acme", parse_session_id(sid), DEK)
    return [m.id for m in history.transcript.messages]


@pytest.mark.slow
def test_kill_mid_append_then_takeover_then_paused_owner_is_fenced(tmp_path: Path) -> None:
    sid = "a07-s3.proc1"
    a = Owner(tmp_path, sid)
    try:
        assert a("open")["epoch"] == 1
        assert a("commit", tag="t1")["ok"]
        a("commit_partial", tag="lost")
        os.kill(a.proc.pid, signal.SIGKILL)
        a.proc.wait(10)
    finally:
        a.stop()

    b = Owner(tmp_path, sid)
    try:
        opened = b("open")
        assert (opened["epoch"], opened["messages"]) == (2, 2)
        assert b("commit", tag="t2")["ok"]
        assert b("release") == {"op": "release"}
    finally:
        b.stop()
    history = SessionStore(tmp_path).read("acme", parse_session_id(sid), DEK)
    assert history.segments[0].ignored_bytes > 0  # A's torn batch lies past B's seal
    assert history.segments[1].seals_prev_at == history.segments[0].valid_end

    paused, taker = Owner(tmp_path, sid), Owner(tmp_path, sid)
    try:
        assert paused("open")["epoch"] == 3
        assert paused("commit", tag="p1")["ok"]
        paused("drop_lock")  # its storage lease lapses while it is stopped
        os.kill(paused.proc.pid, signal.SIGSTOP)
        assert taker("open")["epoch"] == 4
        assert taker("commit", tag="q1")["ok"]
        os.kill(paused.proc.pid, signal.SIGCONT)
        fenced = paused("commit", tag="p2")
        assert fenced["ok"] is False and "Superseded" in fenced["outcome"]
        assert "successor=4" in fenced["outcome"] and "batch_included=False" in fenced["outcome"]
        assert taker("commit", tag="q2")["ok"]
    finally:
        paused.stop()
        taker.stop()
    assert transcript_ids(tmp_path, sid) == [
        f"{t}-{r}" for t in ("t1", "t2", "p1", "q1", "q2") for r in ("u", "a")
    ]


@pytest.mark.slow
@pytest.mark.parametrize("round_", range(4))
def test_two_racing_owners_never_share_an_epoch(tmp_path: Path, round_: int) -> None:
    sid = f"a07-s3.race{round_}"
    owners = [Owner(tmp_path, sid, "nolock"), Owner(tmp_path, sid, "nolock")]
    try:
        for owner in owners:
            owner.send("open")
        epochs = [owner.reply()["epoch"] for owner in owners]
        assert sorted(epochs) == [1, 2]
        acknowledged: list[str] = []
        results: dict[int, list[bool]] = {0: [], 1: []}
        for step in range(6):
            for n, owner in enumerate(owners):
                tag = f"o{n}s{step}"
                ok = owner("commit", tag=tag)["ok"]
                results[n].append(ok)
                if ok:
                    acknowledged += [f"{tag}-u", f"{tag}-a"]
        stale = epochs.index(1)
        assert results[stale] == [False] * 6  # superseded before its first commit, and stays so
        assert results[1 - stale] == [True] * 6
        assert transcript_ids(tmp_path, sid) == acknowledged
    finally:
        for owner in owners:
            owner.stop()
