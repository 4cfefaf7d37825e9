from __future__ import annotations

import logging

import pytest

from edge.core.config import ReplicaConfig, SliceConfig
from edge.core.placement import FailedAttempt, PlacementFailed, Tally, place
from edge.core.retry import GiveUpReason, RetryPolicy
from tests.edge.fakes import session_with_walk

NAMES = ("r1", "r2", "r3")
SLICE = SliceConfig(
    "a07", tuple(ReplicaConfig(n, f"http://127.0.0.1:{9100 + i}") for i, n in enumerate(NAMES))
)
POLICY = RetryPolicy(
    budget_s=10.0,
    same_target_attempts=3,
    retry_after_cap_s=2.0,
    base_delay_s=0.25,
    jitter_fraction=0.0,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class Replicas:
    """Scripted answers per replica: a list consumed in order, the last one repeating."""

    def __init__(self, **answers: list[str | FailedAttempt]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    async def __call__(self, replica: ReplicaConfig) -> str | FailedAttempt:
        self.asked.append(replica.name)
        script = self.answers[replica.name]
        return script.pop(0) if len(script) > 1 else script[0]


def busy(retry_after: float | None = None) -> FailedAttempt:
    return FailedAttempt.refused(503, retry_after, "503 held elsewhere")


MISDIRECTED = FailedAttempt.refused(421, None, "421 not mounted")
DOWN = FailedAttempt.unreached("unreachable")


async def run(
    replicas: Replicas, sid: str, policy: RetryPolicy = POLICY
) -> tuple[str, Tally, Clock]:
    clock = Clock()
    tally = Tally()
    answer = await place(
        SLICE, sid, policy, replicas, tally, started=0.0, clock=clock, sleep=clock.sleep
    )
    return answer, tally, clock


SID = session_with_walk(NAMES, ("r1", "r2", "r3"))


@pytest.mark.anyio
async def test_the_owner_answers_at_once() -> None:
    replicas = Replicas(r1=["ok"], r2=["no"], r3=["no"])
    answer, tally, clock = await run(replicas, SID)
    assert (answer, replicas.asked, tally.attempts, clock.sleeps) == ("ok", ["r1"], 1, [])


@pytest.mark.anyio
async def test_a_busy_owner_is_retried_in_place_honouring_retry_after() -> None:
    replicas = Replicas(r1=[busy(1), busy(1), "ok"], r2=["no"], r3=["no"])
    answer, tally, clock = await run(replicas, SID)
    assert answer == "ok"
    assert replicas.asked == ["r1", "r1", "r1"]
    assert clock.sleeps == [1.0, 1.0]
    assert (tally.retries, tally.walk_steps, tally.replica) == (2, 0, "r1")


@pytest.mark.anyio
async def test_a_session_live_on_a_substitute_is_found_by_the_walk() -> None:
    replicas = Replicas(r1=[busy()], r2=[busy()], r3=["here"])
    answer, tally, _ = await run(replicas, SID)
    assert answer == "here"
    assert replicas.asked == ["r1", "r1", "r1", "r2", "r3"]
    assert (tally.retries, tally.walk_steps, tally.replica) == (2, 2, "r3")


@pytest.mark.anyio
async def test_unreachable_replicas_are_walked_past_and_counted() -> None:
    replicas = Replicas(r1=[DOWN], r2=["up"], r3=["no"])
    answer, tally, _ = await run(replicas, SID)
    assert answer == "up"
    assert tally.unreachable == 3 and tally.replica == "r2"


@pytest.mark.anyio
async def test_misdirected_replica_is_never_asked_again(caplog: pytest.LogCaptureFixture) -> None:
    replicas = Replicas(r1=[MISDIRECTED], r2=[busy(), busy(), busy(), "ok"], r3=[busy()])
    with caplog.at_level(logging.WARNING, "edge.core.placement"):
        answer, tally, _ = await run(replicas, SID)
    assert answer == "ok"
    assert replicas.asked.count("r1") == 1
    assert tally.misdirected == 1
    assert "r1" in caplog.text and "421" in caplog.text and SID not in caplog.text


@pytest.mark.anyio
async def test_every_replica_misdirected_is_misrouted() -> None:
    replicas = Replicas(r1=[MISDIRECTED], r2=[MISDIRECTED], r3=[MISDIRECTED])
    with pytest.raises(PlacementFailed) as failed:
        await run(replicas, SID)
    assert failed.value.reason is GiveUpReason.MISROUTED
    assert sorted(replicas.asked) == ["r1", "r2", "r3"]


@pytest.mark.anyio
async def test_the_budget_bounds_the_attempts() -> None:
    replicas = Replicas(r1=[busy(1)], r2=[busy(1)], r3=[busy(1)])
    clock = Clock()
    with pytest.raises(PlacementFailed) as failed:
        await place(
            SLICE, SID, POLICY, replicas, Tally(), started=0.0, clock=clock, sleep=clock.sleep
        )
    assert failed.value.reason is GiveUpReason.BUDGET_EXHAUSTED
    assert "503 held elsewhere" in failed.value.note
    assert clock.now <= POLICY.budget_s
    assert 3 < len(replicas.asked) < 60


@pytest.mark.anyio
async def test_the_budget_counts_from_the_request_arrival() -> None:
    replicas = Replicas(r1=[busy()], r2=[busy()], r3=[busy()])
    clock = Clock()
    clock.now = 100.0
    with pytest.raises(PlacementFailed):
        await place(
            SLICE, SID, POLICY, replicas, Tally(), started=90.0, clock=clock, sleep=clock.sleep
        )
    assert replicas.asked == ["r1"]


@pytest.mark.anyio
async def test_an_answer_the_caller_already_had_is_the_first_attempt() -> None:
    clock = Clock()
    tally = Tally()
    replicas = Replicas(r1=["ok"], r2=["no"], r3=["no"])
    answer = await place(
        SLICE, SID, POLICY, replicas, tally, started=0.0, first=busy(), clock=clock,
        sleep=clock.sleep,
    )  # fmt: skip
    # The owner's 503 came with the call: it is asked again only for the retry.
    assert (answer, replicas.asked, tally.attempts, tally.retries) == ("ok", ["r1"], 2, 1)
    delivered = await place(SLICE, SID, POLICY, Replicas(r1=["no"]), Tally(), started=0.0,
                            first="had", clock=clock, sleep=clock.sleep)  # fmt: skip
    assert delivered == "had"
