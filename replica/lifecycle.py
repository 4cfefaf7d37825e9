"""Lifecycle events to the control plane: run started/succeeded/failed/aborted, session_named,
session_archived. Fire-and-forget with a bounded queue and bounded retries: a slow or absent
control plane costs events (counted), never a turn.

``hand_off`` is the one synchronous call: a replica that does not hold a session passes a
job_ended report on and answers the sandbox 2xx only once the control plane has taken it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

log = logging.getLogger("replica.lifecycle")


@dataclass(frozen=True, slots=True)
class LifecycleConfig:
    url: str | None
    queue_size: int = 10_000
    attempts: int = 4
    attempt_timeout_s: float = 5.0
    backoff_s: float = 0.2


class Lifecycle:
    def __init__(
        self, config: LifecycleConfig, *, on_drop: Callable[[str], None] = lambda reason: None
    ) -> None:
        self.config = config
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(config.queue_size)
        self._on_drop = on_drop
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None
        self.delivered = 0

    async def start(self) -> None:
        if self.config.url is None:
            return
        self._client = httpx.AsyncClient(timeout=self.config.attempt_timeout_s)
        self._task = asyncio.create_task(self._worker(), name="lifecycle")

    def emit(self, event: dict[str, Any]) -> None:
        if self.config.url is None:
            return
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            self._on_drop("queue_full")

    async def hand_off(self, event: dict[str, Any], timeout_s: float) -> bool:
        """Deliver one event now; True only when the control plane answered 2xx in time."""
        if self._client is None or self.config.url is None:
            return False
        try:
            # A deadline for the whole exchange: a trickling answer must not stretch it.
            async with asyncio.timeout(timeout_s):
                response = await self._client.post(self.config.url, json=event)
        except (httpx.HTTPError, TimeoutError):
            return False
        return response.is_success

    async def _worker(self) -> None:
        while True:
            event = await self._queue.get()
            try:
                await self._deliver(event)
            except Exception:
                # One bad event must not stop every later one.
                log.exception("lifecycle event could not be sent")
                self._on_drop("rejected")
            finally:
                self._queue.task_done()

    async def _deliver(self, event: dict[str, Any]) -> None:
        assert self._client is not None and self.config.url is not None
        for attempt in range(self.config.attempts):
            try:
                response = await self._client.post(self.config.url, json=event)
            except httpx.HTTPError:
                response = None
            if response is not None and response.is_success:
                self.delivered += 1
                return
            status = response.status_code if response is not None else 0
            if 400 <= status < 500 and status != 429:
                self._on_drop("rejected")
                return
            await asyncio.sleep(self.config.backoff_s * 2**attempt)
        self._on_drop("undeliverable")
        log.warning("lifecycle event dropped after %d attempts", self.config.attempts)

    async def stop(self, flush_s: float = 2.0) -> None:
        if self._task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._queue.join(), flush_s)
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._client is not None:
            await self._client.aclose()
