"""The edge's own answers: the one place where a failure becomes a status, a text and an
outcome, whichever lane the request took.

A request the edge cannot get a replica's answer for ends in one of these:

=================================  ======  =========================================
what happened                      status  outcome
=================================  ======  =========================================
over the concurrent request limit  503     ``SHED`` (with ``Retry-After``)
not routable (id, slice, body)     4xx     ``REJECTED`` (the error's own status)
over a callback rate limit (E6)    429     ``RATE_LIMITED`` (with ``Retry-After``)
every replica answered 421         502     ``MISROUTED``
the retry budget ran out           503     ``EXHAUSTED`` (with ``Retry-After``)
no answer head in time             504     ``TIMED_OUT`` (a callback: 503, rule E4)
an answer that is not HTTP         502     ``UPSTREAM_ERROR``
a body that stalls before whole    504     ``TIMED_OUT``
a body that breaks off             502     ``UPSTREAM_ERROR``
=================================  ======  =========================================

Texts name the replica (the slice's own name for it, never its address) and never quote the
request. Once the first byte of a replica's answer has gone to the client nothing here applies:
the lane closes the connection instead, so a truncated body is never taken for a whole one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final

from aiohttp import web

from edge.core.classify import Kind
from edge.core.errors import (
    PlacementFailed,
    RoutingError,
    UpstreamBadResponse,
    UpstreamError,
    UpstreamTimeout,
)
from edge.core.exchange import Exchange
from edge.core.metrics import EdgeMetrics, LimitScope, Outcome
from edge.core.retry import GiveUpReason
from wire.http import RETRY_LATER, retry_after_headers

log = logging.getLogger("edge.core.answers")

# What can end a placement without a replica's answer to relay.
PLACING_ERRORS: Final = (PlacementFailed, UpstreamTimeout, UpstreamBadResponse)


def answer(status: int, text: str, *, retry_after: bool = False) -> web.Response:
    """A response made by the edge itself (plain text, never quoting request headers)."""
    headers = retry_after_headers() if retry_after else None
    return web.Response(status=status, text=text + "\n", headers=headers)


@dataclass(frozen=True, slots=True)
class EdgeAnswer:
    """What the edge answers itself when it could not get a replica's answer."""

    status: int
    text: str
    outcome: Outcome
    retry_after: bool = False

    def response(self) -> web.Response:
        return answer(self.status, self.text, retry_after=self.retry_after)


SHED: Final = EdgeAnswer(
    RETRY_LATER, "the edge is at its concurrent request limit; retry", Outcome.SHED, True
)


def rejected(exc: RoutingError) -> EdgeAnswer:
    return EdgeAnswer(exc.status, str(exc), Outcome.REJECTED)


def rate_limited(scope: LimitScope) -> EdgeAnswer:
    """E6: a job-end callback over its session's rate, or its source address's."""
    text = (
        "too many job-end callbacks for this session; retry"
        if scope is LimitScope.SESSION
        else "too many job-end callbacks from this address; retry"
    )
    return EdgeAnswer(429, text, Outcome.RATE_LIMITED, retry_after=True)


def placing_failed(
    exc: PlacementFailed | UpstreamError, exchange: Exchange, metrics: EdgeMetrics
) -> EdgeAnswer:
    """No replica's answer to relay: the budget ran out, the slice misroutes, or the replica
    that was asked did not answer in time or answered with something that is not HTTP."""
    replica = exchange.tally.replica
    if isinstance(exc, UpstreamTimeout):
        log.warning("%s", exc)
        if exchange.kind is Kind.CALLBACK:  # E4: a sandbox retries a callback on 503
            return EdgeAnswer(
                RETRY_LATER, "the replica did not answer the callback in time", Outcome.TIMED_OUT
            )
        return EdgeAnswer(504, f"replica {replica} did not answer in time", Outcome.TIMED_OUT)
    if isinstance(exc, UpstreamError):  # not HTTP, or broken before the head was whole
        log.warning("%s", exc)
        text = f"replica {replica} sent an unusable answer"
        return EdgeAnswer(502, text, Outcome.UPSTREAM_ERROR)
    slice_name = exchange.slice_config.name
    if exc.reason is GiveUpReason.MISROUTED:
        text = (
            f"every replica of slice {slice_name} answered 421: none mounts this "
            "session's shard, so the edge's slice configuration is wrong"
        )
        return EdgeAnswer(502, text, Outcome.MISROUTED)
    budget_s = exchange.policy.budget_s
    metrics.exhausted[exchange.kind].inc()
    log.warning(
        "retry budget of %g s exhausted on slice %s; last answer %s", budget_s, slice_name, exc.note
    )
    text = (
        f"no replica of slice {slice_name} could take this session within "
        f"{budget_s:g} s; last answer from {exc.note}"
    )
    return EdgeAnswer(RETRY_LATER, text, Outcome.EXHAUSTED, retry_after=True)


def callback_unanswered(exchange: Exchange) -> EdgeAnswer:
    """E4: a callback gets an answer within its budget, counted from its arrival."""
    budget_s = exchange.options.callback_budget_s
    log.warning(
        "job-end callback not answered within %g s (last replica tried: %s); answering 503",
        budget_s,
        exchange.tally.replica,
    )
    text = f"no replica answered the callback within {budget_s:g} s"
    return EdgeAnswer(RETRY_LATER, text, Outcome.TIMED_OUT, retry_after=True)


def body_stalled() -> EdgeAnswer:
    log.warning("a replica stalled mid-answer; answering 504")
    return EdgeAnswer(504, "the replica stalled mid-answer", Outcome.TIMED_OUT)


def body_broke_off(exc: Exception) -> EdgeAnswer:
    log.warning("%s", exc)
    return EdgeAnswer(502, "the replica's answer broke off", Outcome.UPSTREAM_ERROR)
