"""The edge's error tree.

Every error the edge raises on purpose derives from :class:`EdgeError`, so a caller that wants
"anything the edge refused" catches one class. Start-up problems stop the process with a
message; routing problems become exactly one HTTP status each (the ``status`` class attribute),
answered by the edge itself without contacting any replica::

    EdgeError
    ├── ConfigError            a TOML file or a flag given at start-up is unusable (exit 2)
    ├── RoutingError           a request cannot be placed on any replica
    │   ├── MalformedSessionId the session id fails the strict parser             -> 400
    │   ├── UnknownSlice       the id names a slice this edge has no replicas for -> 404
    │   ├── LengthRequired     a POST says neither Content-Length nor chunked     -> 411
    │   ├── BodyTooLarge       the body is over max_request_body_bytes            -> 413
    │   └── BodyIncomplete     the body ended before its announced length         -> 400
    ├── PlacementFailed        replicas were asked and none would serve: the retry budget
    │                          ran out (503), or every replica answered 421 (502)
    └── UpstreamError          one attempt at a replica brought back no usable answer
        ├── UpstreamUnavailable  refused, reset or closed before any response byte: the
        │                        planner treats it exactly like a 503 without Retry-After
        ├── UpstreamTimeout      no response headers (or stream data) in the time allowed -> 504
        └── UpstreamBadResponse  the answer could not be parsed, or broke off midway     -> 502

Upstream error messages name the replica by its URL and are meant for the edge's log; a client
is told only the replica's ring name and what went wrong.

Programming errors (an empty walk handed to the retry planner, a negative elapsed time) are
plain ``ValueError``: they are bugs in the caller, not answers to give a client.

Messages never carry a grant, a callback token or a request body: they are safe to log.
"""

from __future__ import annotations

from typing import ClassVar

from edge.core.retry import GiveUpReason


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


class LengthRequired(RoutingError):
    """The edge buffers a body to re-send it on retries, so it must know where the body ends."""

    status: ClassVar[int] = 411


class BodyTooLarge(RoutingError):
    status: ClassVar[int] = 413


class BodyIncomplete(RoutingError):
    status: ClassVar[int] = 400


class PlacementFailed(EdgeError):
    """No replica would serve the request; ``note`` is the last refusal seen (for the log)."""

    def __init__(self, reason: GiveUpReason, note: str) -> None:
        super().__init__(reason.value)
        self.reason = reason
        self.note = note

    @property
    def status(self) -> int:
        return 502 if self.reason is GiveUpReason.MISROUTED else 503


class UpstreamError(EdgeError):
    """An attempt at a replica failed without a response the edge can pass on."""

    status: ClassVar[int] = 502


class UpstreamUnavailable(UpstreamError):
    """Connection refused, reset or closed before the replica answered anything."""

    status: ClassVar[int] = 503


class UpstreamTimeout(UpstreamError):
    """The replica did not answer (or stalled a stream) within the allowed time."""

    status: ClassVar[int] = 504


class UpstreamBadResponse(UpstreamError):
    """The replica's answer was not valid HTTP/1.1, or it broke off partway through."""

    status: ClassVar[int] = 502
