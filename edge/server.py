"""The serving edge's lifecycle: its listeners, reloads and drain.

Every connection starts on the fast lane (:mod:`edge.fast.fastpath`), which serves plain commands
straight off the socket and hands anything else, with the bytes it has read, to aiohttp's
low-level server for the rest of the connection; :mod:`edge.dispatch` admits each request and
gives it to its lane. Each aiohttp handler runs with ``handler_cancellation`` on, and the fast
lane cancels likewise, so a client that goes away cancels its request wherever it is: in
placement (no more retries; the replica connection is aborted) or in a stream. A WebSocket relay
has both connections' transports to itself and notices a client going away on its own.

States: ``STARTING`` -> ``SERVING`` -> ``DRAINING`` -> ``STOPPED``. Draining goes in ordered
stages, each bounded:

1. ``/readyz`` answers 503 and the listening socket closes (no new connections);
2. idle keep-alive connections close, busy ones close after their current request (on both
   lanes);
3. requests, streams and WebSockets in progress get up to ``drain_grace_s`` to finish;
4. whatever is still running is cancelled (WebSockets are closed with 1001) and awaited;
5. the replica connection pools and the metrics listener close.

A reload (SIGHUP in ``fleet-edge serve``) swaps the configuration for new requests; requests in
progress keep the ring and budget they started with. A configuration that does not load is
logged and the running one kept.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import cast

from aiohttp import web

from edge.core.accesslog import RequestErrors
from edge.core.classify import Probe
from edge.core.config import EdgeConfig, load_config
from edge.core.errors import ConfigError
from edge.core.metrics import EdgeMetrics, start_metrics_server
from edge.core.runtime import Runtime
from edge.dispatch import Dispatcher
from edge.fast.fastpath import FastLane
from edge.upstream.pool import UpstreamPool
from wire.redaction import redact_handlers

log = logging.getLogger("edge.server")


class ServerState(enum.Enum):
    STARTING = enum.auto()
    SERVING = enum.auto()
    DRAINING = enum.auto()
    STOPPED = enum.auto()


class Edge:
    """One edge listener. Create with :func:`start_edge`; stop with :meth:`drain`."""

    def __init__(self, config: EdgeConfig, metrics: EdgeMetrics | None = None) -> None:
        self.metrics = metrics if metrics is not None else EdgeMetrics()
        self.state = ServerState.STARTING
        self.pool = UpstreamPool()
        self.dispatch = Dispatcher(Runtime.of(config), self.metrics, self.pool, self._probe)
        # Read at scrape time rather than counted per request.
        self.metrics.in_flight.set_function(lambda: self.dispatch.in_flight)
        self._runner: web.ServerRunner | None = None
        self._listener: asyncio.Server | None = None
        self._lane: FastLane | None = None
        self._metrics_runner: web.AppRunner | None = None
        self.host = ""
        self.port = 0
        self.metrics_port: int | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def runtime(self) -> Runtime:
        """The configuration new requests are admitted under."""
        return self.dispatch.runtime

    @property
    def in_flight(self) -> int:
        return self.dispatch.in_flight

    @property
    def expressed(self) -> int:
        """Commands started as express exchanges (edge.fast.express), for tests and debugging."""
        return self.dispatch.expressed

    @property
    def fast_lane_handovers(self) -> int:
        """Connections the fast lane gave to aiohttp's handler (see edge.fast.fastpath)."""
        return self._lane.handed_over if self._lane is not None else 0

    @property
    def fast_lane_heads(self) -> tuple[int, int]:
        """Request heads the fast lane read, and those it found already read (edge.core.memo)."""
        if self._lane is None:
            return 0, 0
        return self._lane.commands.misses, self._lane.commands.hits

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(
        self,
        host: str,
        port: int,
        *,
        metrics_host: str | None = None,
        metrics_port: int = 0,
        reuse_port: bool = False,
    ) -> None:
        redact_handlers()
        # aiohttp types it as a Logger; it is called only as one (see RequestErrors).
        request_errors = cast(logging.Logger, RequestErrors())
        loop = asyncio.get_running_loop()
        dispatch = self.dispatch
        dispatch.start(loop)
        options = self.runtime.config.options
        server = web.Server(
            dispatch.handle,
            handler_cancellation=True,
            access_log=None,
            logger=request_errors,
            max_line_size=options.max_header_bytes,
            max_field_size=options.max_header_bytes,
        )
        runner = web.ServerRunner(server, shutdown_timeout=1.0)
        await runner.setup()
        lane = self._lane = FastLane(
            dispatch.serve_fast, server, lambda: self.runtime.config.options, dispatch.try_express
        )
        self.metrics.count_connections(lambda: lane.accepted)
        try:
            # Every connection starts on the fast lane, which hands what it does not serve
            # itself to aiohttp's handler (``server`` is its protocol factory).
            self._listener = await loop.create_server(
                self._lane.connection, host, port, reuse_address=True, reuse_port=reuse_port
            )
            if metrics_host is not None:
                self._metrics_runner = await start_metrics_server(
                    self.metrics, metrics_host, metrics_port, logger=request_errors
                )
                self.metrics_port = self._metrics_runner.addresses[0][1]
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.host = host
        self.port = self._listener.sockets[0].getsockname()[1]
        self.state = ServerState.SERVING

    def reload(self, config: EdgeConfig) -> None:
        """Serve new requests with ``config``; requests in progress keep theirs."""
        self.dispatch.reload(Runtime.of(config))
        self.pool.retain({r.url for s in config.slices for r in s.replicas})

    async def reload_from(self, path: Path | str) -> bool:
        try:
            config = await asyncio.to_thread(load_config, path)
        except ConfigError as exc:
            self.metrics.reloads["failed"].inc()
            log.error("config reload failed, still serving the previous config: %s", exc)
            return False
        self.reload(config)
        self.metrics.reloads["ok"].inc()
        slices = ", ".join(f"{s.name}({len(s.replicas)})" for s in config.slices)
        log.info("config reloaded from %s: slices %s", path, slices)
        return True

    async def drain(self, grace_s: float | None = None) -> None:
        """Stop accepting, let work in progress finish within the grace, then stop."""
        if self.state in (ServerState.DRAINING, ServerState.STOPPED):
            return
        self.state = ServerState.DRAINING
        grace = self.runtime.config.options.drain_grace_s if grace_s is None else grace_s
        runner = self._runner
        if self._listener is not None:
            self._listener.close()
        if self._lane is not None:
            self._lane.close_idle()
        if runner is not None and runner.server is not None:
            runner.server.pre_shutdown()
        if self.in_flight:
            log.info("draining: %d requests in progress, up to %g s", self.in_flight, grace)
            await self.dispatch.settle(grace)
        if runner is not None:
            await runner.cleanup()
        if self._lane is not None:
            self._lane.abort_all()
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
        await self.pool.close()
        self.state = ServerState.STOPPED
        log.info("edge stopped")

    def _probe(self, probe: Probe) -> web.Response:
        if probe is Probe.LIVEZ:
            return web.Response(text="ok\n")
        if self.state is ServerState.SERVING:
            return web.Response(text="ready\n")
        return web.Response(status=503, text=f"not ready: {self.state.name.lower()}\n")


async def start_edge(
    config: EdgeConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    metrics: EdgeMetrics | None = None,
    metrics_host: str | None = None,
    metrics_port: int = 0,
) -> Edge:
    """A started edge on ``host:port`` (port 0 picks a free one: read ``edge.port``)."""
    edge = Edge(config, metrics)
    await edge.start(host, port, metrics_host=metrics_host, metrics_port=metrics_port)
    return edge


async def serve(
    config_path: Path,
    config: EdgeConfig,
    host: str,
    port: int,
    metrics_address: tuple[str, int] | None,
    *,
    reuse_port: bool = False,
    announce: Callable[[Edge], None] | None = None,
) -> int:
    """``fleet-edge serve`` in a running loop: until SIGTERM or SIGINT, reloading on SIGHUP.
    ``reuse_port`` shares the address with other processes (the workers of
    :mod:`edge.workers`); ``announce`` replaces the line printed once listening."""
    loop = asyncio.get_running_loop()
    edge = Edge(config)
    try:
        if metrics_address is None:
            await edge.start(host, port, reuse_port=reuse_port)
        else:
            await edge.start(
                host,
                port,
                metrics_host=metrics_address[0],
                metrics_port=metrics_address[1],
                reuse_port=reuse_port,
            )
    except OSError as exc:
        log.error("cannot listen: %s", exc)
        return 1
    stop = asyncio.Event()
    reloads: set[asyncio.Task[bool]] = set()

    def on_hup() -> None:
        task = loop.create_task(edge.reload_from(config_path))
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, on_hup)
    if announce is not None:
        announce(edge)
    else:
        metrics_text = (
            f", metrics on http://{metrics_address[0]}:{edge.metrics_port}/metrics"
            if metrics_address is not None
            else ""
        )
        log.info("serving on %s%s", edge.url, metrics_text)
        # One machine-readable line on stdout, for supervisors that asked for port 0.
        print(f"fleet-edge listening on {edge.url}", flush=True)
    try:
        await stop.wait()
        log.info("stop requested: draining")
        await edge.drain()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        await asyncio.gather(*reloads, return_exceptions=True)
    return 0
