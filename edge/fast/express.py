"""A command's usual life without a task: the owner's answer relayed from callbacks.

Most commands go to the session's owner over a pooled keep-alive connection, and the owner
answers at once with a short, complete body. For that case the fast lane does not need a task,
a chain of coroutines and futures: the request is written on an idle pooled connection at
once, then :class:`Express` follows the exchange through the connection's ``listener``
callback, and when the answer is whole it writes it to the client in one go, returns the
connection to the pool and accounts the request, all from the event loop's own callbacks.

Anything else is handed to the ordinary path with what is known so far (``promote``), in a task
that carries on exactly where express stopped:

- the owner refused (503 or 421): the retry planner takes over with that refusal as the first
  answer;
- the pooled connection turned out closed before any byte came back: placement starts from the
  beginning (nothing was answered, as when the pool retries such a connection itself);
- the answer is long, unframed, or breaks off: it is relayed, streamed or reported by the
  ordinary relay.

What express answers itself is what the ordinary path would: a timeout before the headers is
504, bytes that are not HTTP are 502, a body that stalls within ``upstream_header_timeout_s`` is
504. A client that goes away (or a drain that runs out of grace) cancels the exchange: the
replica connection is aborted, as cancelling a task would.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from edge.aio.proxy import COALESCE_LIMIT, REFUSALS
from edge.core.accesslog import AccessRecord
from edge.core.answers import EdgeAnswer, body_stalled, placing_failed
from edge.core.errors import UpstreamUnavailable
from edge.core.exchange import Exchange
from edge.core.headers import declared_length
from edge.core.metrics import EdgeMetrics, Outcome
from edge.fast.fastpath import FastConnection, response_head
from edge.upstream.pool import UpstreamConnection, UpstreamResponse


class Host(Protocol):
    """What an express exchange needs from the edge serving it."""

    metrics: EdgeMetrics

    def express_placed(self, exchange: Express) -> None:
        """The owner answered and the answer is being delivered (placement latency)."""

    def express_ended(self, exchange: Express) -> None:
        """The exchange is over and answered, or the client has gone: account it."""

    def express_promoted(self, exchange: Express, first: UpstreamResponse | None) -> None:
        """Carry on in a task from ``first`` (None: from the beginning)."""


class Express:
    """One command's exchange with its owner, followed by callbacks (see the module doc)."""

    __slots__ = ("conn", "data", "exchange", "host", "over", "timer", "up")

    def __init__(
        self,
        host: Host,
        conn: FastConnection,
        up: UpstreamConnection,
        exchange: Exchange,
        data: bytes,  # the request as sent, for the ordinary path if it has to carry on
    ) -> None:
        self.host = host
        self.conn = conn
        self.up = up
        self.exchange = exchange
        self.data = data
        self.over = False
        self.timer: asyncio.TimerHandle | None = None

    @property
    def record(self) -> AccessRecord:
        return self.exchange.record

    @property
    def started(self) -> float:
        return self.exchange.started

    def follow(self) -> None:
        """Follow the exchange, whose request the caller has just started on ``up`` (the
        request goes before this object is even made: nothing is answered before the loop
        runs again, and the replica can start on it meanwhile)."""
        self.up.listener = self._progress

    def cancel(self) -> None:
        """The client went away, or a drain ran out of grace: drop the exchange."""
        if self.over:
            return
        self._detach()
        self.up.abort()
        if not self.record.status:
            self.record.outcome = Outcome.CLIENT_GONE
        self.over = True
        self.host.express_ended(self)
        self.conn.abort()

    # --- following the exchange ----------------------------------------------------------------

    def _progress(self) -> None:
        if self.over:
            return
        response = self.up.response
        if response is None:
            error = self.up.failure
            if error is None:
                return  # the head is not in yet
            self._detach()
            self.up.abort()
            if isinstance(error, UpstreamUnavailable):
                self._promote(None)  # the pooled connection was dead: nothing was answered
            else:
                self._answer(placing_failed(error, self.exchange, self.host.metrics))
            return
        if response.status in REFUSALS:
            self._detach()
            self._promote(response)
            return
        body = response.body_if_complete()
        if body is not None:
            self._deliver(response, body)
            return
        length = declared_length(response.headers)
        if response.failed or length is None or length > COALESCE_LIMIT:
            self._detach()
            self._promote(response)  # streamed, or reported broken, by the ordinary relay
            return
        if self.timer is None:  # a short body still on its way: wait for it, not forever
            wait_s = self.exchange.options.upstream_header_timeout_s
            self.timer = asyncio.get_running_loop().call_later(wait_s, self._stalled)

    def _stalled(self) -> None:
        self.timer = None
        if self.over:
            return
        self._detach()
        self.up.abort()
        self._answer(body_stalled())

    def _detach(self) -> None:
        self.up.listener = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    # --- ending it ---------------------------------------------------------------------------

    def _deliver(self, response: UpstreamResponse, body: bytes) -> None:
        # The answer first, the bookkeeping after: the client is waiting for it.
        conn = self.conn
        status = response.status
        raw = response.raw
        if raw is not None and not conn.must_close:
            conn.write(raw)  # nothing in it for the edge to drop or reframe
        else:
            head = response_head(status, response.headers, length=len(body), close=conn.must_close)
            conn.write(head + body)
        self._detach()
        self.host.express_placed(self)
        response.release()
        self._end(status, Outcome.DELIVERED)

    def _answer(self, answer: EdgeAnswer) -> None:
        self.conn.answer(answer)
        self._end(answer.status, answer.outcome)

    def _end(self, status: int, outcome: Outcome) -> None:
        self.over = True
        self.record.status = status
        self.record.outcome = outcome
        self.host.express_ended(self)
        self.conn.job_done()

    def _promote(self, first: UpstreamResponse | None) -> None:
        self.over = True
        self.host.express_promoted(self, first)
