"""Telling the model that a background job ended: exactly once, whoever holds the session.

A job belongs to the session's sandbox, not to a replica. The holder of a session reconciles by
reading the sandbox's jobs back and committing one notice for each job whose end the transcript
has not recorded yet; the notice's ``job_end`` is what makes a later reconcile, on this replica
or any other, skip it. Callbacks from the sandbox are only hints that it is worth looking: a lost,
repeated or forged one can delay a notice but never make one wrong or double.

Per session: one reconcile at a time, at most one a second, at most 16 callbacks waiting (the
next is refused 503, and the sandbox retries). Waiting callbacks are answered together when the
reconcile that started after they arrived completes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from replica.errors import ReplicaError, Unavailable
from replica.live import LiveSession
from replica.tools import Sandbox
from replica.transcript import Message, new_message_id

log = logging.getLogger("replica.jobs")
MAX_WAITING = 16
MIN_INTERVAL_S = 1.0


def notice(job: Any) -> Message:
    status = str(getattr(job.status, "value", job.status))
    if status == "exited":
        how = f"exited with status {job.exit_code}"
    elif status == "killed":
        how = "was killed"
    else:
        how = f"ended ({status})"
    return Message(
        new_message_id(),
        None,
        "event",
        f"background job {job.job_id} ({job.command}) {how}",
        time.time(),
        {"job_end": {"job_id": job.job_id, "status": status, "exit_code": job.exit_code}},
    )


class Reconciler:
    def __init__(
        self,
        live: LiveSession,
        sandbox: Callable[[LiveSession], Sandbox],
        *,
        max_waiting: int = MAX_WAITING,
        min_interval_s: float = MIN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.live = live
        self._sandbox = sandbox
        self.max_waiting = max_waiting
        self.min_interval_s = min_interval_s
        self._clock = clock
        self.waiting = 0
        self._requested = 0
        self._completed = 0
        self._last_start = float("-inf")
        self._changed = asyncio.Condition()
        self._runner: asyncio.Task[None] | None = None
        self.told = 0  # notices committed by this reconciler

    def due(self, interval_s: float) -> bool:
        """Nothing is running or waiting, and the last reconcile began ``interval_s`` ago."""
        idle = self._runner is None or self._runner.done()
        return idle and self._clock() - self._last_start >= interval_s

    async def request(self) -> None:
        """Wait for a reconcile that starts after now; 503 when too many already wait."""
        if self.waiting >= self.max_waiting:
            raise Unavailable("too many job-end callbacks are waiting; retry", reason="capacity")
        self.waiting += 1
        try:
            self._requested += 1
            mine = self._requested
            if self._runner is None or self._runner.done():
                self._runner = asyncio.create_task(self._run(), name="reconcile")
            async with self._changed:
                await self._changed.wait_for(lambda: self._completed >= mine)
        finally:
            self.waiting -= 1

    async def _run(self) -> None:
        while self._completed < self._requested:
            target = self._requested
            delay = self._last_start + self.min_interval_s - self._clock()
            if delay > 0:
                await asyncio.sleep(delay)
                target = self._requested  # whoever arrived while we waited is served too
            self._last_start = self._clock()
            try:
                await self.reconcile_once()
            except ReplicaError as exc:
                log.warning("reconciling jobs failed: %s", exc)
            async with self._changed:
                self._completed = target
                self._changed.notify_all()

    async def reconcile_once(self) -> int:
        """Read the sandbox's jobs and commit a notice for every untold end. Returns how many."""
        transcript = self.live.owned.transcript
        jobs = await self._sandbox(self.live).jobs()
        ended = [j for j in jobs if not j.running and j.job_id not in transcript.told_jobs]
        if not ended:
            return 0
        # Only this runner tells a session's job ends, one reconcile at a time, so what the
        # transcript says now is still true when the notices commit.
        notices = [notice(j) for j in sorted(ended, key=lambda j: (j.ended_at or 0, j.job_id))]
        if await self.live.commit(notices) is None:
            return 0
        self.told += len(notices)
        return len(notices)
