"""The reconciler with a fake sandbox: exactly once, one at a time, rate and waiting bounds."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from replica.errors import Unavailable
from replica.jobs import Reconciler
from replica.live import LiveSession, SessionContext
from replica.store import SessionStore
from replica.transcript import Message
from tests.harness import eventually_async
from wire.names import parse_session_id

DEK = bytes(range(32))


@dataclass
class Job:
    job_id: str
    status: str
    exit_code: int | None = None
    command: str = "sleep 1"
    ended_at: float | None = None

    @property
    def running(self) -> bool:
        return self.status == "running"


class FakeSandbox:
    def __init__(self, jobs: list[Job], delay: float = 0.0) -> None:
        self.jobs_list, self.delay, self.calls = jobs, delay, 0
        self.started: list[float] = []

    async def jobs(self) -> list[Job]:
        self.calls += 1
        self.started.append(time.monotonic())
        await asyncio.sleep(self.delay)  # a sandbox that takes a while to answer
        return list(self.jobs_list)

    async def exec(self, command: str, timeout_s: float) -> Any: ...
    async def start_job(self, command: str, url: str | None, token: str | None) -> Any: ...
    async def job_output(self, job_id: str, offset: int, limit: int) -> Any: ...
    async def kill(self, job_id: str) -> Any: ...


async def _run_io(fn: Any, *args: Any) -> Any:
    return fn(*args)


def live_session(root: Path) -> LiveSession:
    owned = SessionStore(root).open("acme", parse_session_id("a07-s1.jobs"), DEK)
    owned.commit(
        [
            Message(
                "t1",
                None,
                "tool",
                "started background job j1",
                1.0,
                {"job_id": "j1", "background": True},
            )
        ]
    )
    return LiveSession(
        "acme",
        owned.session,
        owned,
        SessionContext("http://x", (), "/w", DEK),
        run_io=_run_io,
        on_superseded=lambda live: None,
    )


@pytest.mark.anyio
async def test_an_end_is_told_once_however_often_it_is_asked(tmp_path: Path) -> None:
    live = live_session(tmp_path)
    assert live.owned.transcript.untold_jobs == {"j1"}
    sandbox = FakeSandbox([Job("j1", "running")])
    reconciler = Reconciler(live, lambda _: sandbox, min_interval_s=0.01)
    await reconciler.request()
    assert reconciler.told == 0
    sandbox.jobs_list = [Job("j1", "exited", 3, ended_at=2.0), Job("j2", "killed", None)]
    await asyncio.gather(*(reconciler.request() for _ in range(5)))
    await reconciler.request()
    notices = [m for m in live.owned.transcript.messages if m.role == "event"]
    assert [m.extra["job_end"]["job_id"] for m in notices] == ["j2", "j1"]
    assert "exited with status 3" in notices[1].content and "was killed" in notices[0].content
    assert live.owned.transcript.untold_jobs == set() and reconciler.told == 2
    live.owned.release()
    replayed = SessionStore(tmp_path).read("acme", live.session, DEK).transcript
    assert replayed.told_jobs == {"j1", "j2"}  # a later holder will not tell them again


@pytest.mark.anyio
async def test_one_at_a_time_at_most_once_a_second_sixteen_waiting(tmp_path: Path) -> None:
    live = live_session(tmp_path)
    sandbox = FakeSandbox([Job("j1", "running")], delay=0.2)
    reconciler = Reconciler(live, lambda _: sandbox, min_interval_s=0.5)
    waiters = [asyncio.create_task(reconciler.request())]
    # Its reconcile is running once it has asked the sandbox (which takes 0.2 s to answer).
    await eventually_async(lambda: sandbox.calls, timeout=2.0, message="no reconcile began")
    assert sandbox.calls == 1
    waiters += [asyncio.create_task(reconciler.request()) for _ in range(15)]
    await eventually_async(
        lambda: reconciler.waiting == 16, timeout=2.0, message="the 15 requests never all waited"
    )
    assert reconciler.waiting == 16
    with pytest.raises(Unavailable, match="too many"):
        await reconciler.request()
    await asyncio.gather(*waiters)
    # Everyone who arrived while the first reconcile ran shares the next one, a while later.
    assert sandbox.calls == 2
    assert sandbox.started[1] - sandbox.started[0] >= 0.5
    live.owned.release()
