"""Scripted replicas and helpers for the edge's functional tests.

A :class:`FakeReplica` is a real aiohttp server on 127.0.0.1 that answers the way a replica
does (statuses, Retry-After, bodies, WebSocket and SSE), records every request it sees (raw
headers and body), and counts handlers cancelled because the edge went away.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import WSMsgType, web

from edge.core.config import EdgeConfig, parse_config
from edge.core.ring import Ring
from edge.server import Edge, start_edge
from fleet_sim.ports import free_port

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(slots=True)
class Seen:
    method: str
    path: str
    query: str
    raw_target: str
    headers: list[tuple[bytes, bytes]]
    body: bytes
    at: float

    def header(self, name: str) -> list[bytes]:
        lower = name.lower().encode()
        return [v for n, v in self.headers if n.lower() == lower]


@dataclass(slots=True)
class WsLog:
    received: list[str | bytes] = field(default_factory=list)
    close_code: int | None = None
    protocol: str | None = None


class FakeReplica:
    def __init__(self, name: str, handler: Handler | None = None) -> None:
        self.name = name
        self.handler: Handler = handler or ok()
        self.seen: list[Seen] = []
        self.cancelled = 0
        self.ws = WsLog()
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _entry(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        query = request.raw_path.partition("?")[2]
        at = asyncio.get_running_loop().time()
        headers = list(request.raw_headers)
        self.seen.append(
            Seen(request.method, request.path, query, request.raw_path, headers, body, at)
        )
        try:
            return await self.handler(request)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def start(self) -> FakeReplica:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._entry)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def ok(body: bytes = b'{"ok": true}', status: int = 200, **headers: str) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(status=status, body=body, headers=headers or None)

    return handler


def echo() -> Handler:
    """Answer each request with its own body."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(body=await request.read())

    return handler


def refuse(status: int, body: str = "refused", retry_after: int | None = None) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
        return web.Response(status=status, text=body, headers=headers)

    return handler


def script(*handlers: Handler) -> Handler:
    """The n-th request gets ``handlers[n]``; the last one repeats."""
    count = 0

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal count
        chosen = handlers[min(count, len(handlers) - 1)]
        count += 1
        return await chosen(request)

    return handler


def hang() -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    return handler


def echo_websocket(replica: FakeReplica, protocols: Sequence[str] = ()) -> Handler:
    """Echo text and binary; ``close:<code>`` makes the replica close with that code."""

    async def handler(request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(protocols=protocols, autoping=True)
        await ws.prepare(request)
        replica.ws.protocol = ws.ws_protocol
        async for msg in ws:
            if msg.type is WSMsgType.TEXT:
                replica.ws.received.append(msg.data)
                if msg.data.startswith("close:"):
                    await ws.close(code=int(msg.data[6:]), message=b"replica says bye")
                    break
                await ws.send_str(f"echo:{msg.data}")
            elif msg.type is WSMsgType.BINARY:
                replica.ws.received.append(msg.data)
                await ws.send_bytes(msg.data[::-1])
        replica.ws.close_code = ws.close_code
        return ws

    return handler


def sample(edge: Edge, name: str, **labels: str) -> float:
    """A metric's current value on ``edge`` (0 when the sample does not exist)."""
    value = edge.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def requests(edge: Edge, kind: str, outcome: str) -> float:
    return sample(edge, "edge_requests_total", kind=kind, outcome=outcome)


def edge_config(
    replicas: Sequence[FakeReplica | tuple[str, str]], slice_name: str = "a07", **options: Any
) -> EdgeConfig:
    entries = [
        {"name": r.name, "url": r.url}
        if isinstance(r, FakeReplica)
        else {"name": r[0], "url": r[1]}
        for r in replicas
    ]
    return parse_config({"edge": options, "slice": [{"name": slice_name, "replicas": entries}]})


def session_with_walk(names: Sequence[str], walk: Sequence[str], shard: str = "a07-s1") -> str:
    """A session id of ``shard`` whose ring walk over ``names`` starts with ``walk``."""
    ring = Ring(tuple(names))
    for i in range(100_000):
        sid = f"{shard}.t{i}"
        if ring.walk(sid)[: len(walk)] == tuple(walk):
            return sid
    raise AssertionError(f"no session id walks {walk}")


# Small budgets and no jitter, so every placement test is fast and exact.
FAST: dict[str, Any] = {
    "retry_budget_s": 2.0,
    "retry_base_delay_s": 0.02,
    "retry_after_cap_s": 0.05,
    "min_round_delay_s": 0.02,
    "retry_jitter": 0.0,
    "connect_timeout_s": 1.0,
    "upstream_header_timeout_s": 5.0,
    "drain_grace_s": 1.0,
}


@asynccontextmanager
async def fleet(
    *replicas: FakeReplica,
    dead: Sequence[str] = (),
    extra: Sequence[tuple[str, str]] = (),
    **options: Any,
) -> AsyncIterator[Edge]:
    """Start the replicas and an edge over them, plus ``dead`` names on closed ports and
    ``extra`` (name, url) members served by something else."""
    async with AsyncExitStack() as stack:
        for replica in replicas:
            await replica.start()
            stack.push_async_callback(replica.close)
        members: list[FakeReplica | tuple[str, str]] = list(replicas)
        members += [(name, f"http://127.0.0.1:{free_port()}") for name in dead]
        members += list(extra)
        edge = await start_edge(edge_config(members, **{**FAST, **options}))
        stack.push_async_callback(edge.drain, 0.5)
        yield edge
