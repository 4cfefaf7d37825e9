"""The edge's error tree.

Every error the edge raises on purpose derives from :class:`EdgeError`, so a caller that wants
"anything the edge refused" catches one class. Start-up problems stop the process with a
message; routing problems become exactly one HTTP status each (the ``status`` class attribute),
answered by the edge itself without contacting any replica::

    EdgeError
    ├── ConfigError            a TOML file or a flag given at start-up is unusable (exit 2)
    └── RoutingError           a request cannot be placed on any replica
        ├── MalformedSessionId the session id fails the strict parser             -> 400
        └── UnknownSlice       the id names a slice this edge has no replicas for -> 404

Programming errors (an empty walk handed to the retry planner, a negative elapsed time) are
plain ``ValueError``: they are bugs in the caller, not answers to give a client.

Messages never carry a grant, a callback token or a request body: they are safe to log.
"""

from __future__ import annotations

from typing import ClassVar


class EdgeError(Exception):
    """Base of every deliberate edge error."""


class ConfigError(EdgeError):
    """Start-up configuration is unusable; the message names the key or flag and why."""


class RoutingError(EdgeError):
    """A request cannot be routed; ``status`` is what the edge answers the client."""

    status: ClassVar[int] = 400


class MalformedSessionId(RoutingError):
    """The session id is not ``<slice>-<shard>.<opaque>`` within the strict character rules."""

    status: ClassVar[int] = 400


class UnknownSlice(RoutingError):
    """The id is well formed but names a slice no ``[[slice]]`` entry configures."""

    status: ClassVar[int] = 404

    def __init__(self, slice_name: str) -> None:
        super().__init__(f"no replicas are configured for slice {slice_name!r}")
        self.slice_name = slice_name
