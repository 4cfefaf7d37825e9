"""The serving edge: a fast lane and aiohttp's low-level server, their lifecycle, reloads and
drain.

Every connection starts on the fast lane (:mod:`edge.fast.fastpath`), which serves plain commands
straight off the socket (when the owner has an idle pooled connection, as an
:mod:`edge.fast.express` exchange driven by callbacks alone) and hands anything else, with the bytes
it has read, to aiohttp's low-level server for the rest of the connection. There, requests are
dispatched by :func:`edge.core.classify.classify` rather than a router: the edge has a handful of
routes and the hot path should not pay for URL matching, middlewares or an application object
per request.
Each handler runs with ``handler_cancellation`` on, and the fast lane cancels likewise, so a
client that goes away cancels its request wherever it is: in placement (no more retries; the
replica connection is aborted), in a stream, or in a WebSocket relay.

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
import contextlib
import enum
import logging
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, cast

from aiohttp import web
from aiohttp.web_request import BaseRequest

from edge.aio.callbacks import CallbackLimits, forward_callback
from edge.aio.proxy import HttpProxy
from edge.aio.websocket import WebSocketProxy
from edge.core import accesslog
from edge.core.accesslog import AccessRecord, Lane, RequestErrors
from edge.core.answers import SHED, EdgeAnswer, answer, rejected
from edge.core.classify import Kind, Local, Probe, Refused, Routed, classify
from edge.core.config import EdgeConfig, EdgeOptions, ReplicaConfig, SliceConfig, load_config
from edge.core.errors import ConfigError, RoutingError
from edge.core.exchange import Exchange
from edge.core.metrics import EdgeMetrics, Outcome, start_metrics_server
from edge.core.retry import RetryPolicy
from edge.fast.express import Express
from edge.fast.fastpath import FastConnection, FastLane, FastRequest, relay_to_connection
from edge.upstream.pool import UpstreamPool, UpstreamResponse
from wire.redaction import redact_handlers

log = logging.getLogger("edge.server")

# How long cancelled handlers get to close their sockets once the grace is over.
CANCEL_WAIT_S: Final = 10.0


class ServerState(enum.Enum):
    STARTING = enum.auto()
    SERVING = enum.auto()
    DRAINING = enum.auto()
    STOPPED = enum.auto()


# Session ids whose route (slice and ring owner) is remembered per configuration.
ROUTE_CACHE_SIZE: Final = 65_536


@dataclass(frozen=True, slots=True)
class Route:
    """Where a session id goes under one configuration: its slice and its ring owner."""

    slice_config: SliceConfig
    owner: ReplicaConfig


@dataclass(frozen=True, slots=True)
class Runtime:
    """A loaded config plus what the hot path derives from it, built once per (re)load."""

    config: EdgeConfig
    policy: RetryPolicy
    callback_policy: RetryPolicy
    # Filled as ids are routed; a reload builds a new Runtime, so it never outlives its ring.
    routes: dict[str, Route] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, config: EdgeConfig) -> Runtime:
        options = config.options
        return cls(config, options.retry_policy(), options.callback_policy())

    def route(self, session_id: str) -> Route:
        """The id's slice and owner (raises the routing errors of ``EdgeConfig.route``)."""
        found = self.routes.get(session_id)
        if found is None:
            _, slice_config = self.config.route(session_id)
            owner = slice_config.replica(slice_config.ring.owner(session_id))
            found = Route(slice_config, owner)
            if len(self.routes) >= ROUTE_CACHE_SIZE:
                self.routes.clear()
            self.routes[session_id] = found
        return found


class Edge:
    """One edge listener. Create with :func:`start_edge`; stop with :meth:`drain`."""

    def __init__(self, config: EdgeConfig, metrics: EdgeMetrics | None = None) -> None:
        self.runtime = Runtime.of(config)
        self.metrics = metrics if metrics is not None else EdgeMetrics()
        self.state = ServerState.STARTING
        self.pool = UpstreamPool()
        self._http = HttpProxy(self.pool, self.metrics)
        self._ws = WebSocketProxy(self.metrics)
        self._limits = CallbackLimits(config.options)
        self._tasks: set[asyncio.Task[object]] = set()
        self._express: set[Express] = set()  # commands in flight without a task
        self.expressed = 0  # commands started as Express exchanges, for tests and debugging
        # Read at scrape time rather than counted per request.
        self.metrics.in_flight.set_function(lambda: self.in_flight)
        self._idle = asyncio.Event()
        self._runner: web.ServerRunner | None = None
        self._listener: asyncio.Server | None = None
        self._lane: FastLane | None = None
        self._metrics_runner: web.AppRunner | None = None
        self.host = ""
        self.port = 0
        self.metrics_port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _now(self) -> float:
        loop = self._loop
        assert loop is not None, "the edge is not started"
        return loop.time()

    @property
    def in_flight(self) -> int:
        return len(self._tasks) + len(self._express)

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
        self, host: str, port: int, *, metrics_host: str | None = None, metrics_port: int = 0
    ) -> None:
        redact_handlers()
        # aiohttp types it as a Logger; it is called only as one (see RequestErrors).
        request_errors = cast(logging.Logger, RequestErrors())
        # Kept rather than asked for per request: asking costs a getpid() system call.
        self._loop = asyncio.get_running_loop()
        options = self.runtime.config.options
        server = web.Server(
            self._handle,
            handler_cancellation=True,
            access_log=None,
            logger=request_errors,
            max_line_size=options.max_header_bytes,
            max_field_size=options.max_header_bytes,
        )
        runner = web.ServerRunner(server, shutdown_timeout=1.0)
        await runner.setup()
        self._lane = FastLane(
            self._serve_fast, server, lambda: self.runtime.config.options, self._try_express
        )
        try:
            # Every connection starts on the fast lane, which hands what it does not serve
            # itself to aiohttp's handler (``server`` is its protocol factory).
            self._listener = await asyncio.get_running_loop().create_server(
                self._lane.connection, host, port, reuse_address=True
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
        self.runtime = Runtime.of(config)
        self._limits.reconfigure(config.options)
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
            self._idle.clear()
            try:
                async with asyncio.timeout(grace):
                    await self._idle.wait()
            except TimeoutError:
                log.warning(
                    "drain grace over: cancelling %d requests still running", self.in_flight
                )
                for exchange in list(self._express):
                    exchange.cancel()
                left = list(self._tasks)
                for task in left:
                    task.cancel()
                if left:
                    await asyncio.wait(left, timeout=CANCEL_WAIT_S)
        if runner is not None:
            await runner.cleanup()
        if self._lane is not None:
            self._lane.abort_all()
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
        await self._ws.close()
        await self.pool.close()
        self.state = ServerState.STOPPED
        log.info("edge stopped")

    # --- requests ------------------------------------------------------------------------------

    async def _handle(self, request: BaseRequest) -> web.StreamResponse:
        started = self._now()
        target = request.raw_path
        if not target.isascii():
            # aiohttp hands over the raw bytes decoded as UTF-8 with surrogates; the replica
            # reads them as latin-1, and so must the classifier and the bytes sent on.
            target = target.encode("utf-8", "surrogateescape").decode("latin-1")
        headers = request.raw_headers
        decision = classify(request.method, target, headers)
        if isinstance(decision, Local):
            return self._probe(decision.probe)
        record = AccessRecord(request.method, target.partition("?")[0].partition("#")[0])
        with self._in_flight(record, started):
            response = await self._dispatch(request, decision, target, record, started)
            record.status = response.status
            return response

    @contextlib.contextmanager
    def _in_flight(self, record: AccessRecord, started: float) -> Iterator[None]:
        """Count the current task in flight for its duration (drain waits for it), then
        account the request and write its access line, however it ended."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            yield
        except (asyncio.CancelledError, ConnectionError):
            if not record.status:
                record.outcome = Outcome.CLIENT_GONE
            raise
        finally:
            self._tasks.discard(task)
            self._ended(record, started)

    def _ended(self, record: AccessRecord, started: float) -> None:
        if not self._tasks and not self._express:
            self._idle.set()
        self._account(record)
        accesslog.write(record, self._now() - started)

    async def _serve_fast(
        self, request: FastRequest, decision: Routed, body: bytes, conn: FastConnection
    ) -> None:
        """A command from the fast lane: the same gates, placement, metrics and access line as
        :meth:`_handle` gives it, answered on the connection itself."""
        started = self._now()
        record = AccessRecord("POST", request.path, Lane.FAST)
        record.kind = Kind.COMMAND
        with self._in_flight(record, started):
            record.status, record.outcome = await self._command(
                request, decision, body, conn, record, started
            )

    def _try_express(
        self, request: FastRequest, decision: Routed, body: bytes, conn: FastConnection
    ) -> bool:
        """Start a command as an :class:`Express` exchange when its owner has an idle pooled
        connection (the usual case); False leaves it to :meth:`_serve_fast`, which also gives
        every refusal (shedding, routing) its answer."""
        record = AccessRecord("POST", request.path, Lane.EXPRESS)
        record.kind = Kind.COMMAND
        admitted = self.admit(decision, record, self._now(), counted=False)
        if isinstance(admitted, EdgeAnswer):
            return False  # _serve_fast admits it again and gives the refusal its answer
        owner = admitted.owner
        up = self.pool.idle_connection(owner.url)
        if up is None:
            return False
        data = self._upstream_bytes(request, body, owner)
        up.start(data, admitted.options.upstream_header_timeout_s)
        tally = record.tally
        tally.attempts = 1
        tally.replica = owner.name
        exchange = Express(self, conn, up, admitted, data)
        self._express.add(exchange)
        self.expressed += 1
        conn.job = exchange
        exchange.follow()
        return True

    # edge.fast.express.Host

    def express_placed(self, exchange: Express) -> None:
        elapsed = self._now() - exchange.started
        self.metrics.placement[Kind.COMMAND].observe(elapsed)

    def express_ended(self, exchange: Express) -> None:
        self._express.discard(exchange)
        self._ended(exchange.record, exchange.started)

    def express_promoted(self, exchange: Express, first: UpstreamResponse | None) -> None:
        # The task is counted in flight before the exchange stops being, so a drain never sees
        # a moment with neither.
        task = exchange.conn.adopt(self._carry_on(exchange, first))
        self._tasks.add(task)
        self._express.discard(exchange)

    async def _carry_on(self, exchange: Express, first: UpstreamResponse | None) -> None:
        record = exchange.record
        with self._in_flight(record, exchange.started):
            # From the owner's answer if express had one (a refusal is the planner's first
            # input; anything else is placed already), else from the beginning.
            placed = await self._http.placed(exchange.exchange, exchange.data, first=first)
            record.status, record.outcome = await self._answer_command(
                exchange.conn, placed, exchange.exchange.options, record
            )

    def _upstream_bytes(self, request: FastRequest, body: bytes, owner: ReplicaConfig) -> bytes:
        host = None if request.has_host else self.pool.origin(owner.url).host_header
        return request.upstream(body, host)

    @staticmethod
    async def _answer_command(
        conn: FastConnection,
        placed: UpstreamResponse | EdgeAnswer,
        options: EdgeOptions,
        record: AccessRecord,
    ) -> tuple[int, Outcome]:
        """The edge's own answer, or the replica's relayed; the status and how it ended."""
        if isinstance(placed, EdgeAnswer):
            conn.answer(placed.status, placed.text, retry_after=placed.retry_after)
            return placed.status, placed.outcome
        return await relay_to_connection(conn, placed, options, record)

    async def _command(
        self,
        request: FastRequest,
        decision: Routed,
        body: bytes,
        conn: FastConnection,
        record: AccessRecord,
        started: float,
    ) -> tuple[int, Outcome]:
        admitted = self.admit(decision, record, started)
        if isinstance(admitted, EdgeAnswer):
            conn.answer(admitted.status, admitted.text, retry_after=admitted.retry_after)
            return admitted.status, admitted.outcome
        data = self._upstream_bytes(request, body, admitted.owner)
        placed = await self._http.placed(admitted, data)
        return await self._answer_command(conn, placed, admitted.options, record)

    def admit(
        self, decision: Routed, record: AccessRecord, started: float, *, counted: bool = True
    ) -> Exchange | EdgeAnswer:
        """The one admission check of every lane: shed over the concurrent request limit
        (requests in tasks and express exchanges count alike; ``counted`` when this request is
        already among them), then route the session id to its slice and ring owner."""
        runtime = self.runtime
        options = runtime.config.options
        if self.in_flight + (0 if counted else 1) > options.max_concurrent_requests:
            return SHED
        try:
            route = runtime.route(decision.session_id)
        except RoutingError as exc:
            return rejected(exc)
        kind = decision.kind
        policy = runtime.callback_policy if kind is Kind.CALLBACK else runtime.policy
        return Exchange(
            kind,
            decision.session_id,
            route.slice_config,
            route.owner,
            options,
            policy,
            record,
            started,
        )

    def _probe(self, probe: Probe) -> web.Response:
        if probe is Probe.LIVEZ:
            return web.Response(text="ok\n")
        if self.state is ServerState.SERVING:
            return web.Response(text="ready\n")
        return web.Response(status=503, text=f"not ready: {self.state.name.lower()}\n")

    def _account(self, record: AccessRecord) -> None:
        metrics = self.metrics
        kind = record.kind
        metrics.requests[(kind, record.outcome)] += 1
        tally = record.tally
        if tally.attempts > 1 or tally.misdirected or tally.unreachable:
            # Only placements that met a refusal have anything to add.
            for counter, value in (
                (metrics.retries, tally.retries),
                (metrics.walk_steps, tally.walk_steps),
                (metrics.misdirected, tally.misdirected),
                (metrics.unreachable, tally.unreachable),
            ):
                if value:
                    counter[kind].inc(value)

    async def _dispatch(
        self,
        request: BaseRequest,
        decision: Routed | Refused,
        target: str,
        record: AccessRecord,
        started: float,
    ) -> web.StreamResponse:
        if isinstance(decision, Refused):
            record.kind = decision.kind
            record.outcome = Outcome.REJECTED
            return answer(decision.status, decision.reason)
        kind = record.kind = decision.kind
        admitted = self.admit(decision, record, started)
        if isinstance(admitted, EdgeAnswer):
            record.outcome = admitted.outcome
            return admitted.response()
        headers = request.raw_headers
        try:
            if kind is Kind.CALLBACK:
                response, outcome = await forward_callback(
                    self._http, self._limits, request, target, headers, admitted, self.metrics
                )
            elif kind is Kind.WEBSOCKET:
                response, outcome = await self._ws.forward(request, target, headers, admitted)
            else:
                response, outcome = await self._http.forward(request, target, headers, admitted)
        except RoutingError as exc:  # the request body: 411, 413 or 400
            failed = rejected(exc)
            record.outcome = failed.outcome
            return failed.response()
        record.outcome = outcome
        return response


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
) -> int:
    """``fleet-edge serve`` in a running loop: until SIGTERM or SIGINT, reloading on SIGHUP."""
    loop = asyncio.get_running_loop()
    edge = Edge(config)
    try:
        if metrics_address is None:
            await edge.start(host, port)
        else:
            await edge.start(
                host, port, metrics_host=metrics_address[0], metrics_port=metrics_address[1]
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
