"""Helpers shared by the tests of real replica processes: session ids, a WebSocket client of a
session, the POST reads of a session's state and transcript, the turn counters a replica exposes,
and a control plane's lifecycle endpoint that keeps the events it is sent."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import websockets
from aiohttp import web

from tests.harness import Replica, agent_url, eventually, post

FRAME_WAIT_S = 10.0


def new_sid(shard: str = "a07-s1") -> str:
    return f"{shard}.{secrets.token_urlsafe(8)}"


# -- a WebSocket client --------------------------------------------------------------------------


class WsSession:
    """One WebSocket client of a session; every read is bounded, and each frame is stamped with
    the monotonic time it arrived."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.arrivals: list[tuple[float, dict[str, Any]]] = []

    async def send(self, command: dict[str, Any]) -> float:
        await self.ws.send(json.dumps(command))
        return time.monotonic()

    @property
    def frames(self) -> list[dict[str, Any]]:
        return [frame for _, frame in self.arrivals]

    async def recv(self, wait_s: float = FRAME_WAIT_S) -> dict[str, Any]:
        frame: dict[str, Any] = json.loads(await asyncio.wait_for(self.ws.recv(), wait_s))
        self.arrivals.append((time.monotonic(), frame))
        return frame

    async def until(
        self, done: Callable[[dict[str, Any]], bool], wait_s: float = FRAME_WAIT_S
    ) -> list[dict[str, Any]]:
        """Frames up to and including the first one ``done`` accepts."""
        frames: list[dict[str, Any]] = []
        async with asyncio.timeout(wait_s):
            while True:
                frames.append(await self.recv(wait_s))
                if done(frames[-1]):
                    return frames

    async def turn(self, message: str, wait_s: float = FRAME_WAIT_S) -> list[dict[str, Any]]:
        await self.send({"type": "prompt", "message": message})
        return await self.until(lambda f: kind(f) == "turn_ended", wait_s)


def kind(frame: dict[str, Any]) -> str:
    """A frame's type, or for an event frame its event kind."""
    return str(frame["event"]["kind"] if frame["type"] == "event" else frame["type"])


def events(frames: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [f["event"] for f in frames if f["type"] == "event" and f["event"]["kind"] == name]


def streamed_text(frames: list[dict[str, Any]]) -> str:
    return "".join(e["text"] for e in events(frames, "text_delta"))


@contextlib.asynccontextmanager
async def ws_session(
    replica: Replica, sid: str, grant: str
) -> AsyncIterator[tuple[WsSession, dict[str, Any]]]:
    """Attach to a session; yields the client and the catch-up frame."""
    url = replica.url.replace("http", "ws", 1) + agent_url(sid)
    async with websockets.connect(
        url, additional_headers={"x-beyond-grant": grant}, open_timeout=FRAME_WAIT_S
    ) as ws:
        session = WsSession(ws)
        catchup = await session.recv()
        assert catchup["type"] == "catchup"
        yield session, catchup


# -- POST helpers --------------------------------------------------------------------------------


def state(client: httpx.Client, sid: str, grant: str) -> dict[str, Any]:
    response = post(client, sid, grant, {"type": "get_state"})
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()["data"]
    return data


def settled_messages(
    client: httpx.Client, sid: str, grant: str, timeout: float = FRAME_WAIT_S
) -> list[dict[str, Any]]:
    """The transcript once no turn is running."""
    eventually(lambda: not state(client, sid, grant)["running"], timeout=timeout)
    messages: list[dict[str, Any]] = post(client, sid, grant, {"type": "get_messages"}).json()[
        "data"
    ]["messages"]
    return messages


# -- turn counters -------------------------------------------------------------------------------


def turn_outcomes(replica: Replica) -> dict[str, float]:
    found = re.findall(r'^agent_turns_total\{outcome="(\w+)"\} (\S+)$', replica.scrape(), re.M)
    return {outcome: float(value) for outcome, value in found}


def outcomes_since(replica: Replica, before: dict[str, float], turns: int) -> dict[str, float]:
    """How many turns ended with each outcome since ``before``, once ``turns`` have ended."""

    def ended() -> dict[str, float] | None:
        now = turn_outcomes(replica)
        delta = {k: v - before[k] for k, v in now.items()}
        return delta if sum(delta.values()) >= turns else None

    counted: dict[str, float] = eventually(ended)
    return counted


# -- a lifecycle receiver ------------------------------------------------------------------------

CONTRACT_FIELDS = (
    "type",
    "phase",
    "reason",
    "session_id",
    "parent_session_id",
    "tenant",
    "run_id",
    "title",
)


class Receiver:
    """A control plane's lifecycle endpoint: an aiohttp server on its own thread and loop that
    keeps every JSON body it is sent."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.url = ""
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._serve()), name="lifecycle-receiver", daemon=True
        )

    async def _take(self, request: web.Request) -> web.Response:
        self.received.append(await request.json())
        return web.Response(status=204)

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_post("/events", self._take)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{runner.addresses[0][1]}/events"
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            self._ready.set()
            await self._stop.wait()
        finally:
            self._ready.set()  # a failed start must not leave start() waiting
            await runner.cleanup()

    def start(self) -> Receiver:
        self._thread.start()
        assert self._ready.wait(10) and self.url, "the receiver did not start"
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):  # its loop already ended
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        assert not self._thread.is_alive(), "the receiver did not stop"

    def for_session(self, sid: str) -> list[dict[str, Any]]:
        """The events naming ``sid``, each cut down to the fields the contract defines."""
        return [
            {k: e[k] for k in CONTRACT_FIELDS if k in e}
            for e in list(self.received)
            if sid in (e.get("session_id"), e.get("parent_session_id"))
        ]
