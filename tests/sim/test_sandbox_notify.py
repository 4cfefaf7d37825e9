from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from fleet_sim.ports import free_port
from fleet_sim.sandbox import SandboxConfig, sandbox_exec, start_sandbox_server
from fleet_sim.sandbox_notify import (
    DeliveryRecord,
    DeliveryState,
    Notifier,
    NotifyPolicy,
    NotifyTarget,
    Verdict,
    backoff_delay,
    classify,
    next_delay,
    parse_retry_after,
)
from tests.harness import eventually_async

TOKEN = "bjn_v1.c2VjcmV0LXRva2VuLXZhbHVl.Zm9v"
SECRET = b"n" * 32
FAST = NotifyPolicy(
    total_budget_s=5.0, attempt_timeout_s=2.0, backoff_base_s=0.05, backoff_cap_s=0.2
)


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    delay_s: float = 0.0


@dataclass(slots=True)
class Receiver:
    """A job-end receiver answering a script of statuses (the last one repeats)."""

    script: list[Answer]
    seen: list[tuple[float, dict[str, str], bytes]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append((time.monotonic(), dict(request.headers), await request.read()))
        answer = self.script[min(len(self.seen), len(self.script)) - 1]
        if answer.delay_s:
            await asyncio.sleep(answer.delay_s)
        return web.Response(status=answer.status, text="noted")


@asynccontextmanager
async def receiving(receiver: Receiver, port: int = 0) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/_beyond/agent", receiver.handle)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        bound = runner.addresses[0][1]
        yield f"http://127.0.0.1:{bound}/_beyond/agent?session_id=a07-s1.x&tenant=t1"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def notifier(policy: NotifyPolicy = FAST) -> AsyncIterator[Notifier]:
    running = Notifier(policy, unit=lambda: 0.5)
    await running.start()
    try:
        yield running
    finally:
        await running.close()


async def settled(record: DeliveryRecord, timeout_s: float = 10.0) -> DeliveryRecord:
    await eventually_async(
        lambda: record.state is not DeliveryState.PENDING and record.finished_at is not None,
        timeout=timeout_s,
        interval=0.01,
        message="delivery did not finish in time",
    )
    return record


def send(running: Notifier, url: str) -> DeliveryRecord:
    event = {"type": "job_ended", "job_id": "j1", "status": "exited", "exit_code": 0}
    return running.notify(
        sandbox="box", job_id="j1", target=NotifyTarget(url=url, token=TOKEN), event=event
    )


# --- the pure decision ---


def test_classify_follows_the_callback_rules() -> None:
    for status in (200, 201, 202, 204):
        assert classify(status) is Verdict.DELIVERED
    for status in (301, 400, 401, 403, 404, 409, 410, 411, 413, 422):
        assert classify(status) is Verdict.REFUSED
    for maybe in (None, 408, 429, 500, 502, 503, 504):
        assert classify(maybe) is Verdict.RETRY


def test_backoff_grows_with_jitter_and_is_capped() -> None:
    policy = NotifyPolicy(backoff_base_s=1.0, backoff_cap_s=8.0)
    assert [backoff_delay(policy, n, 0.0) for n in range(1, 6)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert [backoff_delay(policy, n, 0.999) for n in range(1, 6)][-1] < 8.0
    assert backoff_delay(policy, 10_000, 1.0) == 8.0


def test_next_delay_stays_inside_the_budget_and_honours_retry_after() -> None:
    policy = NotifyPolicy(total_budget_s=723.0, backoff_base_s=1.0, backoff_cap_s=30.0)
    assert next_delay(policy, failures=1, elapsed_s=0.0, retry_after_s=None, unit=0.0) == 0.5
    assert next_delay(policy, failures=1, elapsed_s=0.0, retry_after_s=5, unit=0.0) == 5.0
    # Retry-After is capped, and never stretches past the budget.
    assert next_delay(policy, failures=1, elapsed_s=0.0, retry_after_s=1e6, unit=0.0) == 60.0
    assert next_delay(policy, failures=1, elapsed_s=700.0, retry_after_s=30, unit=0.0) is None
    assert next_delay(policy, failures=20, elapsed_s=708.0, retry_after_s=None, unit=0.0) is None
    assert next_delay(policy, failures=20, elapsed_s=707.0, retry_after_s=None, unit=0.0) == 15.0


def test_parse_retry_after() -> None:
    assert parse_retry_after("3", now=0.0) == 3.0
    assert parse_retry_after("Thu, 01 Jan 1970 00:00:10 GMT", now=4.0) == 6.0
    assert parse_retry_after(None, now=0.0) is None
    assert parse_retry_after("soon", now=0.0) is None


def test_policy_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        NotifyPolicy(total_budget_s=0)
    with pytest.raises(ValueError):
        NotifyPolicy(total_budget_s=10, attempt_timeout_s=11)
    with pytest.raises(ValueError):
        NotifyPolicy(backoff_base_s=2, backoff_cap_s=1)


# --- deliveries against a real receiver ---


@pytest.mark.anyio
@pytest.mark.parametrize("status", [200, 204, 400, 401, 403, 404, 410, 411, 413])
async def test_a_final_status_stops_after_one_attempt(status: int) -> None:
    receiver = Receiver([Answer(status)])
    async with receiving(receiver) as url, notifier() as running:
        record = await settled(send(running, url))
        # Long enough for a retry to have happened had one been scheduled.
        await asyncio.sleep(0.3)
    expected = DeliveryState.DELIVERED if status < 300 else DeliveryState.REFUSED
    assert record.state is expected
    assert [attempt.status for attempt in record.attempts] == [status]
    assert len(receiver.seen) == 1


@pytest.mark.anyio
@pytest.mark.parametrize("transient", [503, 429, 500])
async def test_transient_statuses_are_retried_until_taken(transient: int) -> None:
    receiver = Receiver([Answer(transient), Answer(transient), Answer(200)])
    async with receiving(receiver) as url, notifier() as running:
        record = await settled(send(running, url))
    assert record.state is DeliveryState.DELIVERED
    assert [attempt.status for attempt in record.attempts] == [transient, transient, 200]
    times = [seen[0] for seen in receiver.seen]
    # unit=0.5 makes the pauses 0.0375 s and then 0.075 s.
    assert times[1] - times[0] >= 0.03 and times[2] - times[1] >= 0.07


@pytest.mark.anyio
async def test_refused_connections_are_retried_until_the_receiver_listens() -> None:
    port = free_port()
    receiver = Receiver([Answer(200)])
    async with notifier() as running:
        record = send(running, f"http://127.0.0.1:{port}/_beyond/agent?session_id=a07-s1.x")
        await eventually_async(lambda: len(record.attempts) >= 2, timeout=5, interval=0.01)
        async with receiving(receiver, port):
            await settled(record)
    assert record.state is DeliveryState.DELIVERED
    failures = record.attempts[:-1]
    assert all(a.status is None and (a.error or "").startswith("connect failed") for a in failures)
    assert record.attempts[-1].status == 200 and len(receiver.seen) == 1


@pytest.mark.anyio
async def test_gives_up_when_the_total_budget_is_spent() -> None:
    policy = NotifyPolicy(
        total_budget_s=1.0, attempt_timeout_s=0.5, backoff_base_s=0.05, backoff_cap_s=0.2
    )
    receiver = Receiver([Answer(503)])
    async with receiving(receiver) as url, notifier(policy) as running:
        started = time.monotonic()
        record = await settled(send(running, url))
        took = time.monotonic() - started
    assert record.state is DeliveryState.EXPIRED
    assert len(record.attempts) >= 4
    assert all(attempt.status == 503 for attempt in record.attempts)
    last = record.attempts[-1]
    assert last.elapsed_s + last.duration_s <= 1.0
    assert 0.8 <= took <= 1.3


@pytest.mark.anyio
async def test_a_slow_attempt_is_abandoned_at_the_attempt_timeout() -> None:
    policy = NotifyPolicy(
        total_budget_s=5.0, attempt_timeout_s=0.3, backoff_base_s=0.05, backoff_cap_s=0.1
    )
    receiver = Receiver([Answer(200, delay_s=3.0), Answer(200)])
    async with receiving(receiver) as url, notifier(policy) as running:
        record = await settled(send(running, url))
    assert record.state is DeliveryState.DELIVERED
    first, second = record.attempts
    assert (first.status, first.error) == (None, "timeout")
    assert 0.3 <= first.duration_s < 1.0
    assert second.status == 200


@pytest.mark.anyio
async def test_closing_the_notifier_cancels_pending_deliveries() -> None:
    receiver = Receiver([Answer(503)])
    async with receiving(receiver) as url:
        async with notifier() as running:
            record = send(running, url)
            # Refused once (503): the delivery now waits to try again.
            await eventually_async(
                lambda: record.attempts, timeout=5, message="the first attempt was never made"
            )
        assert running.pending == 0
    assert record.state is DeliveryState.CANCELLED and record.finished_at is not None


# --- end to end: a sandbox job's end reaches a receiver ---


def no_token_in(records: list[logging.LogRecord]) -> bool:
    for record in records:
        text = " ".join(
            (record.getMessage(), str(record.args), record.exc_text or "", str(record.__dict__))
        )
        if TOKEN in text or "c2VjcmV0LXRva2VuLXZhbHVl" in text:
            return False
    return True


async def job_with_notify(
    base: str, name: str, command: str, url: str, after: Callable[[httpx.AsyncClient, str], object]
) -> str:
    exec_url, headers = sandbox_exec(base, SECRET, name)
    async with httpx.AsyncClient(headers=headers, trust_env=False, timeout=10.0) as client:
        body = {"command": command, "background": True, "notify": {"url": url, "token": TOKEN}}
        answer = await client.post(f"{exec_url}/exec", json=body)
        assert answer.status_code == 201
        job_id = str(answer.json()["job_id"])
        step = after(client, f"{exec_url}/jobs/{job_id}")
        if asyncio.iscoroutine(step):
            await step
    return job_id


async def notifications(base: str) -> tuple[str, list[dict[str, Any]]]:
    async with httpx.AsyncClient(trust_env=False) as client:
        answer = await client.get(f"{base}/_sim/notifications")
    assert answer.status_code == 200
    return answer.text, answer.json()["notifications"]


async def settled_on_server(base: str, count: int) -> tuple[str, list[dict[str, Any]]]:
    async def all_settled() -> tuple[str, list[dict[str, Any]]] | None:
        text, listed = await notifications(base)
        done = len(listed) == count and all(item["state"] != "pending" for item in listed)
        return (text, listed) if done else None

    found: tuple[str, list[dict[str, Any]]] = await eventually_async(
        all_settled, timeout=10, message="notifications did not settle"
    )
    return found


@pytest.mark.anyio
async def test_job_end_is_posted_with_the_token_exactly_and_recorded_without_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    receiver = Receiver([Answer(503), Answer(200)])
    async with receiving(receiver) as url:
        runner, base = await start_sandbox_server(
            tmp_path, secret=SECRET, config=SandboxConfig(notify=FAST)
        )
        try:
            job_id = await job_with_notify(base, "box", "exit 3", url, lambda *_: None)
            text, listed = await settled_on_server(base, 1)
        finally:
            await runner.cleanup()
    assert len(receiver.seen) == 2
    for _, headers, body in receiver.seen:
        assert headers["Authorization"] == f"Bearer {TOKEN}"
        assert headers["Content-Type"] == "application/json"
        event = {"type": "job_ended", "job_id": job_id, "status": "exited", "exit_code": 3}
        assert json.loads(body) == event
    (entry,) = listed
    assert entry["state"] == "delivered" and entry["job_id"] == job_id
    assert entry["url"] == url and entry["sandbox"] == "box"
    assert [a["status"] for a in entry["attempts"]] == [503, 200]
    assert TOKEN not in text and "c2VjcmV0LXRva2VuLXZhbHVl" not in text
    assert any(job_id in record.getMessage() for record in caplog.records)
    assert no_token_in(caplog.records)


@pytest.mark.anyio
async def test_a_killed_job_is_reported_as_killed(tmp_path: Path) -> None:
    receiver = Receiver([Answer(200)])

    async def kill(client: httpx.AsyncClient, job_url: str) -> None:
        assert (await client.delete(job_url)).status_code == 200

    async with receiving(receiver) as url:
        runner, base = await start_sandbox_server(
            tmp_path, secret=SECRET, config=SandboxConfig(notify=FAST)
        )
        try:
            job_id = await job_with_notify(base, "box", "sleep 60", url, kill)
            _, listed = await settled_on_server(base, 1)
        finally:
            await runner.cleanup()
    assert listed[0]["state"] == "delivered"
    assert json.loads(receiver.seen[0][2]) == {
        "type": "job_ended",
        "job_id": job_id,
        "status": "killed",
        "exit_code": None,
    }


@pytest.mark.anyio
async def test_a_job_without_notify_posts_nothing(tmp_path: Path) -> None:
    runner, base = await start_sandbox_server(tmp_path, secret=SECRET)
    try:
        exec_url, headers = sandbox_exec(base, SECRET, "box")
        async with httpx.AsyncClient(headers=headers, trust_env=False) as client:
            body = {"command": "true", "background": True, "notify": None}
            job_id = (await client.post(f"{exec_url}/exec", json=body)).json()["job_id"]

            async def finished() -> bool:
                job = (await client.get(f"{exec_url}/jobs/{job_id}")).json()
                return bool(job["status"] != "running")

            await eventually_async(finished, timeout=5)
        _, listed = await notifications(base)
    finally:
        await runner.cleanup()
    assert listed == []
