"""A real replica process on loopback: every status of the gate, POST and WebSocket sessions,
catch-up, drain, the reaper, the cap, and the metrics it exposes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from replica.locking import lock_is_free
from tests.harness import Fleet, Replica, agent_url, eventually, post
from tests.replica.support import new_sid

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shard(fleet: Fleet) -> Path:
    return fleet.root / "shard-a07-s1"


@pytest.fixture(scope="module")
def replica(fleet: Fleet, shard: Path) -> Replica:
    return fleet.replica("r1", {"a07-s1": shard})


def wait_turn(client: httpx.Client, sid: str, grant: str, messages: int) -> list[dict[str, Any]]:
    def done() -> list[dict[str, Any]] | None:
        data = post(client, sid, grant, {"type": "get_state"}).json()["data"]
        if data["running"] or data["messages"] < messages:
            return None
        got: list[dict[str, Any]] = post(client, sid, grant, {"type": "get_messages"}).json()[
            "data"
        ]["messages"]
        return got

    result: list[dict[str, Any]] = eventually(done)
    return result


def test_gate_statuses_in_order(fleet: Fleet, replica: Replica) -> None:
    sid, other = new_sid(), new_sid()
    grant = fleet.grant("acme", sid, sandbox=False)
    with replica.client() as client:
        no_grant = post(client, sid, None, {"type": "get_state"})
        assert no_grant.status_code == 401 and "grant" in no_grant.text
        assert post(client, sid, "not.a.jwt", {"type": "get_state"}).status_code == 401
        assert post(client, sid, "x" * 14_000, {"type": "get_state"}).status_code == 401
        no_id = client.post(
            "/_beyond/agent", content=b'{"type":"get_state"}', headers={"x-beyond-grant": grant}
        )
        assert no_id.status_code == 400 and "session_id" in no_id.text
        twice = client.post(
            f"/_beyond/agent?session_id={sid}&session_id={sid}",
            content=b'{"type":"get_state"}',
            headers={"x-beyond-grant": grant},
        )
        assert twice.status_code == 400
        assert post(client, other, grant, {"type": "get_state"}).status_code == 403
        wrong_tenant = client.post(
            agent_url(sid, tenant="globex"),
            content=b'{"type":"get_state"}',
            headers={"x-beyond-grant": grant},
        )
        assert wrong_tenant.status_code == 403
        unmounted = new_sid("a07-s9")
        misdirected = post(
            client, unmounted, fleet.grant("acme", unmounted, sandbox=False), {"type": "get_state"}
        )
        assert misdirected.status_code == 421 and "not mounted" in misdirected.text
        bad_body = post(client, sid, grant, b'{"type": "launch"}')
        assert bad_body.status_code == 400 and "unknown command" in bad_body.text
        no_length = client.post(
            agent_url(sid),
            content=iter([b'{"type":"get_state"}']),
            headers={"x-beyond-grant": grant},
        )
        assert no_length.status_code == 411
        ok = post(client, sid, grant, {"type": "get_state"})
        assert ok.status_code == 200 and ok.headers["x-session-id"] == sid
    # Nothing was opened for the refused requests: only the accepted one has a directory.
    tenant_dir = fleet.root / "shard-a07-s1" / "acme" / "sessions"
    assert sorted(p.name for p in tenant_dir.iterdir() if p.name in (sid, other)) == [sid]
    scrape = replica.scrape()
    for reason in ("auth", "bad_request", "forbidden", "misdirected", "length_required"):
        assert f'agent_refusals_total{{reason="{reason}"}} 0.0' not in scrape


def test_post_session_runs_a_turn_with_a_tool(fleet: Fleet, replica: Replica) -> None:
    sid = new_sid()
    grant = fleet.grant("acme", sid)
    with replica.client() as client:
        accepted = post(
            client,
            sid,
            grant,
            {"type": "prompt", "id": "p1", "message": "list it\nrun: echo hello-sandbox"},
        )
        assert accepted.status_code == 202
        assert accepted.json() == {"type": "ack", "id": "p1", "command": "prompt"}
        messages = wait_turn(client, sid, grant, 4)
    roles = [m["role"] for m in messages]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert "hello-sandbox" in messages[2]["content"]
    assert messages[3]["content"] == "result: hello-sandbox"
    assert [m["parent_id"] for m in messages[1:]] == [m["id"] for m in messages[:-1]]
    assert messages[0]["title"] == "list it"


def test_websocket_session_streams_frames_and_catches_up(fleet: Fleet, replica: Replica) -> None:
    sid = new_sid()
    grant = fleet.grant("acme", sid)
    url = replica.url.replace("http", "ws") + agent_url(sid)

    async def session() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        headers = {"x-beyond-grant": grant}
        async with websockets.connect(url, additional_headers=headers) as ws:
            catchup = json.loads(await ws.recv())
            assert catchup["type"] == "catchup" and catchup["messages"] == []
            await ws.send(json.dumps({"type": "prompt", "id": "w1", "message": "hi there"}))
            frames = []
            while True:
                frame = json.loads(await asyncio.wait_for(ws.recv(), 10))
                frames.append(frame)
                if frame["type"] == "event" and frame["event"]["kind"] == "turn_ended":
                    break
        async with websockets.connect(url, additional_headers=headers) as ws:
            again = json.loads(await ws.recv())
        return frames, again

    frames, again = asyncio.run(session())
    assert frames[0] == {"type": "ack", "id": "w1", "command": "prompt"}
    kinds = [f["type"] if f["type"] != "event" else f["event"]["kind"] for f in frames]
    assert kinds[:3] == ["turn_started", "committed", "text_delta"] or kinds[1:3] == [
        "turn_started",
        "committed",
    ]
    assert kinds.count("committed") == 2 and kinds[-1] == "turn_ended"
    text = "".join(
        f["event"]["text"]
        for f in frames
        if f["type"] == "event" and f["event"]["kind"] == "text_delta"
    )
    assert text == "ok: hi there"
    leaf = [f for f in frames if f["type"] == "committed"][-1]["leaf_id"]
    assert again["leaf_id"] == leaf and len(again["messages"]) == 2


def test_websocket_refusal_is_an_http_status(fleet: Fleet, replica: Replica) -> None:
    sid = new_sid()
    url = replica.url.replace("http", "ws") + agent_url(sid)

    async def attempt() -> int:
        try:
            async with websockets.connect(url, additional_headers={"x-beyond-grant": "bad"}):
                return 101
        except websockets.InvalidStatus as exc:
            return exc.response.status_code

    assert asyncio.run(attempt()) == 401


def test_lock_held_elsewhere_is_503_then_free_after_reap(fleet: Fleet, shard: Path) -> None:
    owner = fleet.replica("r2", {"a07-s1": shard}, "--session-idle-timeout", "1")
    other = fleet.replica("r3", {"a07-s1": shard})
    sid = new_sid()
    grant = fleet.grant("acme", sid, sandbox=False)
    with owner.client() as a, other.client() as b:
        assert post(a, sid, grant, {"type": "get_state"}).status_code == 200
        refused = post(b, sid, grant, {"type": "get_state"})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "open on another replica" in refused.text
        lock = shard / "acme" / "sessions" / sid / "lock"
        eventually(lambda: lock_is_free(lock), timeout=10)  # the idle reaper released it
        state = post(b, sid, grant, {"type": "get_state"})
        assert state.status_code == 200 and state.json()["data"]["epoch"] == 2
    assert 'agent_refusals_total{reason="unavailable"} 1.0' in other.scrape()
    assert "agent_sessions_reaped_total 1.0" in owner.scrape()


def test_live_session_cap_refuses(fleet: Fleet, tmp_path: Path) -> None:
    capped = fleet.replica("cap", {"a07-s1": tmp_path / "s1"}, "--max-live-sessions", "1")
    first, second = new_sid(), new_sid()
    with capped.client() as client:
        assert (
            post(
                client, first, fleet.grant("acme", first, sandbox=False), {"type": "get_state"}
            ).status_code
            == 200
        )
        refused = post(
            client, second, fleet.grant("acme", second, sandbox=False), {"type": "get_state"}
        )
        assert refused.status_code == 503 and "live-session limit" in refused.text
    assert 'agent_refusals_total{reason="capacity"} 1.0' in capped.scrape()


def test_drain_keeps_serving_what_it_owns(fleet: Fleet, tmp_path: Path) -> None:
    draining = fleet.replica(
        "dr",
        {"a07-s1": tmp_path / "s1"},
        "--model",
        "stub:ttft=300ms,per_token=20ms,tokens=40",
        "--drain-grace",
        "20",
    )
    owned, fresh = new_sid(), new_sid()
    grant = fleet.grant("acme", owned)
    with draining.client() as client:
        assert (
            post(client, owned, grant, {"type": "prompt", "message": "long one"}).status_code == 202
        )
        draining.drain()
        eventually(lambda: client.get("/readyz").status_code == 503)
        assert client.get("/livez").status_code == 200
        refused = post(
            client, fresh, fleet.grant("acme", fresh, sandbox=False), {"type": "get_state"}
        )
        assert refused.status_code == 503 and "draining" in refused.text
        assert post(client, owned, grant, {"type": "get_state"}).status_code == 200
    assert draining.proc.wait(30) == 0
    lock = tmp_path / "s1" / "acme" / "sessions" / owned / "lock"
    assert lock_is_free(lock)
    # The turn in flight finished inside the grace and was committed before exit.
    from replica.store import SessionStore
    from wire.names import parse_session_id

    history = SessionStore(tmp_path / "s1").read("acme", parse_session_id(owned), fleet.dek("acme"))
    assert [m.role for m in history.transcript.messages] == ["user", "assistant"]
    assert len(history.transcript.messages[1].content.split()) == 40


def test_metrics_carry_no_identifiers(fleet: Fleet, replica: Replica) -> None:
    sid = new_sid()
    grant = fleet.grant("acme-secret-tenant", sid)
    with replica.client() as client:
        post(client, sid, grant, {"type": "prompt", "message": "hello"})
        wait_turn(client, sid, grant, 2)
    scrape = replica.scrape()
    assert "agent_sessions_live" in scrape and "agent_threads" in scrape
    for needle in (sid, sid.split(".")[1], "acme", "a07-s1", "workspace"):
        assert needle not in scrape
