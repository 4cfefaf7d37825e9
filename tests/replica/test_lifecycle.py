from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from fleet_sim.ports import free_port
from replica.lifecycle import Lifecycle, LifecycleConfig
from tests.harness import eventually_async

pytestmark = pytest.mark.anyio


class Receiver:
    """A control plane on 127.0.0.1 answering each POST with the next scripted status."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.delay_s = 0.0
        self.received: list[dict[str, Any]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        self.received.append(await request.json())
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return web.Response(status=self.statuses.pop(0) if self.statuses else 200)

    async def _trickle(self, request: web.Request) -> web.StreamResponse:
        """Answers 200 at once, then sends the body a byte at a time, 0.1 s apart."""
        self.received.append(await request.json())
        response = web.StreamResponse(status=200)
        response.content_length = 10
        await response.prepare(request)
        for _ in range(10):
            await asyncio.sleep(0.1)
            await response.write(b"x")
        return response

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/events", self._handle)
        app.router.add_post("/trickle", self._trickle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}/events"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    server = Receiver()
    await server.start()
    yield server
    await server.stop()


def config(url: str | None, **changes: Any) -> LifecycleConfig:
    fields: dict[str, Any] = {"attempt_timeout_s": 2.0, "backoff_s": 0.01, **changes}
    return LifecycleConfig(url, **fields)


async def started(cfg: LifecycleConfig, drops: list[str]) -> Lifecycle:
    lifecycle = Lifecycle(cfg, on_drop=drops.append)
    await lifecycle.start()
    return lifecycle


async def test_events_are_delivered_in_order(receiver: Receiver) -> None:
    drops: list[str] = []
    lifecycle = await started(config(receiver.url), drops)
    events = [{"type": "run", "phase": p, "run_id": "r1"} for p in ("started", "succeeded")]
    for event in events:
        lifecycle.emit(event)
    await lifecycle.stop(flush_s=5)
    assert receiver.received == events and lifecycle.delivered == 2 and drops == []


async def test_retries_a_503_then_delivers(receiver: Receiver) -> None:
    receiver.statuses = [503, 429, 200]
    drops: list[str] = []
    lifecycle = await started(config(receiver.url), drops)
    lifecycle.emit({"type": "session_named", "title": "t"})
    await lifecycle.stop(flush_s=5)
    assert receiver.received == [{"type": "session_named", "title": "t"}] * 3
    assert lifecycle.delivered == 1 and drops == []


async def test_a_4xx_is_dropped_at_once(receiver: Receiver) -> None:
    receiver.statuses = [400]
    drops: list[str] = []
    lifecycle = await started(config(receiver.url), drops)
    lifecycle.emit({"type": "run", "n": 1})
    lifecycle.emit({"type": "run", "n": 2})
    await lifecycle.stop(flush_s=5)
    assert [e["n"] for e in receiver.received] == [1, 2]  # one attempt at the refused event
    assert drops == ["rejected"] and lifecycle.delivered == 1


async def test_gives_up_after_the_attempts(receiver: Receiver) -> None:
    receiver.statuses = [503] * 10
    drops: list[str] = []
    lifecycle = await started(config(receiver.url, attempts=3), drops)
    lifecycle.emit({"type": "run"})
    await lifecycle.stop(flush_s=5)
    assert len(receiver.received) == 3 and drops == ["undeliverable"]
    assert lifecycle.delivered == 0


async def test_an_absent_control_plane_costs_events_not_time() -> None:
    port = free_port()  # nothing listens on it
    drops: list[str] = []
    lifecycle = await started(config(f"http://127.0.0.1:{port}/events", attempts=2), drops)
    started_at = time.monotonic()
    lifecycle.emit({"type": "run"})
    await lifecycle.stop(flush_s=5)
    assert drops == ["undeliverable"] and time.monotonic() - started_at < 2


async def test_a_full_queue_drops_and_counts() -> None:
    drops: list[str] = []
    lifecycle = Lifecycle(config("http://127.0.0.1:9/events", queue_size=2), on_drop=drops.append)
    for n in range(5):  # no worker yet: the queue fills
        lifecycle.emit({"n": n})
    assert drops == ["queue_full"] * 3
    await lifecycle.stop()
    silent = Lifecycle(config(None, queue_size=1), on_drop=drops.append)
    for n in range(5):
        silent.emit({"n": n})  # no URL: events go nowhere and count as nothing
    assert drops == ["queue_full"] * 3
    await silent.start()
    await silent.stop()


async def test_stop_flushes_what_is_queued(receiver: Receiver) -> None:
    receiver.delay_s = 0.02
    drops: list[str] = []
    lifecycle = await started(config(receiver.url), drops)
    for n in range(10):
        lifecycle.emit({"n": n})
    await lifecycle.stop(flush_s=5)
    assert [e["n"] for e in receiver.received] == list(range(10)) and lifecycle.delivered == 10


async def test_stop_gives_up_on_a_slow_control_plane_at_the_flush_bound(
    receiver: Receiver,
) -> None:
    receiver.delay_s = 1.0
    lifecycle = await started(config(receiver.url), [])
    for n in range(5):
        lifecycle.emit({"n": n})
    started_at = time.monotonic()
    await lifecycle.stop(flush_s=0.2)
    assert time.monotonic() - started_at < 0.8 and lifecycle.delivered == 0


async def test_one_bad_event_does_not_stop_delivery(receiver: Receiver) -> None:
    lifecycle = await started(config(receiver.url), [])
    lifecycle.emit({"type": "run", "bad": object()})
    lifecycle.emit({"type": "run", "n": 2})
    try:
        await eventually_async(lambda: receiver.received, timeout=0.5, interval=0.01)
        assert receiver.received == [{"type": "run", "n": 2}]
    finally:
        with contextlib.suppress(TypeError):
            await lifecycle.stop(flush_s=0.1)


async def test_hand_off_is_true_only_on_a_timely_2xx(receiver: Receiver) -> None:
    lifecycle = await started(config(receiver.url), [])
    event = {"type": "job_ended", "session_id": "a07-s1.x", "job_id": "j1"}
    try:
        receiver.statuses = [202, 503, 400, 302]
        assert await lifecycle.hand_off(event, 2.0) is True
        assert await lifecycle.hand_off(event, 2.0) is False
        assert await lifecycle.hand_off(event, 2.0) is False
        assert await lifecycle.hand_off(event, 2.0) is False
        assert len(receiver.received) == 4 and receiver.received[0] == event
        receiver.delay_s = 1.0
        started_at = time.monotonic()
        assert await lifecycle.hand_off(event, 0.2) is False
        assert time.monotonic() - started_at < 0.8
    finally:
        await lifecycle.stop()
    assert lifecycle.delivered == 0  # hand-offs are not queued events
    unstarted = Lifecycle(config(receiver.url))
    assert await unstarted.hand_off(event, 1.0) is False
    absent = Lifecycle(config(None))
    await absent.start()
    assert await absent.hand_off(event, 1.0) is False


async def test_hand_off_has_a_deadline_not_a_read_timeout(receiver: Receiver) -> None:
    lifecycle = await started(config(receiver.url.replace("/events", "/trickle")), [])
    try:
        started_at = time.monotonic()
        taken = await lifecycle.hand_off({"type": "job_ended"}, 0.3)
        elapsed = time.monotonic() - started_at
    finally:
        await lifecycle.stop()
    assert elapsed < 0.8 and taken is False
