"""The live-session registry: placement, the live-session cap, the idle reaper, and drain.

Placing a session takes its lock and replays it (blocking storage I/O, run on the storage
executor), once however many requests for it arrive together. A placement is shielded from the
request that started it: if that client goes away, the session still opens and is reaped later,
rather than a thread finishing the open with nobody left to release the lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from replica.coalescing import DEFAULT_COALESCING, Coalescing
from replica.errors import Forbidden, Misdirected, Unavailable
from replica.grants import Grant
from replica.live import SUBSCRIBER_QUEUE_FRAMES, LiveSession, LiveState, SessionContext
from replica.metrics import ReplicaMetrics
from replica.store import SessionStore
from wire.names import Shard

log = logging.getLogger("replica.registry")
PARK_AFTER_S = 2.0  # idle this long, a session gives back its segment descriptor
T = TypeVar("T")


class Registry:
    def __init__(
        self,
        stores: Mapping[Shard, SessionStore],
        *,
        max_live: int,
        idle_timeout_s: float,
        metrics: ReplicaMetrics,
        storage_threads: int = 64,
        queue_frames: int = SUBSCRIBER_QUEUE_FRAMES,
        coalescing: Coalescing = DEFAULT_COALESCING,
        clock: Callable[[], float] = time.monotonic,
        on_open: Callable[[LiveSession], None] = lambda live: None,
        shard_ok: Callable[[Shard], bool] = lambda shard: True,
    ) -> None:
        self.stores = stores
        self.max_live = max_live
        self.idle_timeout_s = idle_timeout_s
        self.metrics = metrics
        self.sessions: dict[str, LiveSession] = {}
        self.draining = False
        self._opening: dict[str, asyncio.Future[LiveSession]] = {}
        self._closing: dict[str, asyncio.Task[None]] = {}
        self._executor = ThreadPoolExecutor(storage_threads, thread_name_prefix="storage")
        self._clock = clock
        self._queue_frames = queue_frames
        self._coalescing = coalescing
        self._on_open = on_open
        self.shard_ok = shard_ok
        self._parking: dict[str, asyncio.Task[None]] = {}

    async def run_io(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def store_for(self, shard: Shard) -> SessionStore:
        store = self.stores.get(shard)
        if store is None:
            raise Misdirected(f"shard {shard} is not mounted on this replica")
        return store

    @property
    def runs_in_flight(self) -> int:
        return sum(1 for live in self.sessions.values() if live.running)

    async def place(self, grant: Grant) -> LiveSession:
        """The live session the grant names, opening it here if it is not open yet."""
        sid = str(grant.session)
        context = SessionContext(
            grant.exec_url, grant.exec_headers, grant.workspace_root, grant.dek
        )
        if not self.shard_ok(grant.session.shard):
            # Answer 503 so the edge walks on: a hung or failing mount would otherwise hold
            # every request for this session until it heals, long after a survivor could take
            # the session over (its lock lapses with the lease).
            raise Unavailable(
                "this replica's storage for the session is not answering; retry", reason="storage"
            )
        live = self.sessions.get(sid)
        if live is not None:
            if live.tenant != grant.tenant:
                raise Forbidden("the grant's tenant does not own this session")
            if live.state is not LiveState.OPEN:
                raise Unavailable(
                    "the session's previous task is still exiting; retry", reason="exiting"
                )
            live.context = context
            self._on_open(live)
            return live
        if sid in self._closing:
            raise Unavailable(
                "the session's previous task is still exiting; retry", reason="exiting"
            )
        pending = self._opening.get(sid)
        if pending is not None:
            live = await asyncio.shield(pending)
            if live.tenant != grant.tenant:
                raise Forbidden("the grant's tenant does not own this session")
            return live
        if self.draining:
            raise Unavailable("this replica is draining; retry", reason="draining")
        if len(self.sessions) + len(self._opening) >= self.max_live:
            raise Unavailable("this replica is at its live-session limit; retry", reason="capacity")
        store = self.store_for(grant.session.shard)
        future: asyncio.Future[LiveSession] = asyncio.get_running_loop().create_future()
        self._opening[sid] = future
        task = asyncio.create_task(self._open(store, grant, context, future), name="open")
        task.add_done_callback(lambda t: None if t.cancelled() else t.exception())
        return await asyncio.shield(future)

    async def _open(
        self,
        store: SessionStore,
        grant: Grant,
        context: SessionContext,
        future: asyncio.Future[LiveSession],
    ) -> None:
        sid = str(grant.session)
        started = self._clock()
        try:
            owned = await self.run_io(store.open, grant.tenant, grant.session, grant.dek)
        except BaseException as exc:
            self.metrics.lock_wait.observe(self._clock() - started)
            future.set_exception(exc)
            future.exception()  # retrieved here; every waiter re-raises its own copy
            return
        finally:
            self._opening.pop(sid, None)
        self.metrics.lock_wait.observe(self._clock() - started)
        live = LiveSession(
            grant.tenant,
            grant.session,
            owned,
            context,
            run_io=self.run_io,
            on_superseded=self._superseded,
            queue_frames=self._queue_frames,
            coalescing=self._coalescing,
            on_text_frame=self.metrics.text_frame,
        )
        self.sessions[sid] = live
        self.metrics.sessions_live.set(len(self.sessions))
        future.set_result(live)
        self._on_open(live)

    def _superseded(self, live: LiveSession) -> None:
        self.metrics.superseded.inc()
        log.warning("a session was taken over by another owner; this replica stopped serving it")
        self._start_close(live, final_state=LiveState.SUPERSEDED)

    def _start_close(self, live: LiveSession, *, final_state: LiveState) -> asyncio.Task[None]:
        existing = self._closing.get(live.session_id)
        if existing is not None:
            return existing
        if live.state is LiveState.OPEN:
            live.state = LiveState.CLOSING  # from now on place() answers "exiting"
        task = asyncio.create_task(self._close(live, final_state), name="close")
        self._closing[live.session_id] = task
        return task

    async def _close(self, live: LiveSession, final_state: LiveState) -> None:
        if live.state is LiveState.OPEN:
            live.state = LiveState.CLOSING
        try:
            turn = live.turn_task
            if turn is not None and not turn.done() and turn is not asyncio.current_task():
                turn.cancel()
                with contextlib.suppress(BaseException):
                    await turn
            live.close_readers()
            try:
                await self.run_io(live.owned.release)
            except OSError as exc:
                # Every commit was synced before it was acknowledged, so a close that fails
                # (a storage client that lost its metadata engine answers EIO) loses nothing.
                log.warning(
                    "closing a session's segment failed (%s); its lock is released", exc.strerror
                )
        finally:
            live.state = final_state if final_state is LiveState.SUPERSEDED else LiveState.CLOSED
            if self.sessions.get(live.session_id) is live:
                del self.sessions[live.session_id]
            self._closing.pop(live.session_id, None)
            self.metrics.sessions_live.set(len(self.sessions))

    async def close(self, live: LiveSession) -> None:
        await self._start_close(live, final_state=LiveState.CLOSED)

    def shed_shard(self, shard: Shard) -> int:
        """Storage for ``shard`` stopped answering: tell every reader of its sessions to
        reconnect, so clients re-place through the edge (which walks to a survivor once this
        replica's lease lapses) instead of waiting on a mount that may not come back."""
        shed = 0
        for live in self.sessions.values():
            if live.session.shard == shard:
                for subscriber in list(live.subscribers):
                    subscriber.shed()
                    shed += 1
        return shed

    def reap_once(self) -> int:
        now = self._clock()
        for live in self.sessions.values():
            parkable = not live.owned.parked and live.session_id not in self._parking
            if parkable and live.reapable(now, PARK_AFTER_S):
                task = asyncio.create_task(self._park(live), name="park")
                self._parking[live.session_id] = task
        idle = [s for s in self.sessions.values() if s.reapable(now, self.idle_timeout_s)]
        for live in idle:
            self.metrics.reaped.inc()
            self._start_close(live, final_state=LiveState.CLOSED)
        return len(idle)

    async def _park(self, live: LiveSession) -> None:
        try:
            await self.run_io(live.owned.park)
        finally:
            self._parking.pop(live.session_id, None)

    async def reaper(self) -> None:
        interval = max(0.05, min(self.idle_timeout_s / 4, 1.0))
        while True:
            await asyncio.sleep(interval)
            self.reap_once()

    async def drain(self, grace_s: float) -> None:
        """Refuse new placements, let runs in flight finish within the grace, then close all."""
        self.draining = True
        turns = [s.turn_task for s in self.sessions.values() if s.turn_task and s.running]
        if turns and grace_s > 0:
            await asyncio.wait(turns, timeout=grace_s)
        await asyncio.gather(*(self.close(live) for live in list(self.sessions.values())))
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._closing.values())

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
