"""Job-end callbacks against real replicas and the real sandbox service: the holder reconciles,
a non-holder hands off or refuses, forged and look-alike callbacks are refused, and a job's end
is told exactly once, also after the session was reaped before the job ended."""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from fleet_sim.local import Fleet, Replica
from fleet_sim.ports import free_port
from replica.keyfiles import read_key_file
from replica.notify import NotifyKey
from tests.harness import eventually, post

pytestmark = pytest.mark.slow
FLEET_DIR = "callbacks"  # the conftest fleet's directory


def self_notifying(fleet: Fleet, name: str, shard: Path, *extra: str) -> Replica:
    port = free_port()
    return fleet.replica(
        name,
        {"a07-s1": shard},
        *extra,
        listen=f"127.0.0.1:{port}",
        notify_origin=f"http://127.0.0.1:{port}",
    )


def messages(client: httpx.Client, sid: str, grant: str) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = post(client, sid, grant, {"type": "get_messages"}).json()["data"][
        "messages"
    ]
    return data


def notices(client: httpx.Client, sid: str, grant: str) -> list[dict[str, Any]]:
    return [m for m in messages(client, sid, grant) if m["role"] == "event"]


def test_the_holder_tells_a_jobs_end_once(fleet: Fleet, tmp_path: Path) -> None:
    replica = self_notifying(fleet, "holder", tmp_path / "s1")
    sid = f"a07-s1.{secrets.token_urlsafe(6)}"
    grant = fleet.grant("acme", sid)
    with replica.client() as client:
        post(client, sid, grant, {"type": "prompt", "message": "bg: sleep 0.3; echo job-done"})
        ended = eventually(lambda: notices(client, sid, grant), timeout=15)
        assert len(ended) == 1 and "exited with status 0" in ended[0]["content"]
        job_id = ended[0]["job_end"]["job_id"]
        # The model reads the job's output on a later turn, from where it left off.
        post(client, sid, grant, {"type": "prompt", "message": f"read: {job_id} 0"})
        eventually(
            lambda: any(
                "job-done" in m["content"]
                for m in messages(client, sid, grant)
                if m["role"] == "tool"
            ),
            timeout=15,
        )
        assert len(notices(client, sid, grant)) == 1
    scrape = replica.scrape()
    assert 'agent_job_callbacks_total{outcome="reconciled"} 1.0' in scrape


def test_forged_and_lookalike_callbacks_are_refused_first(fleet: Fleet, tmp_path: Path) -> None:
    replica = self_notifying(fleet, "gate", tmp_path / "s1")
    sid = f"a07-s1.{secrets.token_urlsafe(6)}"
    key = NotifyKey(read_key_file(fleet.keys_dir / "notify.key", what="notify key"))
    token = key.mint("acme", sid)
    body = json.dumps({"type": "job_ended", "job_id": "j1"}).encode()
    url = f"/_beyond/agent?session_id={sid}&tenant=acme"
    with replica.client() as client:
        forged = NotifyKey(bytes(32)).mint("acme", sid)
        assert (
            client.post(
                url, content=body, headers={"authorization": f"Bearer {forged}"}
            ).status_code
            == 401
        )
        for lookalike in (f"Bearer\t{token}", f"Bearer{token}"):
            assert (
                client.post(url, content=body, headers={"authorization": lookalike}).status_code
                == 400
            )
        other = key.mint("acme", f"a07-s1.{secrets.token_urlsafe(6)}")
        assert (
            client.post(url, content=body, headers={"authorization": f"Bearer {other}"}).status_code
            == 403
        )
        on_events = client.get(
            f"/_beyond/agent/events?session_id={sid}", headers={"authorization": f"Bearer {token}"}
        )
        assert on_events.status_code == 403
        # A genuine callback for a session no replica holds, and no lifecycle URL: 503.
        refused = client.post(url, content=body, headers={"authorization": f"Bearer {token}"})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    # No callback opened a session: nothing was created on the shard.
    assert not (tmp_path / "s1" / "acme").exists()
    assert token not in (fleet.root / "gate.log").read_text()


class Receiver:
    """A control plane stand-in: takes lifecycle events and records them."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.events.append(await request.json())
        return web.json_response({"accepted": True}, status=202)


def test_a_job_that_ends_after_the_session_was_reaped_is_told_on_reopen(
    fleet: Fleet, tmp_path: Path
) -> None:
    receiver = Receiver()
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/lifecycle", receiver.handle)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    lifecycle = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/lifecycle"
    try:
        replica = self_notifying(
            fleet,
            "reaper",
            tmp_path / "s1",
            "--session-idle-timeout",
            "0.5",
            "--lifecycle-url",
            lifecycle,
        )
        sid = f"a07-s1.{secrets.token_urlsafe(6)}"
        grant = fleet.grant("acme", sid)
        with replica.client() as client:
            post(client, sid, grant, {"type": "prompt", "message": "bg: sleep 3; echo late"})
            lock = tmp_path / "s1" / "acme" / "sessions" / sid / "lock"
            from replica.locking import lock_is_free

            eventually(lambda: lock_is_free(lock), timeout=10)  # reaped while the job runs

            def handed_off() -> bool:
                # The receiver serves only while its loop runs: run it for a slice per poll.
                loop.run_until_complete(asyncio.sleep(0.05))
                return any(e.get("type") == "job_ended" for e in receiver.events)

            eventually(handed_off, timeout=15)
            event = next(e for e in receiver.events if e.get("type") == "job_ended")
            assert event["session_id"] == sid and event["tenant"] == "acme"
            # The control plane's wake: opening the session reads the sandbox's jobs back.
            assert post(client, sid, grant, {"type": "get_state"}).status_code == 200
            told = eventually(lambda: notices(client, sid, grant), timeout=15)
            assert len(told) == 1 and "exited with status 0" in told[0]["content"]
        assert 'agent_job_callbacks_total{outcome="handed_off"} 1.0' in replica.scrape()
    finally:
        loop.run_until_complete(runner.cleanup())
        loop.close()
