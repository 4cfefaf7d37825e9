"""A loaded configuration, what the hot path derives from it, and the one admission check.

A :class:`Runtime` is built once per (re)load and read by every request that arrives while it
is current; requests in progress keep the one they were admitted with, so a reload never changes
a request's ring or budget halfway. Admission is a pure decision over the runtime and the number
of requests in flight: shed over the concurrent request limit, then route the session id to its
slice and ring owner. Every lane asks it, the same way, before anything else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from edge.core.accesslog import AccessRecord
from edge.core.answers import SHED, EdgeAnswer, rejected
from edge.core.classify import Kind
from edge.core.config import EdgeConfig, ReplicaConfig, SliceConfig
from edge.core.errors import RoutingError
from edge.core.exchange import Exchange
from edge.core.retry import RetryPolicy

# Session ids whose route (slice and ring owner) is remembered per configuration.
ROUTE_CACHE_SIZE: Final = 65_536


@dataclass(frozen=True, slots=True)
class Route:
    """Where a session id goes under one configuration: its slice and its ring owner."""

    slice_config: SliceConfig
    owner: ReplicaConfig


@dataclass(frozen=True, slots=True)
class Runtime:
    """A loaded config plus what the hot path derives from it, built once per (re)load."""

    config: EdgeConfig
    policy: RetryPolicy
    callback_policy: RetryPolicy
    # Filled as ids are routed; a reload builds a new Runtime, so it never outlives its ring.
    routes: dict[str, Route] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, config: EdgeConfig) -> Runtime:
        options = config.options
        return cls(config, options.retry_policy(), options.callback_policy())

    def route(self, session_id: str) -> Route:
        """The id's slice and owner (raises the routing errors of ``EdgeConfig.route``)."""
        found = self.routes.get(session_id)
        if found is None:
            _, slice_config = self.config.route(session_id)
            owner = slice_config.replica(slice_config.ring.owner(session_id))
            found = Route(slice_config, owner)
            if len(self.routes) >= ROUTE_CACHE_SIZE:
                self.routes.clear()
            self.routes[session_id] = found
        return found

    def admit(self, session_id: str, in_flight: int) -> Route | EdgeAnswer:
        """The one admission check of every lane: shed when ``in_flight`` (this request
        counted) is over the concurrent request limit, then route the session id. A refusal
        is the edge's own answer (:mod:`edge.core.answers`)."""
        if in_flight > self.config.options.max_concurrent_requests:
            return SHED
        try:
            return self.route(session_id)
        except RoutingError as exc:
            return rejected(exc)

    def exchange(
        self, kind: Kind, session_id: str, route: Route, record: AccessRecord, started: float
    ) -> Exchange:
        """The context an admitted request carries through its lane, with this configuration's
        options and the retry policy its kind gets."""
        policy = self.callback_policy if kind is Kind.CALLBACK else self.policy
        return Exchange(
            kind,
            session_id,
            route.slice_config,
            route.owner,
            self.config.options,
            policy,
            record,
            started,
        )
