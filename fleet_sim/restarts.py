"""When ``fleet-sim up`` starts a process again, and when it gives up: a pure policy.

A process that exits is started again after a delay that doubles with each exit (from
``first_delay_s`` up to ``max_delay_s``) and goes back to the first once the process has stayed
up for ``healthy_after_s``. An exit within ``failed_start_s`` of a start (or a start that failed
outright) is a failed start; ``max_failed_starts`` of them inside ``failed_start_window_s`` mean
the process cannot stay up, and the fleet stops with that reason rather than looping.

Nothing here reads a clock or touches a process: :func:`after_exit` takes the time and the
process's :class:`History` and returns what to do, so the policy is tested without either.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    first_delay_s: float = 0.5
    max_delay_s: float = 4.0
    healthy_after_s: float = 60.0
    failed_start_s: float = 10.0
    max_failed_starts: int = 5
    failed_start_window_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.first_delay_s <= self.max_delay_s:
            raise ValueError("need 0 < first_delay_s <= max_delay_s")
        if self.max_failed_starts < 1:
            raise ValueError("max_failed_starts must be at least 1")


@dataclass(slots=True)
class History:
    """What the policy remembers of one process between its starts."""

    started_at: float
    exits: int = 0  # since it last stayed up for healthy_after_s
    failed_starts: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Restart:
    delay_s: float
    failed_start: bool  # the exit came so soon after the start that the start counts as failed


@dataclass(frozen=True, slots=True)
class GiveUp:
    reason: str


def after_exit(policy: RestartPolicy, history: History, now: float) -> Restart | GiveUp:
    """The process of ``history`` exited (or failed to start) at ``now``: what next. Updates
    ``history`` with this exit."""
    up_for = now - history.started_at
    if up_for >= policy.healthy_after_s:
        history.exits = 0
    failed = up_for < policy.failed_start_s
    if failed:
        window_start = now - policy.failed_start_window_s
        history.failed_starts = [t for t in history.failed_starts if t > window_start]
        history.failed_starts.append(now)
        if len(history.failed_starts) >= policy.max_failed_starts:
            return GiveUp(
                f"{len(history.failed_starts)} failed starts in {policy.failed_start_window_s:g} s"
            )
    delay = min(policy.max_delay_s, policy.first_delay_s * 2**history.exits)
    history.exits += 1
    return Restart(delay, failed)
