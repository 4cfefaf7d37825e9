"""Lifecycle events from a real replica process to a receiver on loopback: run
started/succeeded/failed/aborted, ``session_named`` once per conversation, ``new_session``
archiving into a sibling (``session_archived``), the ``list_sessions`` picker, and a receiver
that is down costing events (counted) but never a turn."""

from __future__ import annotations

import asyncio
import functools
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet_sim.ports import free_port
from replica.store import SessionStore
from tests.harness import Fleet, Replica, eventually, post
from tests.replica.support import (
    Receiver,
    events,
    kind,
    new_sid,
    outcomes_since,
    settled_messages,
    state,
    turn_outcomes,
    ws_session,
)
from wire.names import parse_session_id

pytestmark = pytest.mark.slow
FLEET_DIR = "lifecycle"  # the conftest fleet's directory
STUB = "stub:ttft=50ms,per_token=20ms,tokens=8"


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    receiver = Receiver().start()
    try:
        yield receiver
    finally:
        receiver.stop()


@pytest.fixture(scope="module")
def replica(fleet: Fleet, receiver: Receiver) -> Replica:
    return fleet.replica(
        "lc", {"a07-s1": fleet.root / "s1"}, "--model", STUB, "--lifecycle-url", receiver.url
    )


def counter(scrape: str, sample: str) -> float:
    match = re.search(rf"^{re.escape(sample)} (\S+)$", scrape, re.M)
    assert match is not None, sample
    return float(match.group(1))


def test_run_events_for_succeeded_failed_and_aborted_turns(
    fleet: Fleet, replica: Replica, receiver: Receiver
) -> None:
    sid = new_sid()
    grant = fleet.grant("acme", sid, sandbox=False)

    async def run() -> list[list[dict[str, Any]]]:
        async with ws_session(replica, sid, grant) as (ws, _):
            ok = await ws.turn("hello there\nwords: 3")
            failed = await ws.turn("break it\nerror: 500")
            await ws.send({"type": "prompt", "message": "long one\nwords: 500"})
            head = await ws.until(lambda f: kind(f) == "text_delta")
            await ws.send({"type": "abort", "id": "stop-it"})
            tail = await ws.until(lambda f: kind(f) == "turn_ended")
            return [ok, failed, head + tail]

    turns = asyncio.run(run())
    run_ids = [events(frames, "turn_started")[0]["run_id"] for frames in turns]
    assert [events(f, "turn_ended")[0]["outcome"] for f in turns] == [
        "succeeded",
        "failed",
        "aborted",
    ]
    assert "500" in events(turns[1], "error")[0]["error"]
    aborted = [f for f in turns[2] if f["type"] == "response"]
    assert aborted == [
        {
            "type": "response",
            "id": "stop-it",
            "command": "abort",
            "success": True,
            "data": {"aborted": True},
        }
    ]
    expected = [
        {"type": "session_named", "session_id": sid, "tenant": "acme", "title": "hello there"}
    ]
    for run_id, (phase, reason) in zip(
        run_ids, [("succeeded", "stop"), ("failed", "error"), ("aborted", "aborted")], strict=True
    ):
        base = {"type": "run", "session_id": sid, "tenant": "acme", "run_id": run_id}
        expected += [{**base, "phase": "started"}, {**base, "phase": phase, "reason": reason}]
    eventually(lambda: len(receiver.for_session(sid)) >= len(expected), timeout=10)
    assert receiver.for_session(sid) == expected


def test_a_failed_run_is_counted_as_failed(fleet: Fleet, replica: Replica) -> None:
    sid = new_sid()
    grant = fleet.grant("acme", sid, sandbox=False)
    before = turn_outcomes(replica)
    with replica.client() as client:
        message = {"type": "prompt", "message": "error: 503"}
        assert post(client, sid, grant, message).status_code == 202
        settled_messages(client, sid, grant)
    counted = outcomes_since(replica, before, 1)
    if counted != {"succeeded": 0.0, "failed": 1.0, "aborted": 0.0}:
        raise AssertionError(f"turn outcomes counted: {counted}")


def test_new_session_archives_into_a_sibling_and_names_the_next_conversation(
    fleet: Fleet, replica: Replica, receiver: Receiver
) -> None:
    sid = new_sid()
    grant = fleet.grant("acme", sid, sandbox=False)
    with replica.client() as client:
        for prompt in ("first topic\nwords: 2", "more on it\nwords: 2"):
            assert (
                post(client, sid, grant, {"type": "prompt", "message": prompt}).status_code == 202
            )
            before = settled_messages(client, sid, grant)
        assert state(client, sid, grant)["title"] == "first topic"
        archived = post(client, sid, grant, {"type": "new_session", "id": "n1"})
        assert archived.status_code == 200
        assert archived.json()["data"] == {"archived": True, "messages": 4}
        assert settled_messages(client, sid, grant) == []
        assert state(client, sid, grant)["title"] == ""
        assert (
            post(client, sid, grant, {"type": "prompt", "message": "second topic"}).status_code
            == 202
        )
        after = settled_messages(client, sid, grant)
        assert state(client, sid, grant)["title"] == "second topic"
    assert after[0]["content"] == "second topic" and after[0]["parent_id"] is None

    def lifecycle() -> list[dict[str, Any]] | None:
        got = [e for e in receiver.for_session(sid) if e["type"] != "run"]
        return got if len(got) >= 3 else None

    named_first, archived_event, named_again = eventually(lifecycle, timeout=10)
    assert named_first == {
        "type": "session_named",
        "session_id": sid,
        "tenant": "acme",
        "title": "first topic",
    }
    sibling = archived_event["session_id"]
    assert archived_event == {
        "type": "session_archived",
        "session_id": sibling,
        "parent_session_id": sid,
        "tenant": "acme",
        "title": "first topic",
    }
    assert named_again["type"] == "session_named" and named_again["title"] == "second topic"
    assert sibling != sid and parse_session_id(sibling).shard == parse_session_id(sid).shard
    # The sibling holds the archived conversation, on disk and through the replica.
    stored = SessionStore(fleet.root / "s1").read(
        "acme", parse_session_id(sibling), fleet.dek("acme")
    )
    assert [m.id for m in stored.transcript.messages] == [m["id"] for m in before]
    sibling_grant = fleet.grant("acme", sibling, sandbox=False)
    with replica.client() as client:
        served = settled_messages(client, sibling, sibling_grant)
    assert [(m["role"], m["content"]) for m in served] == [
        (m["role"], m["content"]) for m in before
    ]


def newest_segment(fleet: Fleet, tenant: str, sid: str) -> float:
    """The modification time the session listing gives ``sid`` (its newest segment's)."""
    directory = SessionStore(fleet.root / "s1").directory(tenant, parse_session_id(sid))
    return max(path.stat().st_mtime for path in directory.glob("*.seg"))


def stamped_after(probe: Path, moment: float) -> bool:
    """Whether a file touched now is stamped later than ``moment``."""
    probe.touch()
    return probe.stat().st_mtime > moment


def test_list_sessions_matches_title_preview_and_id_newest_first(
    fleet: Fleet, replica: Replica
) -> None:
    tenant = "lister" + secrets.token_hex(3)
    prompts = ["alpha report", "beta report\nzebra-marker", "gamma notes"]
    sids = [new_sid() for _ in prompts]
    grants = [fleet.grant(tenant, sid, sandbox=False) for sid in sids]
    with replica.client() as client:
        for sid, grant, prompt in zip(sids, grants, prompts, strict=True):
            assert (
                post(client, sid, grant, {"type": "prompt", "message": prompt}).status_code == 202
            )
            settled_messages(client, sid, grant)
            # The listing orders by modification time: the next session's must be later.
            written = newest_segment(fleet, tenant, sid)
            eventually(
                functools.partial(stamped_after, fleet.root / "clock-probe", written),
                timeout=5,
                interval=0.005,
                message="the file system's clock did not move on",
            )

        def listing(query: str, limit: int = 50) -> list[str]:
            body = {"type": "list_sessions", "query": query, "limit": limit}
            response = post(client, sids[2], grants[2], body)
            assert response.status_code == 200 and response.json()["success"] is True
            return [s["session_id"] for s in response.json()["data"]["sessions"]]

        assert listing("") == sids[::-1]
        assert listing("REPORT") == [sids[1], sids[0]]  # titles, case-insensitively
        assert listing("zebra-marker") == [sids[1]]  # only in the reply, the preview
        assert listing(sids[0].split(".")[1]) == [sids[0]]
        assert listing("", limit=2) == [sids[2], sids[1]]
        assert listing("nothing like this") == []
        entry = post(client, sids[2], grants[2], {"type": "list_sessions", "limit": 1}).json()
    [first] = entry["data"]["sessions"]
    assert first["title"] == "gamma notes" and first["cwd"] == "/workspace"
    assert first["messages"] == 2 and first["preview"].startswith("ok: gamma notes")


def test_a_receiver_that_is_down_costs_events_not_turns(fleet: Fleet) -> None:
    dead = f"http://127.0.0.1:{free_port()}/events"  # nothing listens here
    down = fleet.replica("down", {"a07-s1": fleet.root / "s-down"}, "--lifecycle-url", dead)
    sid = new_sid()
    grant = fleet.grant("acme", sid, sandbox=False)
    with down.client() as client:
        started = time.monotonic()
        for n in range(3):
            message = {"type": "prompt", "message": f"turn {n}"}
            assert post(client, sid, grant, message).status_code == 202
            messages = settled_messages(client, sid, grant)
        took = time.monotonic() - started
    assert took < 2.0
    assert [m["content"] for m in messages[1::2]] == ["ok: turn 0", "ok: turn 1", "ok: turn 2"]
    sample = 'agent_lifecycle_dropped_total{reason="undeliverable"}'
    eventually(lambda: counter(down.scrape(), sample) >= 1, timeout=10, interval=0.2)
    assert 'agent_turns_total{outcome="succeeded"} 3.0' in down.scrape()
