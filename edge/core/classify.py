"""What a request is, decided from its method, request-target and raw header bytes alone.

Everything here is pure and works on what came off the wire, so property tests can feed it any
bytes and the serving code and the tests agree on one definition.

Job-end callbacks are recognised by the contract's rule E1 (:mod:`wire.auth`, which the replica
applies too): a look-alike is refused 400 and never forwarded, and a real callback anywhere but
``POST /_beyond/agent`` is refused 403.

The session id comes from the query string and the path is decoded exactly as the replica
decodes them (:mod:`wire.target`), so the edge can never route by a different value, or
classify a different path, than the replica then reads.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from wire.auth import NOTIFY_TOKEN_PREFIX, AuthClass, classify_authorization
from wire.http import (
    AGENT_PATH,
    EVENTS_PATH,
    LIVEZ_PATH,
    MALFORMED,
    NOT_PERMITTED,
    READYZ_PATH,
    SESSION_ID_PARAM,
)
from wire.target import query_values, split_target

_UPGRADE = b"upgrade"


class Kind(enum.StrEnum):
    """What a routed request is; also the ``kind`` label of the edge's metrics."""

    COMMAND = enum.auto()  # POST /_beyond/agent
    WEBSOCKET = enum.auto()  # GET under /_beyond/agent with Upgrade: websocket
    SSE = enum.auto()  # GET /_beyond/agent/events
    CALLBACK = enum.auto()  # a job-end callback: POST /_beyond/agent with a bjn_v1 token
    OTHER = enum.auto()  # anything else, routed or not


class Probe(enum.Enum):
    LIVEZ = enum.auto()
    READYZ = enum.auto()


@dataclass(frozen=True, slots=True)
class Routed:
    """Send to the replicas of the session's slice."""

    kind: Kind
    session_id: str
    path: str


@dataclass(frozen=True, slots=True)
class Refused:
    """Answer ``status`` at the edge; ``reason`` is the body (safe to log and to show)."""

    kind: Kind
    status: int
    reason: str


@dataclass(frozen=True, slots=True)
class Local:
    """One of the edge's own endpoints."""

    probe: Probe


Classified = Routed | Refused | Local


def _wants_websocket(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name.lower() == _UPGRADE and b"websocket" in value.lower():
            return True
    return False


def _is_routed_path(path: str) -> bool:
    return path == AGENT_PATH or path.startswith(AGENT_PATH + "/")


def _kind(method: str, path: str, headers: Iterable[tuple[bytes, bytes]]) -> Kind:
    if method == "GET":
        if _wants_websocket(headers):
            return Kind.WEBSOCKET
        if path == EVENTS_PATH:
            return Kind.SSE
    elif method == "POST" and path == AGENT_PATH:
        return Kind.COMMAND
    return Kind.OTHER


def classify(method: str, target: str, headers: Sequence[tuple[bytes, bytes]]) -> Classified:
    """Decide what the edge does with a request, before reading its body.

    ``target`` is the raw request-target (path and query as received), ``headers`` the raw
    header pairs. Callback rules come first and apply to every path, the edge's own probes
    included: a request bearing a callback token is never treated as anything else.
    """
    if not target.startswith("/"):
        # Absolute-form and asterisk-form targets are for proxies and OPTIONS; a replica never
        # needs them and decoding them differently from uvicorn would be a routing hazard.
        return Refused(Kind.OTHER, MALFORMED, "the request target must be a path starting with /")
    path, query = split_target(target)
    auth = classify_authorization(headers)
    if auth is AuthClass.LOOKALIKE:
        return Refused(
            Kind.CALLBACK,
            MALFORMED,
            "malformed job-end callback: send exactly one Authorization header "
            f"'Bearer {NOTIFY_TOKEN_PREFIX}<token>' (one or more spaces, no tabs, UTF-8)",
        )
    if auth is AuthClass.CALLBACK:
        if method != "POST" or path != AGENT_PATH:
            text = f"a job-end callback token is accepted only on POST {AGENT_PATH}"
            return Refused(Kind.CALLBACK, NOT_PERMITTED, text)
        kind = Kind.CALLBACK
    elif _is_routed_path(path):
        kind = _kind(method, path, headers)
    elif path == LIVEZ_PATH:
        return Local(Probe.LIVEZ)
    elif path == READYZ_PATH:
        return Local(Probe.READYZ)
    else:
        return Refused(Kind.OTHER, 404, f"not found: the edge serves {AGENT_PATH} only")
    ids = query_values(query, SESSION_ID_PARAM)
    if not ids:
        return Refused(kind, MALFORMED, "session_id is missing from the query string")
    if len(ids) > 1:
        return Refused(kind, MALFORMED, "session_id is given more than once in the query string")
    return Routed(kind, ids[0], path)
