from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web

from fleet_sim.ports import free_port
from fleet_sim.sandbox import (
    TOKEN_HEADER,
    SandboxConfig,
    sandbox_exec,
    start_sandbox_server,
)
from fleet_sim.sandbox_jobs import SandboxLimits
from replica.errors import ReplicaError
from replica.sandbox_client import (
    ExecResult,
    JobInfo,
    JobStatus,
    SandboxBadRequest,
    SandboxClient,
    SandboxError,
    SandboxNotFound,
    SandboxProtocolError,
    SandboxTimeout,
    SandboxTimeouts,
    SandboxUnauthorized,
    SandboxUnavailable,
    new_http_client,
)
from tests.harness import eventually_async

SECRET = b"c" * 32


@asynccontextmanager
async def sandbox_service(root: Path, config: SandboxConfig | None = None) -> AsyncIterator[str]:
    runner, base = await start_sandbox_server(root, secret=SECRET, config=config)
    try:
        yield base
    finally:
        await runner.cleanup()


@asynccontextmanager
async def scripted(status: int, body: str, content_type: str) -> AsyncIterator[str]:
    """A stand-in exec service that answers every request the same way."""

    async def answer(_: web.Request) -> web.Response:
        headers = {"Location": "http://127.0.0.1:9/elsewhere"} if status == 302 else None
        return web.Response(status=status, text=body, content_type=content_type, headers=headers)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/s/box"
    finally:
        await runner.cleanup()


def client(base: str, name: str = "box") -> SandboxClient:
    url, headers = sandbox_exec(base, SECRET, name)
    return SandboxClient(url, headers)


@pytest.mark.anyio
async def test_exec_returns_a_frozen_result(tmp_path: Path) -> None:
    async with sandbox_service(tmp_path) as base, client(base) as sandbox:
        result = await sandbox.exec("echo out; echo err >&2; exit 2")
        slow = await sandbox.exec("sleep 10", timeout_s=0.3)
    assert result == ExecResult(
        exit_code=2, stdout="out\n", stderr="err\n", truncated=False, timed_out=False
    )
    assert slow.timed_out is True and slow.exit_code is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.exit_code = 0  # type: ignore[misc]


@pytest.mark.anyio
async def test_job_lifecycle_through_the_client(tmp_path: Path) -> None:
    async with sandbox_service(tmp_path) as base, client(base) as sandbox:
        done = await sandbox.start_job("printf 'one two three'")
        assert isinstance(done, JobInfo) and done.status is JobStatus.RUNNING

        async def job_ended() -> bool:
            return not (await sandbox.job(done.job_id)).running

        await eventually_async(job_ended, timeout=10)
        finished = await sandbox.job(done.job_id)
        assert (finished.status, finished.exit_code, finished.output_bytes) == (
            JobStatus.EXITED,
            0,
            13,
        )
        assert finished.ended_at is not None and finished.ended_at >= finished.started_at
        head = await sandbox.job_output(done.job_id, 0, 4)
        tail = await sandbox.job_output(done.job_id, head.next_offset)
        assert (head.data, head.next_offset, head.eof) == ("one ", 4, False)
        assert (tail.data, tail.next_offset, tail.eof) == ("two three", 13, True)

        long = await sandbox.start_job("sleep 60")
        listed = {job.job_id: job.status for job in await sandbox.jobs()}
        assert listed == {done.job_id: JobStatus.EXITED, long.job_id: JobStatus.RUNNING}
        killed = await sandbox.kill(long.job_id)
        assert killed.status is JobStatus.KILLED and killed.exit_code is None


@pytest.mark.anyio
async def test_start_job_passes_the_notify_target(tmp_path: Path) -> None:
    seen: list[str] = []

    async def receive(request: web.Request) -> web.Response:
        seen.append(request.headers["Authorization"])
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/_beyond/agent", receive)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        notify_url = f"http://127.0.0.1:{runner.addresses[0][1]}/_beyond/agent"
        async with sandbox_service(tmp_path) as base, client(base) as sandbox:
            await sandbox.start_job("true", notify_url=notify_url, notify_token="bjn_v1.abc")
            await eventually_async(lambda: seen, timeout=10)
            with pytest.raises(SandboxBadRequest):
                await sandbox.start_job("true", notify_url=notify_url)
    finally:
        await runner.cleanup()
    assert seen == ["Bearer bjn_v1.abc"]


@pytest.mark.anyio
async def test_refusals_map_to_typed_errors_without_the_headers(tmp_path: Path) -> None:
    limits = SandboxLimits(max_running_jobs=1)
    async with sandbox_service(tmp_path, SandboxConfig(limits=limits)) as base:
        url, _ = sandbox_exec(base, SECRET, "box")
        foreign_token = sandbox_token_of("other", base)
        async with SandboxClient(url, {TOKEN_HEADER: foreign_token}) as wrong:
            with pytest.raises(SandboxUnauthorized) as refused:
                await wrong.jobs()
        assert refused.value.status == 401
        assert foreign_token not in str(refused.value) and foreign_token not in repr(wrong)
        async with client(base) as sandbox:
            with pytest.raises(SandboxNotFound) as missing:
                await sandbox.job("j0123456789abcdef")
            assert missing.value.status == 404
            with pytest.raises(SandboxBadRequest) as bad:
                await sandbox.exec("   ")
            assert bad.value.status == 400 and "command" in str(bad.value)
            with pytest.raises(SandboxBadRequest) as local:
                await sandbox.job("../exec")
            assert local.value.status is None
            await sandbox.start_job("sleep 30")
            with pytest.raises(SandboxUnavailable) as busy:
                await sandbox.start_job("sleep 30")
            assert busy.value.status == 429
    assert issubclass(SandboxError, ReplicaError)


def sandbox_token_of(name: str, base: str) -> str:
    return sandbox_exec(base, SECRET, name)[1][TOKEN_HEADER]


@pytest.mark.anyio
async def test_unreachable_and_silent_services_are_unavailable() -> None:
    port = free_port()
    async with SandboxClient(f"http://127.0.0.1:{port}/s/box", {TOKEN_HEADER: "t"}) as gone:
        with pytest.raises(SandboxUnavailable) as refused:
            await gone.jobs()
    assert not isinstance(refused.value, SandboxTimeout)

    release = asyncio.Event()
    handlers: list[asyncio.Task[None]] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        await release.wait()
        writer.close()
        await writer.wait_closed()

    async def track(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.append(task)
        await silent(reader, writer)

    server = await asyncio.start_server(track, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    timeouts = SandboxTimeouts(read_s=0.3)
    try:
        async with SandboxClient(
            f"http://127.0.0.1:{port}/s/box", {TOKEN_HEADER: "t"}, timeouts=timeouts
        ) as hung:
            started = time.monotonic()
            with pytest.raises(SandboxTimeout):
                await hung.jobs()
            assert time.monotonic() - started < 3
    finally:
        release.set()
        server.close()
        await server.wait_closed()
        await asyncio.wait_for(asyncio.gather(*handlers, return_exceptions=True), 5)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("status", "body", "content_type", "error"),
    [
        (503, '{"error": "busy, token=SECRET-VALUE"}', "application/json", SandboxUnavailable),
        (500, "<html>oops SECRET-VALUE</html>", "text/html", SandboxUnavailable),
        (403, '{"error": "no"}', "application/json", SandboxUnauthorized),
        (413, '{"error": "too big"}', "application/json", SandboxBadRequest),
        (200, "not json", "text/plain", SandboxProtocolError),
        (200, '{"jobs": "nope"}', "application/json", SandboxProtocolError),
        (302, "", "text/plain", SandboxProtocolError),
    ],
)
async def test_answers_map_to_errors_and_never_echo_header_values(
    status: int, body: str, content_type: str, error: type[SandboxError]
) -> None:
    async with (
        scripted(status, body, content_type) as url,
        SandboxClient(url, {TOKEN_HEADER: "SECRET-VALUE"}) as sandbox,
    ):
        with pytest.raises(error) as raised:
            await sandbox.jobs()
    assert "SECRET-VALUE" not in str(raised.value)
    if status == 503:
        assert "[redacted]" in str(raised.value) and raised.value.status == 503


@pytest.mark.anyio
async def test_sandbox_clients_share_one_pooled_http_client(tmp_path: Path) -> None:
    shared = new_http_client()
    try:
        async with sandbox_service(tmp_path) as base:
            clients = []
            for name in ("a", "b"):
                url, headers = sandbox_exec(base, SECRET, name)
                clients.append(SandboxClient(url, headers, http=shared))
            first, second = clients
            assert (await first.exec("pwd")).stdout.endswith("/a/workspace\n")
            await first.aclose()
            # Closing one session's client leaves the shared pool to the others.
            assert (await second.exec("pwd")).stdout.endswith("/b/workspace\n")
            assert not shared.is_closed
    finally:
        await shared.aclose()
