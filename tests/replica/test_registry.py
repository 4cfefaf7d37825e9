from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from replica.errors import Forbidden, LockHeld, Misdirected, Unavailable
from replica.grants import Grant
from replica.live import LiveSession, LiveState
from replica.locking import lock_is_free
from replica.metrics import ReplicaMetrics
from replica.registry import Registry
from replica.store import LOCK_FILE, OwnedSession, SessionStore, StoreConfig
from tests.harness import eventually_async
from wire.names import SessionId, Shard, parse_session_id, parse_shard

pytestmark = pytest.mark.anyio
DEK = bytes(range(32))
SHARD = parse_shard("a07-s1")


@dataclass(frozen=True)
class SlowStore(SessionStore):
    """A real store whose opens take a while (a stand-in for slow storage, not a wait) and are
    counted, so overlap is certain."""

    opens: list[str] = field(default_factory=list)
    delay_s: float = 0.05

    def open(self, tenant: str, session: SessionId, dek: bytes) -> OwnedSession:
        self.opens.append(str(session))
        time.sleep(self.delay_s)
        return super().open(tenant, session, dek)


def grant(sid: str, tenant: str = "acme") -> Grant:
    session = parse_session_id(sid)
    return Grant(
        tenant=tenant,
        session=session,
        home_shard=session.shard,
        workspace_root="/work",
        exec_url="http://127.0.0.1:9/exec",
        dek=DEK,
        exec_headers=(),
        expires_at=2**40,
        kid="k1",
    )


@dataclass
class Rig:
    registry: Registry
    store: SlowStore
    metrics: ReplicaMetrics

    def lock_path(self, sid: str) -> Path:
        return self.store.directory("acme", parse_session_id(sid)) / LOCK_FILE

    def sample(self, name: str) -> float | None:
        return self.metrics.registry.get_sample_value(name)


async def make_rig(tmp_path: Path, **options: Any) -> Rig:
    store = SlowStore(tmp_path, StoreConfig(lock_wait_s=0.05))
    metrics = ReplicaMetrics()
    settings: dict[str, Any] = {"max_live": 10, "idle_timeout_s": 60.0, **options}
    registry = Registry({SHARD: store}, metrics=metrics, storage_threads=8, **settings)
    return Rig(registry, store, metrics)


async def gone(rig: Rig, sid: str) -> None:
    """Wait (bounded) until a close that was started has finished and dropped the session."""
    await eventually_async(
        lambda: sid not in rig.registry.sessions,
        timeout=2.0,
        interval=0.01,
        message=f"{sid} was not closed",
    )


async def opens_started(rig: Rig, count: int) -> None:
    """Wait (bounded) until ``count`` opens are under way in the store (each takes a while)."""
    await eventually_async(
        lambda: len(rig.store.opens) >= count,
        timeout=2.0,
        interval=0.001,
        message=f"{count} opens did not start",
    )


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    made = await make_rig(tmp_path)
    yield made
    await made.registry.drain(0)
    made.registry.shutdown()


async def test_concurrent_placements_open_once(rig: Rig) -> None:
    results = await asyncio.gather(*(rig.registry.place(grant("a07-s1.one")) for _ in range(6)))
    assert all(r is results[0] for r in results)
    assert rig.store.opens == ["a07-s1.one"]
    assert not lock_is_free(rig.lock_path("a07-s1.one"))
    assert rig.sample("agent_sessions_live") == 1.0
    assert rig.sample("agent_lock_wait_seconds_count") == 1.0
    # Once open, a placement is a lookup; the latest grant's context wins.
    later = grant("a07-s1.one")
    later = Grant(
        **{
            **{f: getattr(later, f) for f in Grant.__dataclass_fields__},
            "exec_url": "http://127.0.0.1:10/exec",
        }
    )
    again = await rig.registry.place(later)
    assert again is results[0] and again.context.exec_url == "http://127.0.0.1:10/exec"
    assert rig.store.opens == ["a07-s1.one"]


async def test_another_tenant_is_forbidden_open_or_opening(rig: Rig) -> None:
    opening = asyncio.create_task(rig.registry.place(grant("a07-s1.two")))
    await opens_started(rig, 1)
    with pytest.raises(Forbidden):
        await rig.registry.place(grant("a07-s1.two", tenant="evil"))
    await opening
    with pytest.raises(Forbidden):
        await rig.registry.place(grant("a07-s1.two", tenant="evil"))
    assert rig.store.opens == ["a07-s1.two"]


async def test_unmounted_shard_is_misdirected(rig: Rig) -> None:
    with pytest.raises(Misdirected):
        await rig.registry.place(grant("a08-s1.x"))
    with pytest.raises(Misdirected):
        rig.registry.store_for(Shard("a07", "s9"))


async def test_a_failed_open_reaches_every_waiter_and_can_be_retried(rig: Rig) -> None:
    holder = SessionStore(rig.store.root).open("acme", parse_session_id("a07-s1.held"), DEK)
    try:
        results = await asyncio.gather(
            *(rig.registry.place(grant("a07-s1.held")) for _ in range(3)), return_exceptions=True
        )
        assert all(isinstance(r, LockHeld) for r in results)
        assert rig.store.opens == ["a07-s1.held"]
        assert rig.registry.sessions == {} and rig.sample("agent_sessions_live") == 0.0
    finally:
        holder.release()
    live = await rig.registry.place(grant("a07-s1.held"))
    assert live.session_id == "a07-s1.held" and len(rig.store.opens) == 2


async def test_placement_survives_the_requester_going_away(rig: Rig) -> None:
    request = asyncio.create_task(rig.registry.place(grant("a07-s1.gone")))
    await opens_started(rig, 1)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    await eventually_async(
        lambda: "a07-s1.gone" in rig.registry.sessions, timeout=1.0, interval=0.01
    )
    # The open finished and is held by the registry (to be reaped), not leaked by a thread.
    assert "a07-s1.gone" in rig.registry.sessions
    assert not lock_is_free(rig.lock_path("a07-s1.gone"))


async def test_the_live_session_cap_refuses(tmp_path: Path) -> None:
    rig = await make_rig(tmp_path, max_live=2)
    try:
        opening = [asyncio.create_task(rig.registry.place(grant(f"a07-s1.c{i}"))) for i in (1, 2)]
        await opens_started(rig, 2)
        # Sessions still opening count against the cap too.
        with pytest.raises(Unavailable) as info:
            await rig.registry.place(grant("a07-s1.c3"))
        assert info.value.reason == "capacity"
        await asyncio.gather(*opening)
        with pytest.raises(Unavailable) as info:
            await rig.registry.place(grant("a07-s1.c3"))
        assert info.value.reason == "capacity"
        assert (await rig.registry.place(grant("a07-s1.c1"))).session_id == "a07-s1.c1"
        await rig.registry.close(rig.registry.sessions["a07-s1.c1"])
        assert (await rig.registry.place(grant("a07-s1.c3"))).session_id == "a07-s1.c3"
    finally:
        await rig.registry.drain(0)
        rig.registry.shutdown()


async def test_a_closing_session_is_exiting(rig: Rig) -> None:
    live = await rig.registry.place(grant("a07-s1.exit"))
    closing = asyncio.create_task(rig.registry.close(live))
    # Polled at every turn of the loop: the close (a release in a thread) may end soon after.
    await eventually_async(
        lambda: live.state is not LiveState.OPEN,
        timeout=2.0,
        interval=0,
        message="the close never began",
    )
    assert live.state.value == "closing"
    with pytest.raises(Unavailable) as info:
        await rig.registry.place(grant("a07-s1.exit"))
    assert info.value.reason == "exiting"
    await closing
    assert live.state is LiveState.CLOSED and lock_is_free(rig.lock_path("a07-s1.exit"))
    reopened = await rig.registry.place(grant("a07-s1.exit"))
    assert reopened is not live and reopened.owned.epoch == 2


async def test_a_session_being_reaped_is_never_handed_out(rig: Rig) -> None:
    live = await rig.registry.place(grant("a07-s1.doomed"))
    live.idle_since = time.monotonic() - 120
    assert rig.registry.reap_once() == 1
    try:
        with pytest.raises(Unavailable):
            await rig.registry.place(grant("a07-s1.doomed"))
    finally:
        await gone(rig, "a07-s1.doomed")


async def test_reap_once_closes_only_detached_idle_sessions(rig: Rig) -> None:
    lives: dict[str, LiveSession] = {}
    for name in ("idle", "attached", "held", "running", "fresh"):
        lives[name] = await rig.registry.place(grant(f"a07-s1.{name}"))
    old = time.monotonic() - 120
    for name in ("idle", "attached", "held", "running"):
        lives[name].idle_since = old
    lives["attached"].attach("ws")
    lives["held"].hold()
    turn = asyncio.create_task(asyncio.sleep(10))
    lives["running"].turn_task = turn
    try:
        assert rig.registry.reap_once() == 1
        await gone(rig, "a07-s1.idle")
        assert sorted(rig.registry.sessions) == [
            "a07-s1.attached",
            "a07-s1.fresh",
            "a07-s1.held",
            "a07-s1.running",
        ]
        assert lives["idle"].state is LiveState.CLOSED and not lives["idle"].owned.open
        assert lock_is_free(rig.lock_path("a07-s1.idle"))
        assert not lock_is_free(rig.lock_path("a07-s1.running"))
        assert rig.sample("agent_sessions_reaped_total") == 1.0
        assert rig.sample("agent_sessions_live") == 4.0
        assert rig.registry.reap_once() == 0
    finally:
        turn.cancel()


async def test_drain_waits_for_a_running_turn_within_the_grace(rig: Rig) -> None:
    live = await rig.registry.place(grant("a07-s1.busy"))
    idle = await rig.registry.place(grant("a07-s1.quiet"))
    turn = asyncio.create_task(asyncio.sleep(0.2))  # a stand-in turn that runs 0.2 s
    live.turn_task = turn
    started = time.monotonic()
    await rig.registry.drain(5.0)
    elapsed = time.monotonic() - started
    assert 0.15 < elapsed < 2 and turn.done() and not turn.cancelled()
    assert rig.registry.sessions == {} and rig.sample("agent_sessions_live") == 0.0
    assert live.state is idle.state is LiveState.CLOSED
    assert lock_is_free(rig.lock_path("a07-s1.busy")) and lock_is_free(
        rig.lock_path("a07-s1.quiet")
    )
    with pytest.raises(Unavailable) as info:
        await rig.registry.place(grant("a07-s1.new"))
    assert info.value.reason == "draining"


async def test_drain_cuts_a_turn_that_outlives_the_grace(rig: Rig) -> None:
    live = await rig.registry.place(grant("a07-s1.long"))
    turn = asyncio.create_task(asyncio.sleep(30))
    live.turn_task = turn
    started = time.monotonic()
    await rig.registry.drain(0.2)
    assert 0.15 < time.monotonic() - started < 2
    assert turn.cancelled() and rig.registry.sessions == {}
    assert lock_is_free(rig.lock_path("a07-s1.long"))


async def test_a_superseded_session_is_closed_and_counted(rig: Rig) -> None:
    live = await rig.registry.place(grant("a07-s1.fenced"))
    live.supersede()
    await gone(rig, "a07-s1.fenced")
    assert live.state is LiveState.SUPERSEDED and rig.registry.sessions == {}
    assert rig.sample("agent_sessions_superseded_total") == 1.0
    assert lock_is_free(rig.lock_path("a07-s1.fenced"))


async def test_a_segment_that_fails_to_close_still_releases_the_lock(rig: Rig) -> None:
    # A storage client that lost its metadata engine answers close() with EIO; here the
    # descriptor is closed underneath the store so its close fails the same way (EBADF).
    live = await rig.registry.place(grant("a07-s1.eio"))
    os.close(live.owned._fd)
    await rig.registry.close(live)
    assert live.state is LiveState.CLOSED and rig.registry.sessions == {}
    assert lock_is_free(rig.lock_path("a07-s1.eio"))
    reopened = await rig.registry.place(grant("a07-s1.eio"))
    assert reopened.owned.epoch == 2
