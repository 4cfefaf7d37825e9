"""Placing one request: drive the pure retry planner against real attempts, with a real clock.

:func:`place` asks the session's hashed replica first and, while the answers are refusals (503,
421, or a connection refused or reset before any answer), follows
:class:`edge.core.retry.RetryPlan`: retry in place, then walk the ring, within the budget. The
first answer that is not a refusal is returned for the caller to deliver; nothing here ever
touches the client, so a retry can only happen before the client has seen a byte.

The attempt itself is a callable, so the same loop places plain HTTP requests and WebSocket
handshakes, and tests can drive it with scripted answers, a fake clock and an instant sleep.
The common case (the owner answers at once) builds no plan and allocates nothing beyond the
caller's :class:`Tally`.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from edge.core.config import ReplicaConfig, SliceConfig
from edge.core.errors import PlacementFailed
from edge.core.retry import (
    AttemptKind,
    AttemptResult,
    Deliver,
    GiveUp,
    Jitter,
    ReplicaAnswer,
    RetryPlan,
    RetryPolicy,
)

__all__ = ["FailedAttempt", "PlacementFailed", "Tally", "place"]

log = logging.getLogger("edge.core.placement")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class FailedAttempt:
    """An attempt that did not produce an answer to deliver; ``note`` is for logs only."""

    result: AttemptResult
    note: str
    unreachable: bool = False

    @classmethod
    def refused(cls, status: int, retry_after_s: float | None, note: str) -> FailedAttempt:
        return cls(AttemptResult.from_status(status, retry_after_s), note)

    @classmethod
    def unreached(cls, note: str) -> FailedAttempt:
        return cls(AttemptResult.unreachable(), note, unreachable=True)


class Tally:
    """What one placement did, for metrics and the access log (mutable, one per request)."""

    __slots__ = (
        "attempts",
        "last_note",
        "misdirected",
        "replica",
        "retries",
        "unreachable",
        "walk_steps",
    )

    def __init__(self) -> None:
        self.attempts = 0
        self.retries = 0
        self.walk_steps = 0
        self.misdirected = 0
        self.unreachable = 0
        self.replica = ""
        self.last_note = ""


async def place(
    slice_config: SliceConfig,
    session_id: str,
    policy: RetryPolicy,
    attempt: Callable[[ReplicaConfig], Awaitable[T | FailedAttempt]],
    tally: Tally,
    *,
    started: float,
    owner: ReplicaConfig | None = None,
    first: T | FailedAttempt | None = None,
    clock: Callable[[], float] | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    jitter: Jitter = random.random,
) -> T:
    """The first deliverable answer for ``session_id``; raises :class:`PlacementFailed`.

    ``started`` is when the request arrived, on ``clock`` (the running loop's clock by default):
    the budget counts from there, not from the first attempt. ``owner`` saves hashing the id
    again when the caller already looked it up; ``first`` is the owner's answer when the caller
    already asked it.
    """
    if owner is None:
        owner = slice_config.replica(slice_config.ring.owner(session_id))
    tally.attempts = 1
    tally.replica = owner.name
    answer = first if first is not None else await attempt(owner)
    if not isinstance(answer, FailedAttempt):
        return answer
    now = clock if clock is not None else asyncio.get_running_loop().time
    plan = RetryPlan(slice_config.ring.walk(session_id), policy)
    while True:
        _note_refusal(slice_config, tally, answer)
        plan, decision = plan.next(answer.result, max(now() - started, 0.0), jitter)
        if isinstance(decision, GiveUp):
            raise PlacementFailed(decision.reason, tally.last_note)
        if isinstance(decision, Deliver):  # pragma: no cover - refusals are never PASS_THROUGH
            raise AssertionError("the planner delivered a refusal")
        if decision.delay_s > 0:
            await sleep(decision.delay_s)
        if decision.kind is AttemptKind.RETRY:
            tally.retries += 1
        else:
            tally.walk_steps += 1
        tally.attempts += 1
        replica = slice_config.replica(decision.target)
        tally.replica = replica.name
        answer = await attempt(replica)
        if not isinstance(answer, FailedAttempt):
            return answer


def _note_refusal(slice_config: SliceConfig, tally: Tally, refusal: FailedAttempt) -> None:
    tally.last_note = f"{tally.replica}: {refusal.note}"
    outcome = refusal.result.outcome
    if outcome is ReplicaAnswer.MISDIRECTED:
        tally.misdirected += 1
        # Always a configuration error (a shard routed to a slice that does not mount it).
        log.warning(
            "misrouted: replica %s of slice %s answered 421 (it does not mount the shard); "
            "not asking it again for this request",
            tally.replica,
            slice_config.name,
        )
    elif outcome is ReplicaAnswer.UNAVAILABLE:
        if refusal.unreachable:
            tally.unreachable += 1
        log.debug("replica %s refused: %s", tally.replica, refusal.note)
