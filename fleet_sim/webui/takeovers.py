"""Who holds a session, sample by sample, and each takeover as the page server sees it.

The page server samples the fleet a few times a second (:mod:`fleet_sim.webui.fleet`); each
replica's ``/sessions`` names the sessions it holds now and at which epoch. A :class:`Watch`
follows one session through those samples. When the session turns up on another replica, or on
the same one at a higher epoch (a replica started again that took it back), that is a takeover.

How long the session was unavailable is measured from the samples, and the page says so. The
window runs from the last moment the session is known to have been served by its old owner (the
last sample that saw it there, or a fault this page sent to that owner, whichever is later) to
the moment the first sample that saw the new owner hold it had its answers. The real gap lies
inside that window, so the figure errs long, by up to about one sampling interval and the time a
sample takes. If sampling paused inside the window (no
page was asking), there is no figure: the takeover is reported without one.

Nothing here reads a clock or the network: :meth:`Watch.observe` takes one :class:`Seen`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

MAX_TAKEOVERS: Final = 10
MAX_GAP_S: Final = 2.0
"""Samples further apart than this mean nobody was looking in between."""


@dataclass(frozen=True, slots=True)
class Holding:
    """One replica's hold on the session, as its ``/sessions`` listed it."""

    replica: str
    epoch: int
    running: bool = False
    attached: int = 0


@dataclass(frozen=True, slots=True)
class Fault:
    """A fault this page sent to a replica."""

    done: str
    """What it was, in the past tense ("killed")."""
    sent: float
    """Monotonic time taken just before it was sent."""
    answered: float = math.inf
    """Monotonic time its answer came (infinity while it is on its way)."""


@dataclass(frozen=True, slots=True)
class Takeover:
    seq: int
    previous: str
    owner: str
    previous_epoch: int
    epoch: int
    at: float
    """Wall-clock time of the sample that saw the new owner, in seconds since the epoch."""
    unavailable_s: float | None
    cause: str
    """What happened to the previous owner, as far as the samples tell ("killed from this
    page", "exited", "frozen", "stopped answering", "let it go")."""


@dataclass(frozen=True, slots=True)
class Seen:
    """One sample of the fleet, as far as one session is concerned."""

    at: float
    """Monotonic time the sample was started: every listing in it was true at or after this."""
    done: float
    """Monotonic time its last answer arrived: every listing in it was true by then."""
    wall: float
    holdings: tuple[Holding, ...]
    """Every replica that listed the session (usually one; a fenced owner may linger)."""
    conditions: Mapping[str, str] = field(default_factory=dict)
    """Per replica, what would explain it dropping a session now ("exited", "frozen", ...)."""
    faults: Mapping[str, Fault] = field(default_factory=dict)
    """Per replica, the last fault this page sent it."""


class Watch:
    """One session's owner over time, and its last few takeovers (newest last)."""

    def __init__(self, session_id: str, *, max_takeovers: int = MAX_TAKEOVERS) -> None:
        self.session_id = session_id
        self.holding: Holding | None = None
        self.since: float | None = None
        """When the current holding was first seen."""
        self.served_at: float | None = None
        """When the current holding was last seen."""
        self.missing_since: float | None = None
        """When the session was first found held by nobody, while it still is."""
        self.missing_cause: str | None = None
        self.takeovers: deque[Takeover] = deque(maxlen=max_takeovers)
        self._seq = 0
        self._last_sample: float | None = None
        self._continuous_since: float | None = None

    def observe(self, seen: Seen) -> Takeover | None:
        """Take one sample in; the takeover it shows, if it shows one."""
        if self._last_sample is None or seen.at - self._last_sample > MAX_GAP_S:
            self._continuous_since = seen.at
        self._last_sample = seen.at
        current = self.holding
        newest = max(seen.holdings, key=lambda h: h.epoch, default=None)
        if newest is not None and current is not None and newest.epoch < current.epoch:
            newest = None  # a fenced owner still listing it: not an owner any more
        if newest is None:
            if current is not None and self.missing_since is None:
                self.missing_since = seen.at
                self.missing_cause = self._cause(current.replica, seen)
            return None
        if current is None:
            self._hold(newest, seen.at)
            return None
        if (newest.replica, newest.epoch) == (current.replica, current.epoch):
            self.holding = newest  # running and attached change from sample to sample
            self.served_at = seen.at
            self.missing_since = self.missing_cause = None
            return None
        cause = self.missing_cause or self._cause(current.replica, seen)
        start = self._served_until(current.replica, seen)
        continuous = self._continuous_since is not None and start >= self._continuous_since
        self._seq += 1
        takeover = Takeover(
            seq=self._seq,
            previous=current.replica,
            owner=newest.replica,
            previous_epoch=current.epoch,
            epoch=newest.epoch,
            at=seen.wall,
            unavailable_s=round(max(0.0, seen.done - start), 3) if continuous else None,
            cause=cause,
        )
        self.takeovers.append(takeover)
        self._hold(newest, seen.at)
        return takeover

    def _hold(self, holding: Holding, at: float) -> None:
        self.holding = holding
        self.since = self.served_at = at
        self.missing_since = self.missing_cause = None

    def _served_until(self, replica: str, seen: Seen) -> float:
        """The last moment the old owner is known to have served the session."""
        assert self.served_at is not None
        fault = seen.faults.get(replica)
        return max(self.served_at, fault.sent) if fault is not None else self.served_at

    def _cause(self, replica: str, seen: Seen) -> str:
        # A sample started after the fault was done that still saw the session there shows the
        # fault did not take it away; one started earlier may have been answered just before.
        fault = seen.faults.get(replica)
        if fault is not None and self.served_at is not None and fault.answered >= self.served_at:
            return f"{fault.done} from this page"
        return seen.conditions.get(replica, "let it go")
