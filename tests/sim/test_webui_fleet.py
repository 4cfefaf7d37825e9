"""The fleet view: takeovers from samples, what the page is shown and allowed to send, and the
page server's two fleet routes against fake replicas and a fake control endpoint."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from fleet_sim.webui.fleet import (
    REPLICA_TIMEOUT_S,
    Listed,
    ReplicaProbe,
    Sample,
    badge,
    check_fault,
    fault_verbs,
    render,
    replica_specs,
    short_id,
)
from fleet_sim.webui.server import WebConfig, start_webui
from fleet_sim.webui.takeovers import MAX_TAKEOVERS, Fault, Holding, Seen, Watch
from tests.harness import eventually_async

SID = "a07-s1.abcdefghijkl"
TOKEN = "control-token-never-shown"


def seen(at: float, *holdings: Holding, **extra: Any) -> Seen:
    return Seen(at, at + 0.1, 1_000_000 + at, holdings, **extra)


# -- takeovers ---------------------------------------------------------------------------------


def test_a_move_to_another_replica_is_a_takeover_measured_from_the_last_sighting() -> None:
    watch = Watch(SID)
    assert watch.observe(seen(0.0, Holding("r1", 1))) is None  # first sighting: no history
    assert watch.observe(seen(0.25, Holding("r1", 1, running=True))) is None
    assert watch.holding == Holding("r1", 1, running=True) and watch.since == 0.0
    lost = seen(0.5, conditions={"r1": "exited"})
    assert watch.observe(lost) is None
    assert watch.missing_since == 0.5 and watch.missing_cause == "exited"
    taken = watch.observe(seen(1.0, Holding("r2", 2)))
    assert taken is not None
    assert (taken.previous, taken.owner, taken.previous_epoch, taken.epoch) == ("r1", "r2", 1, 2)
    # From the last sample that saw it on r1 (started at 0.25) to when the one that saw r2
    # holding it had its answers (1.1): the real gap is inside that window.
    assert taken.unavailable_s == pytest.approx(0.85)
    assert taken.cause == "exited" and taken.at == 1_000_001.0
    assert watch.holding == Holding("r2", 2) and watch.missing_since is None


def test_a_fault_from_the_page_starts_the_window_and_names_the_cause() -> None:
    watch = Watch(SID)
    watch.observe(seen(0.0, Holding("r1", 1)))
    # A sample started after the kill was sent may still have been answered before it landed.
    killed = {"r1": Fault("killed", sent=0.2, answered=0.3)}
    watch.observe(seen(0.25, Holding("r1", 1), faults=killed))
    taken = watch.observe(seen(0.75, Holding("r3", 2), faults=killed))
    assert taken is not None and taken.cause == "killed from this page"
    assert taken.unavailable_s == pytest.approx(0.85 - 0.25)

    # A fault that was answered before a sample that still saw the session did not take it.
    watch = Watch(SID)
    drained = {"r1": Fault("drained", sent=0.1, answered=0.2)}
    watch.observe(seen(0.0, Holding("r1", 1)))
    watch.observe(seen(5.0, Holding("r1", 1), faults=drained))
    taken = watch.observe(seen(5.25, Holding("r2", 2), faults=drained, conditions={}))
    assert taken is not None and taken.cause == "let it go"


def test_the_same_replica_at_a_higher_epoch_is_a_takeover_and_a_lower_one_is_stale() -> None:
    watch = Watch(SID)
    watch.observe(seen(0.0, Holding("r1", 3)))
    assert watch.observe(seen(0.25, Holding("r2", 2))) is None  # fenced, still listing it
    assert watch.missing_since == 0.25
    taken = watch.observe(seen(0.5, Holding("r1", 4)))
    assert taken is not None and (taken.previous, taken.owner) == ("r1", "r1")
    # Two listings at once: the higher epoch owns it.
    assert watch.observe(seen(0.75, Holding("r2", 2), Holding("r1", 4))) is None
    assert watch.holding == Holding("r1", 4)


def test_no_figure_when_sampling_paused_inside_the_window() -> None:
    watch = Watch(SID)
    watch.observe(seen(0.0, Holding("r1", 1)))
    taken = watch.observe(seen(60.0, Holding("r2", 2)))  # nobody was looking for a minute
    assert taken is not None and taken.unavailable_s is None


def test_only_the_last_takeovers_are_kept() -> None:
    watch = Watch(SID)
    watch.observe(seen(0.0, Holding("r1", 1)))
    for epoch in range(2, MAX_TAKEOVERS + 5):
        assert watch.observe(seen(epoch * 0.25, Holding(f"r{epoch % 3 + 1}", epoch))) is not None
    assert len(watch.takeovers) == MAX_TAKEOVERS
    assert [t.seq for t in watch.takeovers] == list(range(4, MAX_TAKEOVERS + 4))


# -- what the page is shown and may send -------------------------------------------------------


def state(substrate: str = "local-dir") -> dict[str, Any]:
    return {
        "substrate": substrate,
        "supervisor_url": "http://127.0.0.1:1",
        "supervisor_token": TOKEN,
        "edge_pid": 10,
        "control_plane_pid": 11,
        "sandbox_pid": 12,
        "model_pid": None,
        "web_pid": 13,
        "replicas": [
            {
                "name": "r1",
                "slice": "a07",
                "url": "http://127.0.0.1:2",
                "metrics_url": "http://127.0.0.1:3/metrics",
                "pid": 20,
                "log": "/secret/place/r1.log",
            }
        ],
    }


def test_only_known_verbs_and_targets_are_sent() -> None:
    assert check_fault(state(), "kill", "r1") is None
    assert check_fault(state(), "restart", "edge") is None
    assert check_fault(state(), "explode", "r1") == (
        400,
        "unknown fault 'explode': one of kill, freeze, thaw, drain, restart",
    )
    assert check_fault(state(), "kill", "model") == (
        404,
        "no process named 'model' in this fleet: one of r1, edge, control-plane, sandbox, page",
    )
    assert check_fault(state(), ["kill"], "r1") is not None
    assert check_fault(state(), "partition", "r1") is not None
    for substrate in ("leasefs", "juicefs"):
        assert fault_verbs(substrate)[-2:] == ("partition", "heal")
        assert check_fault(state(substrate), "heal", "r1") is None


def test_badges_and_short_ids() -> None:
    assert badge("up", "answering", True) == ("ready", "ready")
    assert badge("up", "answering", False) == ("unready", "not ready")
    assert badge("frozen", "not answering", None) == ("frozen", "frozen")
    assert badge("waiting", "not listening", None) == ("down", "down · restarting")
    assert badge("starting", "not listening", None) == ("starting", "starting")
    assert badge(None, "not listening", None) == ("down", "not listening")
    assert badge("up", "not answering", None) == ("silent", "not answering")
    assert short_id("a07-s2.ZX9SibveZBdZe2Ih") == "a07-s2.ZX9S…"
    assert short_id("a07-s2.abc") == "a07-s2.abc"


def test_the_view_holds_nothing_secret_and_other_sessions_only_shortened() -> None:
    (spec,) = replica_specs(state())
    assert spec.sessions_url == "http://127.0.0.1:3/sessions"
    other = "a07-s2.someoneelsesXYZ"
    probe = ReplicaProbe(spec, "answering", True, "ready", (Listed(other, 1, True, 1),))
    sample = Sample(0.0, 0.1, 1.0, replicas=(probe,), pids={"edge": 10})
    shown = render(sample, None, None, 0.2)
    text = json.dumps(shown)
    assert TOKEN not in text and "/secret/place" not in text and other not in text
    assert shown["replicas"][0]["owned"] == [{"id": "a07-s2.some…", "open": False, "running": True}]


# -- the page server's routes ------------------------------------------------------------------


@dataclass
class FakeFleet:
    """Replicas (their /readyz and /sessions) and the up process's control endpoint."""

    holding: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    frozen: set[str] = field(default_factory=set)
    faults: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/{name}/readyz", self.readyz)
        app.router.add_get("/{name}/sessions", self.sessions)
        app.router.add_get("/v1/status", self.status)
        app.router.add_post("/v1/fault", self.fault)
        return app

    async def _stall(self, name: str) -> None:
        if name in self.frozen:
            await self.release.wait()

    async def readyz(self, request: web.Request) -> web.Response:
        await self._stall(request.match_info["name"])
        return web.Response(text="ready\n")

    async def sessions(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        await self._stall(name)
        return web.json_response({"replica": name, "sessions": self.holding.get(name, [])})

    def _authorized(self, request: web.Request) -> bool:
        return request.headers.get("authorization") == f"Bearer {TOKEN}"

    async def status(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": "a bearer token is needed"}, status=401)
        names = ["r1", "r2", "edge"]
        return web.json_response(
            {
                "processes": [
                    {
                        "name": n,
                        "kind": "edge" if n == "edge" else "replica",
                        "pid": 100 + i,
                        "state": "frozen" if n in self.frozen else "up",
                        "restarts": 0,
                        "storage": [],
                        "log": "/secret/place/x.log",
                    }
                    for i, n in enumerate(names)
                ]
            }
        )

    async def fault(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.faults.append((request.headers.get("authorization", ""), body))
        if body["verb"] == "thaw":
            return web.json_response({"error": f"{body['target']} is not frozen"}, status=409)
        return web.json_response({"message": f"{body['verb']} {body['target']}: done"})


@dataclass
class Rig:
    fleet: FakeFleet
    client: httpx.AsyncClient
    bodies: list[bytes]


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    fake = FakeFleet()
    runner = web.AppRunner(fake.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    state_file = tmp_path / "state.json"
    state_file.write_text(
        json.dumps(
            {
                "supervisor_url": base,
                "supervisor_token": TOKEN,
                "substrate": "local-dir",
                "edge_pid": 102,
                "replicas": [
                    {
                        "name": name,
                        "slice": "a07",
                        "url": f"{base}/{name}",
                        "metrics_url": f"{base}/{name}/metrics",
                        "pid": 100 + i,
                    }
                    for i, name in enumerate(["r1", "r2"])
                ],
            }
        )
    )
    # The fake edge is never asked: the fleet view does not go through it.
    config = WebConfig("http://127.0.0.1:9", state_file=state_file)
    page, url, _ = await start_webui(config)
    bodies: list[bytes] = []

    async def keep(response: httpx.Response) -> None:
        await response.aread()
        bodies.append(response.content)

    try:
        async with httpx.AsyncClient(
            base_url=url, timeout=10, event_hooks={"response": [keep]}
        ) as client:
            yield Rig(fake, client, bodies)
    finally:
        fake.release.set()
        await page.cleanup()
        await runner.cleanup()


async def attach(client: httpx.AsyncClient) -> None:
    answer = await client.post("/api/sessions/attach", json={"session_id": SID, "grant": "g.r.s"})
    assert answer.status_code == 201


async def view(client: httpx.AsyncClient, **params: str) -> dict[str, Any]:
    answer = await client.get("/api/fleet", params=params)
    assert answer.status_code == 200, answer.text
    data: dict[str, Any] = answer.json()
    return data


async def until(client: httpx.AsyncClient, check: Any, within_s: float = 10.0) -> dict[str, Any]:
    async def shown() -> dict[str, Any] | None:
        data = await view(client, session_id=SID)
        return data if check(data) else None

    found: dict[str, Any] = await eventually_async(
        shown, timeout=within_s, interval=0.05, message="the view never showed it"
    )
    return found


@pytest.mark.anyio
async def test_the_view_follows_the_open_session_and_a_frozen_replica_does_not_stall_it(
    rig: Rig,
) -> None:
    await attach(rig.client)
    rig.fleet.holding["r1"] = [{"session_id": SID, "epoch": 1, "running": True, "attached": 1}]
    data = await until(rig.client, lambda d: d["session"]["status"] == "held")
    assert data["session"]["owner"] == "r1" and data["session"]["epoch"] == 1
    r1, r2 = data["replicas"]
    assert r1["owns_open"] and r1["owned"] == [{"id": short_id(SID), "open": True, "running": True}]
    assert (r1["badge"], r1["live"], r2["live"], r2["owns_open"]) == ("ready", 1, 0, False)
    assert [p["name"] for p in data["processes"]] == ["edge"]

    rig.fleet.frozen.add("r1")
    started = time.monotonic()
    data = await until(rig.client, lambda d: d["replicas"][0]["badge"] == "frozen")
    assert time.monotonic() - started < 10 * REPLICA_TIMEOUT_S
    assert data["replicas"][0]["reach"] == "not answering"
    assert data["session"]["status"] == "moving" and data["session"]["cause"] == "frozen"

    rig.fleet.holding = {"r2": [{"session_id": SID, "epoch": 2, "running": False, "attached": 1}]}
    data = await until(rig.client, lambda d: d["session"]["status"] == "held")
    (takeover,) = data["session"]["takeovers"]
    assert takeover["from"] == "r1" and takeover["to"] == "r2" and takeover["cause"] == "frozen"
    assert takeover["from_epoch"] == 1 and takeover["to_epoch"] == 2
    assert takeover["unavailable_s"] > 0
    assert all(TOKEN.encode() not in b and b"g.r.s" not in b for b in rig.bodies)
    assert all(b"/secret/place" not in b for b in rig.bodies)


@pytest.mark.anyio
async def test_faults_go_to_the_control_endpoint_and_its_refusals_come_back(rig: Rig) -> None:
    sent = await rig.client.post("/api/fault", json={"verb": "kill", "target": "r2"})
    assert sent.status_code == 200 and sent.json() == {"message": "kill r2: done"}
    assert rig.fleet.faults == [(f"Bearer {TOKEN}", {"verb": "kill", "target": "r2"})]
    refused = await rig.client.post("/api/fault", json={"verb": "thaw", "target": "r1"})
    assert refused.status_code == 409 and refused.json() == {"error": "r1 is not frozen"}
    assert (await rig.client.post("/api/fault", json={"verb": "kill"})).status_code == 404
    assert (
        await rig.client.post("/api/fault", json={"verb": "hang", "target": "r1"})
    ).status_code == 400
    cross = await rig.client.post(
        "/api/fault",
        json={"verb": "kill", "target": "r1"},
        headers={"Origin": "http://evil.example"},
    )
    assert cross.status_code == 403
    assert len(rig.fleet.faults) == 2
    unknown = await rig.client.get("/api/fleet", params={"session_id": SID})
    assert unknown.status_code == 401  # this browser holds no grant for it
    assert all(TOKEN.encode() not in b for b in rig.bodies)


@pytest.mark.anyio
async def test_without_a_state_file_there_is_no_fleet_view() -> None:
    runner, url, _ = await start_webui(WebConfig("http://127.0.0.1:9"))
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            assert (await client.get("/api/config")).json()["fleet"] is False
            for answer in (
                await client.get("/api/fleet"),
                await client.post("/api/fault", json={"verb": "kill", "target": "r1"}),
            ):
                assert answer.status_code == 404
                assert "started without --state" in answer.json()["error"]
    finally:
        await runner.cleanup()
