"""One request's context through the edge, whichever lane carries it.

An :class:`Exchange` is made once a request has been admitted
(:meth:`edge.core.runtime.Runtime.admit`: not shed, and routed to a slice and its ring owner)
and is what every lane passes along instead of loose parameters: the aiohttp lane's HTTP,
WebSocket and callback paths, the fast lane's commands and the express exchanges that carry a
command without a task.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from edge.core.accesslog import AccessRecord
from edge.core.classify import Kind
from edge.core.config import EdgeOptions, ReplicaConfig, SliceConfig
from edge.core.placement import FailedAttempt, Tally, place
from edge.core.retry import RetryPolicy

T = TypeVar("T")


@dataclass(slots=True)  # not frozen: made per request, and a frozen init costs more
class Exchange:
    kind: Kind
    session_id: str
    slice_config: SliceConfig
    owner: ReplicaConfig  # the ring's owner of the session: asked first
    options: EdgeOptions  # as configured when the request arrived (a reload does not change it)
    policy: RetryPolicy  # the retry budget and backoff this kind of request gets
    record: AccessRecord  # the access line being filled in
    started: float  # loop time at arrival: budgets count from here

    @property
    def tally(self) -> Tally:
        """The attempts made so far and the replica that answered last."""
        return self.record.tally

    async def place(
        self,
        attempt: Callable[[ReplicaConfig], Awaitable[T | FailedAttempt]],
        *,
        first: T | FailedAttempt | None = None,
    ) -> T:
        """Drive the retry planner (:func:`edge.core.placement.place`) with this exchange's slice,
        owner, policy and budget; raises :class:`edge.core.errors.PlacementFailed`."""
        return await place(
            self.slice_config,
            self.session_id,
            self.policy,
            attempt,
            self.tally,
            started=self.started,
            owner=self.owner,
            first=first,
        )
