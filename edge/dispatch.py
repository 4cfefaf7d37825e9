"""Where a request goes once its head is read: the admission check, then the lane that carries
it, and the count of requests in flight that admission sheds by and a drain waits on.

The lanes (see ARCHITECTURE.md):

- **express** (:mod:`edge.fast.express`): a plain command whose owner has an idle pooled
  connection, carried by callbacks with no task;
- **fast** (:mod:`edge.fast.fastpath`): any other plain command off the socket, in a task;
- **aiohttp** (:mod:`edge.aio`): everything else, once the fast lane has handed the connection
  to aiohttp's low-level server, dispatched by :class:`edge.core.classify.Kind` rather than a
  router: HTTP and event streams, WebSockets, job-end callbacks.

Every lane admits with :meth:`edge.core.runtime.Runtime.admit`, carries an
:class:`edge.core.exchange.Exchange`, turns failures into :mod:`edge.core.answers`, and ends in
:meth:`Dispatcher._ended`, which accounts the request and writes its access line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Final

from aiohttp import web
from aiohttp.web_request import BaseRequest

from edge.aio.callbacks import CallbackLimits, forward_callback
from edge.aio.proxy import HttpProxy
from edge.aio.websocket import WebSocketProxy
from edge.core import accesslog
from edge.core.accesslog import AccessRecord, Lane
from edge.core.answers import EdgeAnswer, answer, rejected
from edge.core.classify import Kind, Local, Probe, Refused, Routed, classify
from edge.core.config import EdgeOptions
from edge.core.errors import RoutingError
from edge.core.exchange import Exchange
from edge.core.metrics import EdgeMetrics, Outcome
from edge.core.runtime import Runtime
from edge.fast.express import Express
from edge.fast.fastpath import FastConnection, FastRequest, relay_to_connection
from edge.upstream.pool import UpstreamPool, UpstreamResponse

log = logging.getLogger("edge.dispatch")

# How long cancelled requests get to close their sockets once a drain's grace is over.
CANCEL_WAIT_S: Final = 10.0

# The edge answers its probes itself, from its lifecycle's state.
ProbeAnswer = Callable[[Probe], web.Response]


def _not_started() -> float:
    raise RuntimeError("the edge is not started")


class Dispatcher:
    """Admits requests and hands each to its lane; counts those in flight."""

    def __init__(
        self,
        runtime: Runtime,
        metrics: EdgeMetrics,
        pool: UpstreamPool,
        probe: ProbeAnswer,
    ) -> None:
        self.runtime = runtime  # replaced whole by a reload
        self.metrics = metrics
        self.pool = pool
        self._probe = probe
        self._now: Callable[[], float] = _not_started  # the loop's clock, once started
        self._http = HttpProxy(pool, metrics)
        self.websockets = WebSocketProxy(metrics)
        self._limits = CallbackLimits(runtime.config.options)
        self._tasks: set[asyncio.Task[object]] = set()
        self._express: set[Express] = set()  # commands in flight without a task
        self.expressed = 0  # commands started as Express exchanges, for tests and debugging
        self._idle = asyncio.Event()

    @property
    def in_flight(self) -> int:
        return len(self._tasks) + len(self._express)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        # The loop's clock kept, rather than the loop asked for per request: asking costs a
        # getpid() system call.
        self._now = loop.time

    def reload(self, runtime: Runtime) -> None:
        """New requests are admitted under ``runtime``; those in progress keep theirs."""
        self.runtime = runtime
        self._limits.reconfigure(runtime.config.options)

    async def settle(self, grace_s: float) -> None:
        """A drain's wait: up to ``grace_s`` for the requests in flight to finish, then cancel
        the rest and give them :data:`CANCEL_WAIT_S` to go."""
        if not self.in_flight:
            return
        self._idle.clear()
        try:
            async with asyncio.timeout(grace_s):
                await self._idle.wait()
        except TimeoutError:
            log.warning("drain grace over: cancelling %d requests still running", self.in_flight)
            for exchange in list(self._express):
                exchange.cancel()
            left = list(self._tasks)
            for task in left:
                task.cancel()
            if left:
                await asyncio.wait(left, timeout=CANCEL_WAIT_S)

    # --- the aiohttp lane ----------------------------------------------------------------------

    async def handle(self, request: BaseRequest) -> web.StreamResponse:
        """aiohttp's handler: a request of a connection the fast lane handed over."""
        started = self._now()
        target = request.raw_path
        if not target.isascii():
            # aiohttp hands over the raw bytes decoded as UTF-8 with surrogates; the replica
            # reads them as latin-1, and so must the classifier and the bytes sent on.
            target = target.encode("utf-8", "surrogateescape").decode("latin-1")
        decision = classify(request.method, target, request.raw_headers)
        if isinstance(decision, Local):
            return self._probe(decision.probe)
        record = AccessRecord(request.method, target.partition("?")[0].partition("#")[0])
        with self._in_flight(record, started):
            response = await self._dispatch(request, decision, target, record, started)
            record.status = response.status
            return response

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
        admitted = self._admit(decision, record, started)
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
                response, outcome = await self.websockets.forward(
                    request, target, headers, admitted
                )
            else:
                response, outcome = await self._http.forward(request, target, headers, admitted)
        except RoutingError as exc:  # the request body: 411, 413 or 400
            failed = rejected(exc)
            record.outcome = failed.outcome
            return failed.response()
        record.outcome = outcome
        return response

    # --- the fast lane -------------------------------------------------------------------------

    def try_express(
        self, request: FastRequest, decision: Routed, body: bytes, conn: FastConnection
    ) -> bool:
        """Start a command as an :class:`Express` exchange when it is admitted and its owner
        has an idle pooled connection (the usual case); False leaves it to :meth:`serve_fast`,
        which also gives every refusal its answer. Nothing is built for a command that express
        does not take."""
        runtime = self.runtime
        route = runtime.admit(decision.session_id, self.in_flight + 1)
        if isinstance(route, EdgeAnswer):
            return False  # serve_fast admits it again and gives the refusal its answer
        owner = route.owner
        up = self.pool.idle_connection(owner.url)
        if up is None:
            return False
        started = self._now()
        data = self._upstream_bytes(request, body, owner.url)
        up.start(data, runtime.config.options.upstream_header_timeout_s)
        record = AccessRecord("POST", request.path, Lane.EXPRESS)
        record.kind = Kind.COMMAND
        tally = record.tally
        tally.attempts = 1
        tally.replica = owner.name
        admitted = runtime.exchange(Kind.COMMAND, decision.session_id, route, record, started)
        exchange = Express(self, conn, up, admitted, data)
        self._express.add(exchange)
        self.expressed += 1
        conn.job = exchange
        exchange.follow()
        return True

    async def serve_fast(
        self, request: FastRequest, decision: Routed, body: bytes, conn: FastConnection
    ) -> None:
        """A command from the fast lane in a task: the same admission, placement, metrics and
        access line as the aiohttp lane gives it, answered on the connection itself."""
        started = self._now()
        record = AccessRecord("POST", request.path, Lane.FAST)
        record.kind = Kind.COMMAND
        with self._in_flight(record, started):
            admitted = self._admit(decision, record, started)
            if isinstance(admitted, EdgeAnswer):
                conn.answer(admitted)
                record.status, record.outcome = admitted.status, admitted.outcome
                return
            data = self._upstream_bytes(request, body, admitted.owner.url)
            placed = await self._http.placed(admitted, data)
            record.status, record.outcome = await self._answer_command(
                conn, placed, admitted.options, record
            )

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

    def _upstream_bytes(self, request: FastRequest, body: bytes, owner_url: str) -> bytes:
        host = None if request.has_host else self.pool.origin(owner_url).host_header
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
            conn.answer(placed)
            return placed.status, placed.outcome
        return await relay_to_connection(conn, placed, options, record)

    # --- admission and accounting --------------------------------------------------------------

    def _admit(
        self, decision: Routed, record: AccessRecord, started: float
    ) -> Exchange | EdgeAnswer:
        """Admission of a request already counted in flight (its task is)."""
        runtime = self.runtime
        route = runtime.admit(decision.session_id, self.in_flight)
        if isinstance(route, EdgeAnswer):
            return route
        return runtime.exchange(decision.kind, decision.session_id, route, record, started)

    @contextlib.contextmanager
    def _in_flight(self, record: AccessRecord, started: float) -> Iterator[None]:
        """Count the current task in flight for its duration (a drain waits for it), then
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
