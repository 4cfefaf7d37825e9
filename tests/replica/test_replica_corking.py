"""A replica's small answers leave in one write; a head whose body waits is not held back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from replica.corking import CorkedHttp, HeldHead
from tests.harness import eventually_async

pytestmark = pytest.mark.anyio

WRITES: list[bytes] = []  # every write the server made on any connection, in order


class _Counting:
    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def write(self, data: bytes) -> None:
        WRITES.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CountingCorkedHttp(CorkedHttp):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(_Counting(transport))  # type: ignore[arg-type]


async def small(request: Request) -> Response:
    return JSONResponse({"ok": True})


async def slow_stream(request: Request) -> Response:
    async def body() -> AsyncIterator[bytes]:
        await asyncio.sleep(0.5)
        yield b"data: late\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


@contextlib.asynccontextmanager
async def serving() -> AsyncIterator[tuple[str, int]]:
    app = Starlette(routes=[Route("/small", small), Route("/stream", slow_stream)])
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, http=CountingCorkedHttp, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    await eventually_async(
        lambda: server.started, timeout=5.0, interval=0.01, message="uvicorn did not start"
    )
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield "127.0.0.1", port
    finally:
        server.should_exit = True
        await task


async def test_a_small_answer_is_one_write_and_keep_alive_still_works() -> None:
    WRITES.clear()
    async with serving() as (host, port):
        reader, writer = await asyncio.open_connection(host, port)
        for _ in range(3):
            writer.write(b"GET /small HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            assert await reader.readexactly(11) == b'{"ok":true}'
        writer.close()
    assert len(WRITES) == 3
    assert all(w.startswith(b"HTTP/1.1 200") and w.endswith(b'{"ok":true}') for w in WRITES)


async def test_a_head_whose_body_waits_goes_out_at_once() -> None:
    WRITES.clear()
    async with serving() as (host, port):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.3)  # before the body
        assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
        assert b"data: late" in await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5)
        writer.close()


class _Recorder:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


async def test_held_head_joins_flushes_and_never_writes_after_close() -> None:
    loop = asyncio.get_running_loop()
    recorder = _Recorder()
    held = HeldHead(recorder, loop)  # type: ignore[arg-type]
    held.write(b"head")
    assert recorder.written == []
    held.write(b"body")
    held.write(b"more")
    assert recorder.written == [b"headbody", b"more"]

    alone = _Recorder()
    HeldHead(alone, loop).write(b"head")  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert alone.written == [b"head"]  # out by the end of the loop iteration

    closing = _Recorder()
    head_only = HeldHead(closing, loop)  # type: ignore[arg-type]
    head_only.write(b"head")
    head_only.close()
    assert closing.written == [b"head"] and closing.closed

    gone = _Recorder()
    late = HeldHead(gone, loop)  # type: ignore[arg-type]
    late.write(b"head")
    gone.closed = True  # the client went away before the iteration ended
    await asyncio.sleep(0)
    assert gone.written == []
    assert late.is_closing()  # everything else is the transport's
