"""The retry-then-walk planner: which replica to try next, after how long, or when to stop.

A 503 from the hashed replica usually means "this session is yours, but not yet" (the previous
owner is still exiting, or its lock is waiting out a storage lease), so the first response is to
ask the same replica again. If it keeps refusing, the session may already live on a substitute
that cannot say so (replicas never forward or hint), so the planner walks the ring from the
hash: the next replica clockwise, and so on, round after round, starting every round at the
owner again so a session returns to its home replica as soon as that replica can serve it.
Only the lock holder can serve a session, so a walk can find the one writer but never make a
second.

Everything here is pure: no sockets, no clock, no randomness of its own. The caller feeds the
outcome of each attempt and the time elapsed since the request began (its own monotonic clock),
and gets back a :data:`Decision` plus the next :class:`RetryPlan`; jitter comes from an injected
callable. That keeps every timing rule testable with a fake clock.

Rules, in the order they are applied to an outcome:

* ``PASS_THROUGH`` (any status but 503 and 421, including 400/401/403/404): deliver it at once.
* ``MISDIRECTED`` (421: the replica does not mount the shard): never ask that replica again in
  this request. Since 421 says nothing about the session, only about this replica's mounts, the
  planner goes on to the next replica of the walk that has not answered 421 (set
  ``walk_on_misdirected=False`` to give up at once instead). When every replica of the walk has
  answered 421 the slice is misconfigured and the answer is ``GiveUp(MISROUTED)``.
* ``UNAVAILABLE`` (503, or a connection refused or reset before any response byte): if the
  budget is spent, ``GiveUp(BUDGET_EXHAUSTED)``; otherwise retry the hashed replica until it has
  refused ``same_target_attempts`` times, then walk. Within a round a step to another replica
  waits ``walk_step_delay_s`` (its answer is independent of the last one's); wrapping back to the
  owner starts a new round and waits the retry delay, never less than ``min_round_delay_s``.
* The retry delay is the replica's Retry-After when it sent one, else ``base_delay_s`` doubled
  per refusal of the owner and again per round; either is capped at ``retry_after_cap_s``, then
  stretched by up to ``jitter_fraction`` (never shortened, so Retry-After is honoured). A delay
  that would end past the budget is cut to end exactly at it, so the last attempt starts at the
  budget and no later.
* A 503 whose Retry-After is above the cap is still retried after the cap: the replica's hint is
  a guess about its own lock, and the ring walk exists precisely because that guess can be wrong.

The budget bounds when attempts may *start*; the caller bounds each attempt itself (see
:meth:`RetryPlan.remaining_s`) and must never retry once a byte has reached the client.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from wire.http import MISDIRECTED, RETRY_LATER

DEFAULT_BUDGET_S = 120.0
# E4: a job-end callback is answered within 25 s, so its walk has to fit inside that.
CALLBACK_BUDGET_S = 25.0

Jitter = Callable[[], float]
"""Returns a uniform sample in [0, 1]; e.g. ``random.Random(seed).random``."""


def no_jitter() -> float:
    return 0.0


class ReplicaAnswer(enum.StrEnum):
    """What a replica's answer to one attempt means for the plan (not how the request ended:
    that is ``edge.core.metrics.Outcome``)."""

    UNAVAILABLE = enum.auto()
    MISDIRECTED = enum.auto()
    PASS_THROUGH = enum.auto()


class AttemptKind(enum.StrEnum):
    FIRST = enum.auto()
    RETRY = enum.auto()  # the same replica again, before the walk
    WALK = enum.auto()  # a step of the ring walk (including a new round at the owner)


class GiveUpReason(enum.StrEnum):
    BUDGET_EXHAUSTED = enum.auto()
    MISROUTED = enum.auto()


@dataclass(frozen=True, slots=True)
class AttemptResult:
    """What the last attempt got back, already classified by the caller."""

    outcome: ReplicaAnswer
    retry_after_s: float | None = None

    @classmethod
    def from_status(cls, status: int, retry_after_s: float | None = None) -> AttemptResult:
        if status == RETRY_LATER:
            return cls(ReplicaAnswer.UNAVAILABLE, retry_after_s)
        if status == MISDIRECTED:
            return cls(ReplicaAnswer.MISDIRECTED)
        return cls(ReplicaAnswer.PASS_THROUGH)

    @classmethod
    def unreachable(cls) -> AttemptResult:
        """Connection refused or reset before any response: the same as a 503 without a hint."""
        return cls(ReplicaAnswer.UNAVAILABLE)


@dataclass(frozen=True, slots=True)
class Attempt:
    target: str
    delay_s: float
    kind: AttemptKind


@dataclass(frozen=True, slots=True)
class GiveUp:
    reason: GiveUpReason


@dataclass(frozen=True, slots=True)
class Deliver:
    pass


Decision = Attempt | GiveUp | Deliver


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header in its delta-seconds form; anything else is ignored.

    The HTTP-date form is dropped on purpose: replicas never send it, and honouring a far
    future date would only park a request until the budget cap cuts it anyway.
    """
    if value is None:
        return None
    text = value.strip()
    if not text.isascii() or not text.isdigit() or len(text) > 9:
        return None
    return float(int(text))


def _check_nonneg(name: str, value: float) -> None:
    if isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    budget_s: float = DEFAULT_BUDGET_S
    same_target_attempts: int = 3
    retry_after_cap_s: float = 2.0
    base_delay_s: float = 0.25
    jitter_fraction: float = 0.1
    walk_step_delay_s: float = 0.0
    min_round_delay_s: float = 0.1
    walk_on_misdirected: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.budget_s, bool) or not math.isfinite(self.budget_s):
            raise ValueError("budget_s must be a finite number > 0")
        if self.budget_s <= 0:
            raise ValueError("budget_s must be a finite number > 0")
        if isinstance(self.same_target_attempts, bool) or self.same_target_attempts < 1:
            raise ValueError("same_target_attempts must be an integer >= 1")
        for name in ("retry_after_cap_s", "base_delay_s", "walk_step_delay_s", "min_round_delay_s"):
            _check_nonneg(name, getattr(self, name))
        _check_nonneg("jitter_fraction", self.jitter_fraction)
        if self.jitter_fraction > 1:
            raise ValueError("jitter_fraction must be within [0, 1]")

    def with_budget(self, budget_s: float) -> RetryPolicy:
        """The same pacing under another budget (callbacks use :data:`CALLBACK_BUDGET_S`)."""
        return replace(self, budget_s=budget_s)

    def retry_delay_s(self, refusals: int, retry_after_s: float | None, jitter: Jitter) -> float:
        """The pause before asking again after the ``refusals``-th refusal in a row (>= 1)."""
        if retry_after_s is not None and math.isfinite(retry_after_s) and retry_after_s >= 0:
            base = retry_after_s
        else:
            # Bounded exponent: past the cap, doubling again changes nothing.
            base = self.base_delay_s * 2.0 ** min(max(refusals - 1, 0), 32)
        base = min(base, self.retry_after_cap_s)
        u = min(max(jitter(), 0.0), 1.0)
        return base * (1.0 + self.jitter_fraction * u)


@dataclass(frozen=True, slots=True)
class RetryPlan:
    """The state of one request's retries: immutable, advanced by :meth:`next`.

    ``walk`` is fixed for the life of the request (``Ring.walk`` of the session id at its start).
    The counters are for the caller's metrics: ``retries`` counts same-replica retries before the
    walk, ``walk_steps`` the attempts made while walking, ``rounds`` the times the walk wrapped
    back to the owner, and ``misdirected`` the replicas that answered 421.
    """

    walk: tuple[str, ...]
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    index: int = 0
    walking: bool = False
    refusals_here: int = 0
    attempts: int = 1
    retries: int = 0
    walk_steps: int = 0
    rounds: int = 0
    misdirected: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not self.walk:
            raise ValueError("a retry plan needs at least one replica to try")
        if len(set(self.walk)) != len(self.walk):
            raise ValueError("a walk names each replica once")

    @property
    def target(self) -> str:
        """The replica the latest attempt went to."""
        return self.walk[self.index]

    @property
    def walked(self) -> bool:
        return self.walk_steps > 0

    def first(self) -> Attempt:
        """The first attempt: the hashed owner, at once."""
        return Attempt(self.walk[0], 0.0, AttemptKind.FIRST)

    def remaining_s(self, elapsed_s: float) -> float:
        return max(self.policy.budget_s - elapsed_s, 0.0)

    def next(
        self, result: AttemptResult, elapsed_s: float, jitter: Jitter = no_jitter
    ) -> tuple[RetryPlan, Decision]:
        """Decide what follows ``result``, observed ``elapsed_s`` after the request began."""
        _check_nonneg("elapsed_s", elapsed_s)
        if result.outcome is ReplicaAnswer.PASS_THROUGH:
            return self, Deliver()
        if result.outcome is ReplicaAnswer.MISDIRECTED:
            return self._after_misdirected(elapsed_s, jitter)
        return self._after_unavailable(result, elapsed_s, jitter)

    def _after_misdirected(self, elapsed_s: float, jitter: Jitter) -> tuple[RetryPlan, Decision]:
        plan = replace(self, misdirected=self.misdirected | {self.target})
        if not self.policy.walk_on_misdirected:
            return plan, GiveUp(GiveUpReason.MISROUTED)
        if len(plan.misdirected) == len(self.walk):
            return plan, GiveUp(GiveUpReason.MISROUTED)
        if elapsed_s >= self.policy.budget_s:
            return plan, GiveUp(GiveUpReason.BUDGET_EXHAUSTED)
        return plan._step(elapsed_s, None, jitter)

    def _after_unavailable(
        self, result: AttemptResult, elapsed_s: float, jitter: Jitter
    ) -> tuple[RetryPlan, Decision]:
        policy = self.policy
        if elapsed_s >= policy.budget_s:
            return self, GiveUp(GiveUpReason.BUDGET_EXHAUSTED)
        refusals = self.refusals_here + 1
        if not self.walking and refusals < policy.same_target_attempts:
            delay = policy.retry_delay_s(refusals, result.retry_after_s, jitter)
            plan = replace(
                self, refusals_here=refusals, attempts=self.attempts + 1, retries=self.retries + 1
            )
            return plan, Attempt(self.target, self._cut(delay, elapsed_s), AttemptKind.RETRY)
        return self._step(elapsed_s, result.retry_after_s, jitter)

    def _cut(self, delay: float, elapsed_s: float) -> float:
        return min(delay, self.policy.budget_s - elapsed_s)

    def _step(
        self, elapsed_s: float, retry_after_s: float | None, jitter: Jitter
    ) -> tuple[RetryPlan, Decision]:
        """Move on to the next replica of the walk that has not answered 421."""
        policy = self.policy
        size = len(self.walk)
        index = self.index
        rounds = self.rounds
        # At most one lap: the callers have checked that some replica is not misdirected.
        for _ in range(size):
            index += 1
            if index == size:
                index = 0
                rounds += 1
            if self.walk[index] not in self.misdirected:
                break
        if rounds > self.rounds:
            # A new round asks replicas that have all just refused: pause as for a retry, and
            # keep growing the pause (without a Retry-After) from where the owner's retries left
            # it, so a fleet that is down entirely is not hammered.
            # The floor keeps replicas that answer "Retry-After: 0" from turning the walk into a
            # busy loop for the whole budget.
            n = policy.same_target_attempts + rounds - 1
            delay = max(policy.retry_delay_s(n, retry_after_s, jitter), policy.min_round_delay_s)
        else:
            # The next replica's answer does not depend on the last one's, so by default
            # (walk_step_delay_s = 0) it is asked at once.
            delay = policy.walk_step_delay_s
        plan = replace(
            self,
            index=index,
            walking=True,
            refusals_here=0,
            attempts=self.attempts + 1,
            walk_steps=self.walk_steps + 1,
            rounds=rounds,
        )
        return plan, Attempt(self.walk[index], self._cut(delay, elapsed_s), AttemptKind.WALK)
