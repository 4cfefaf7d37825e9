"""Job-end callbacks from sandboxes (rules E2-E7; E1's classification is ``edge.core.classify``).

A callback is routed like any request for its session id (E3), but:

* it is forwarded unchanged (E2): every header as received (hop-by-hop fields aside), its
  ``Content-Length`` or ``Transfer-Encoding`` included, the body bytes as sent; the edge
  attaches, mints and checks nothing, and never looks at the token;
* the whole exchange, placement included, is bounded by ``callback_budget_s`` (E4, at most
  25 s): past it the edge answers 503 and aborts the replica connection, so the replica stops
  waiting too;
* the replica's status goes back unchanged (E5), with its body;
* at most ``callback_rate_per_session`` callbacks a second are forwarded for one session id
  (E6, an exact sliding-window count) and at most ``callback_rate_per_source`` a second from one
  source address (a token bucket); the excess is answered 429 by the edge;
* the ``Authorization`` header is never logged or recorded (E7): nothing here logs headers, and
  the log handlers' filter (``wire.redaction``) redacts any that other code might quote.
"""

from __future__ import annotations

import asyncio
from typing import Final

from aiohttp import web
from aiohttp.web_request import BaseRequest

from edge.aio.proxy import HttpProxy, read_body, upstream_request
from edge.core.answers import (
    PLACING_ERRORS,
    callback_unanswered,
    placing_failed,
    rate_limited,
)
from edge.core.classify import Kind
from edge.core.config import EdgeOptions
from edge.core.exchange import Exchange
from edge.core.headers import RawHeaders, response_headers
from edge.core.metrics import EdgeMetrics, LimitScope, Outcome
from edge.core.ratelimit import TokenBucketLimiter, WindowLimiter, WindowRule

# A callback answer is a status and a short reason; anything longer is not one.
CALLBACK_ANSWER_LIMIT: Final = 64 * 1024


class CallbackLimits:
    """E6 per session id, plus the per-source-address limit. Clock values come from the caller."""

    def __init__(self, options: EdgeOptions) -> None:
        self._sessions = WindowLimiter(WindowRule.per_second(options.callback_rate_per_session))
        rate = options.callback_rate_per_source
        self._sources = TokenBucketLimiter(rate, max(rate, 1.0))

    def reconfigure(self, options: EdgeOptions) -> None:
        self._sessions.reconfigure(WindowRule.per_second(options.callback_rate_per_session))
        rate = options.callback_rate_per_source
        self._sources.reconfigure(rate, max(rate, 1.0))

    def check(self, session_id: str, source: str, now: float) -> LimitScope | None:
        """``None`` to forward, or the limit that refuses this callback."""
        # The source is charged first: a host over its limit does not use up a session's share.
        if not self._sources.allow(source, now):
            return LimitScope.SOURCE
        if not self._sessions.allow(session_id, now):
            return LimitScope.SESSION
        return None


async def forward_callback(
    proxy: HttpProxy,
    limits: CallbackLimits,
    request: BaseRequest,
    target: str,
    headers: RawHeaders,
    exchange: Exchange,
    metrics: EdgeMetrics,
) -> tuple[web.StreamResponse, Outcome]:
    loop = asyncio.get_running_loop()
    refused_by = limits.check(exchange.session_id, request.remote or "-", loop.time())
    if refused_by is not None:
        metrics.rate_limited[refused_by].inc()
        refused = rate_limited(refused_by)
        return refused.response(), refused.outcome
    options = exchange.options
    host = proxy.pool.origin(exchange.owner.url).host_header
    # E4 counts from the callback's arrival: a slow upload spends the same 25 s.
    deadline = exchange.started + options.callback_budget_s
    try:
        async with asyncio.timeout_at(deadline):
            body = await read_body(request, headers, options.max_request_body_bytes)
            data = upstream_request(request, target, headers, body, host, callback=True)
            response = await proxy.place(exchange, data)
            try:
                reply = await response.read_all(CALLBACK_ANSWER_LIMIT)
            finally:
                response.release()
    except TimeoutError:
        failed = callback_unanswered(exchange)
        return failed.response(), failed.outcome
    except PLACING_ERRORS as exc:
        failed = placing_failed(exc, exchange, metrics)
        return failed.response(), failed.outcome
    metrics.placement[Kind.CALLBACK].observe(loop.time() - exchange.started)
    out = web.Response(
        status=response.status,
        body=reply,
        headers=response_headers(response.headers, keep_length=False),
    )
    return out, Outcome.DELIVERED
