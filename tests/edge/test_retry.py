from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from edge.core.retry import (
    CALLBACK_BUDGET_S,
    Attempt,
    AttemptKind,
    AttemptResult,
    Decision,
    Deliver,
    GiveUp,
    GiveUpReason,
    Jitter,
    ReplicaAnswer,
    RetryPlan,
    RetryPolicy,
    no_jitter,
    parse_retry_after,
)

WALK = ("r1", "r2", "r3")
BUSY = AttemptResult(ReplicaAnswer.UNAVAILABLE, 1.0)  # a replica's usual 503 + Retry-After: 1
REFUSED = AttemptResult.unreachable()
WRONG_SHARD = AttemptResult(ReplicaAnswer.MISDIRECTED)
OK = AttemptResult(ReplicaAnswer.PASS_THROUGH)
# Dyadic latency, so the fake clock's sums are exact and "exactly at the budget" is checkable.
LATENCY = 0.0625

Answer = Callable[[str, float], AttemptResult]


@dataclass
class Run:
    """A request driven through the planner on a fake clock."""

    starts: list[tuple[float, str, AttemptKind]] = field(default_factory=list)
    delays: list[float] = field(default_factory=list)
    end: float = 0.0
    final: Decision = field(default_factory=Deliver)
    plan: RetryPlan | None = None

    @property
    def targets(self) -> list[str]:
        return [target for _, target, _ in self.starts]


def drive(plan: RetryPlan, answer: Answer, jitter: Jitter = no_jitter) -> Run:
    run = Run(plan=plan)
    now = 0.0
    decision: Decision = plan.first()
    for _ in range(10_000):
        if not isinstance(decision, Attempt):
            run.final, run.end, run.plan = decision, now, plan
            return run
        run.delays.append(decision.delay_s)
        now += decision.delay_s
        run.starts.append((now, decision.target, decision.kind))
        now += LATENCY
        plan, decision = plan.next(answer(decision.target, now), now, jitter)
    raise AssertionError("the planner never finished")


def always(result: AttemptResult) -> Answer:
    return lambda target, now: result


def test_first_attempt_goes_to_the_owner_at_once() -> None:
    assert RetryPlan(WALK).first() == Attempt("r1", 0.0, AttemptKind.FIRST)


def test_busy_then_free_is_retried_in_place() -> None:
    answers = iter([BUSY, OK])
    run = drive(RetryPlan(WALK), lambda target, now: next(answers))
    assert run.final == Deliver()
    assert run.targets == ["r1", "r1"]
    assert run.delays == [0.0, 1.0]
    assert run.plan is not None
    assert (run.plan.retries, run.plan.walk_steps, run.plan.walked) == (1, 0, False)


@pytest.mark.parametrize(
    ("retry_after", "expected"), [(0.0, 0.0), (1.0, 1.0), (1.5, 1.5), (2.0, 2.0), (30.0, 2.0)]
)
def test_retry_after_is_honoured_and_capped(retry_after: float, expected: float) -> None:
    plan, decision = RetryPlan(WALK).next(
        AttemptResult(ReplicaAnswer.UNAVAILABLE, retry_after), 0.1
    )
    assert decision == Attempt("r1", expected, AttemptKind.RETRY)
    assert plan.retries == 1


def test_without_retry_after_the_pause_doubles_up_to_the_cap() -> None:
    policy = RetryPolicy(same_target_attempts=3, base_delay_s=0.25, retry_after_cap_s=2.0)
    run = drive(RetryPlan(WALK, policy), always(REFUSED))
    # r1, r1 (0.25), r1 (0.5), then the walk: r2 and r3 at once, then each new round pauses
    # longer (1.0, then capped at 2.0).
    assert run.targets[:9] == ["r1", "r1", "r1", "r2", "r3", "r1", "r2", "r3", "r1"]
    assert run.delays[:9] == [0.0, 0.25, 0.5, 0.0, 0.0, 1.0, 0.0, 0.0, 2.0]
    assert max(run.delays) == 2.0


def test_walks_in_ring_order_after_repeated_refusals() -> None:
    walk = ("r2", "r5", "r1", "r4")
    run = drive(RetryPlan(walk), lambda target, now: OK if target == "r4" else BUSY)
    assert run.targets == ["r2", "r2", "r2", "r5", "r1", "r4"]
    kinds = [kind for _, _, kind in run.starts]
    assert kinds == [AttemptKind.FIRST] + [AttemptKind.RETRY] * 2 + [AttemptKind.WALK] * 3
    assert run.final == Deliver()
    assert run.plan is not None
    assert (run.plan.retries, run.plan.walk_steps, run.plan.rounds) == (2, 3, 0)
    assert run.plan.walked and run.plan.attempts == 6


def test_same_target_attempts_is_configurable() -> None:
    run = drive(
        RetryPlan(WALK, RetryPolicy(same_target_attempts=1)),
        lambda target, now: OK if target == "r2" else BUSY,
    )
    assert run.targets == ["r1", "r2"]


def test_rounds_start_again_from_the_owner() -> None:
    # The session frees on the owner in the third round: the walk keeps returning to it.
    def answer(target: str, now: float) -> AttemptResult:
        return OK if target == "r1" and now > 5.0 else BUSY

    run = drive(RetryPlan(WALK), answer)
    assert run.final == Deliver()
    assert run.targets[3:] == ["r2", "r3", "r1", "r2", "r3", "r1", "r2", "r3", "r1"]
    assert run.plan is not None
    assert run.plan.rounds == 3
    # Within a round the next replica is asked at once; a new round waits the Retry-After.
    assert run.delays[3:] == [0.0, 0.0, 1.0] * 3


def test_a_new_round_never_starts_at_once() -> None:
    # Retry-After: 0 is honoured on the owner, but cannot turn the walk into a busy loop.
    policy = RetryPolicy(budget_s=3.0, min_round_delay_s=0.5)
    run = drive(RetryPlan(WALK, policy), always(AttemptResult(ReplicaAnswer.UNAVAILABLE, 0.0)))
    assert run.delays[:6] == [0.0, 0.0, 0.0, 0.0, 0.0, 0.5]
    owner_rounds = [i for i, (_, target, _) in enumerate(run.starts) if i > 0 and target == "r1"]
    # Each round's pause is the floor, except the last one, which the budget may cut.
    assert all(run.delays[i] == 0.5 for i in owner_rounds[2:-1]) and len(owner_rounds) > 4
    assert len(run.starts) < 30


def test_budget_is_spent_exactly_at_its_end() -> None:
    policy = RetryPolicy(budget_s=10.0)
    run = drive(RetryPlan(WALK, policy), always(BUSY))
    assert run.final == GiveUp(GiveUpReason.BUDGET_EXHAUSTED)
    starts = [start for start, _, _ in run.starts]
    assert max(starts) == 10.0  # the last pause was cut to end on the budget, not past it
    assert starts[-1] == 10.0
    assert all(start <= 10.0 for start in starts)
    assert run.end == 10.0 + LATENCY


def test_a_pause_that_would_overrun_is_cut_to_the_budget() -> None:
    plan = RetryPlan(WALK, RetryPolicy(budget_s=10.0))
    _, decision = plan.next(BUSY, 9.75)
    assert decision == Attempt("r1", 0.25, AttemptKind.RETRY)
    _, decision = plan.next(BUSY, 10.0)
    assert decision == GiveUp(GiveUpReason.BUDGET_EXHAUSTED)


def test_callback_budget_is_25_seconds() -> None:
    policy = RetryPolicy().with_budget(CALLBACK_BUDGET_S)
    assert CALLBACK_BUDGET_S == 25.0 and RetryPolicy().budget_s == 120.0
    run = drive(RetryPlan(WALK, policy), always(BUSY))
    assert run.final == GiveUp(GiveUpReason.BUDGET_EXHAUSTED)
    assert run.starts[-1][0] == 25.0
    # The walk keeps going until the end: every replica is asked in later rounds too.
    assert set(run.targets[-6:]) == set(WALK)


def test_single_replica_is_retried_until_the_budget() -> None:
    run = drive(RetryPlan(("solo",), RetryPolicy(budget_s=5.0)), always(BUSY))
    assert set(run.targets) == {"solo"}
    assert run.final == GiveUp(GiveUpReason.BUDGET_EXHAUSTED)
    assert run.starts[-1][0] == 5.0
    assert all(delay <= 1.0 for delay in run.delays)


def test_misdirected_is_never_retried_on_that_replica() -> None:
    def answer(target: str, now: float) -> AttemptResult:
        return WRONG_SHARD if target == "r1" else BUSY

    run = drive(RetryPlan(WALK, RetryPolicy(budget_s=8.0)), answer)
    assert run.targets.count("r1") == 1
    assert run.targets[:2] == ["r1", "r2"]
    assert run.delays[1] == 0.0
    assert run.final == GiveUp(GiveUpReason.BUDGET_EXHAUSTED)
    assert run.plan is not None and run.plan.misdirected == frozenset({"r1"})


def test_misdirected_mid_walk_drops_the_replica_from_later_rounds() -> None:
    def answer(target: str, now: float) -> AttemptResult:
        return WRONG_SHARD if target == "r2" else BUSY

    run = drive(RetryPlan(WALK, RetryPolicy(budget_s=6.0)), answer)
    assert run.targets.count("r2") == 1
    assert run.targets[:6] == ["r1", "r1", "r1", "r2", "r3", "r1"]


def test_every_replica_misdirected_is_misrouted() -> None:
    run = drive(RetryPlan(WALK), always(WRONG_SHARD))
    assert run.targets == ["r1", "r2", "r3"]
    assert run.final == GiveUp(GiveUpReason.MISROUTED)


def test_misdirected_can_give_up_at_once() -> None:
    plan = RetryPlan(WALK, RetryPolicy(walk_on_misdirected=False))
    plan, decision = plan.next(WRONG_SHARD, 0.01)
    assert decision == GiveUp(GiveUpReason.MISROUTED)
    assert plan.misdirected == frozenset({"r1"})


@pytest.mark.parametrize("status", [101, 200, 202, 400, 401, 403, 404, 409, 410, 429, 500, 502])
def test_other_statuses_are_delivered_at_once(status: int) -> None:
    result = AttemptResult.from_status(status)
    assert result.outcome is ReplicaAnswer.PASS_THROUGH
    run = drive(RetryPlan(WALK), always(result))
    assert run.final == Deliver() and run.targets == ["r1"]
    # Even after a walk, and even past the budget: the answer is already in hand.
    plan = RetryPlan(WALK, RetryPolicy(budget_s=1.0), index=2, walking=True)
    assert plan.next(result, 50.0) == (plan, Deliver())


def test_status_classification() -> None:
    assert AttemptResult.from_status(503, 1.0) == BUSY
    assert AttemptResult.from_status(421) == WRONG_SHARD
    assert AttemptResult.unreachable() == AttemptResult(ReplicaAnswer.UNAVAILABLE, None)


def test_jitter_only_stretches_and_is_bounded() -> None:
    policy = RetryPolicy(jitter_fraction=0.2)
    rng = random.Random(3)
    delays = [policy.retry_delay_s(1, 1.0, rng.random) for _ in range(2000)]
    assert all(1.0 <= d <= 1.2 for d in delays)
    assert max(delays) - min(delays) > 0.15  # it does spread retries out
    assert policy.retry_delay_s(1, 30.0, lambda: 1.0) == pytest.approx(2.0 * 1.2)
    # A misbehaving source cannot push a pause outside the bound.
    assert policy.retry_delay_s(1, 1.0, lambda: 7.0) == pytest.approx(1.2)
    assert policy.retry_delay_s(1, 1.0, lambda: -3.0) == 1.0


def test_jittered_run_is_reproducible_from_its_seed() -> None:
    def run(seed: int) -> list[float]:
        policy = RetryPolicy(budget_s=20.0, jitter_fraction=0.5)
        return drive(RetryPlan(WALK, policy), always(BUSY), random.Random(seed).random).delays

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_plan_values_are_immutable() -> None:
    plan = RetryPlan(WALK)
    after, _ = plan.next(BUSY, 0.1)
    assert plan.retries == 0 and after.retries == 1
    assert plan.target == after.target == "r1"


@pytest.mark.parametrize(
    ("header", "seconds"),
    [("1", 1.0), (" 2 ", 2.0), ("0", 0.0), (None, None), ("", None), ("-1", None),
     ("1.5", None), ("Wed, 21 Oct 2015 07:28:00 GMT", None), ("99999999999", None),
     ("\u0661", None)],
)  # fmt: skip
def test_parse_retry_after(header: str | None, seconds: float | None) -> None:
    assert parse_retry_after(header) == seconds


def test_invalid_use_is_refused() -> None:
    with pytest.raises(ValueError):
        RetryPlan(())
    with pytest.raises(ValueError):
        RetryPlan(("r1", "r1"))
    with pytest.raises(ValueError):
        RetryPlan(WALK).next(BUSY, -1.0)
    for bad in (
        {"budget_s": 0.0},
        {"budget_s": float("inf")},
        {"same_target_attempts": 0},
        {"retry_after_cap_s": -1.0},
        {"jitter_fraction": 1.5},
        {"base_delay_s": float("nan")},
        {"min_round_delay_s": -0.1},
    ):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)
