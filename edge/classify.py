"""What a request is, decided from its method, request-target and raw header bytes alone.

Everything here is pure and works on what came off the wire, so property tests can feed it any
bytes and the serving code and the tests agree on one definition.

Job-end callbacks (rule E1 of the contract) are recognised on the ``Authorization`` values'
*bytes*, never on decoded text:

* a request **is a callback** when it carries exactly one ``Authorization`` header whose value
  starts with ``Bearer`` (any case), one or more spaces, then ``bjn_v1.``, and the value is
  valid UTF-8;
* it **looks like a callback** when any ``Authorization`` value starts with ``bearer`` (any
  case), any run of spaces and tabs (possibly none), then ``bjn_v1.``.

Something that looks like a callback but is not one (two headers, a tab, no space, a value that
is not UTF-8) is refused 400 and never forwarded: it would otherwise reach a replica as a user
request carrying a callback token. A real callback anywhere but ``POST /_beyond/agent`` is
refused 403.

Session ids come from the query string decoded exactly as the replica decodes it (Starlette's
``QueryParams``: the raw bytes as latin-1, then ``parse_qsl(..., keep_blank_values=True)``), and
the path is percent-decoded as uvicorn decodes it, so the edge can never route by a different
value, or classify a different path, than the replica then reads.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote

AGENT_PATH = "/_beyond/agent"
EVENTS_PATH = "/_beyond/agent/events"
LIVEZ_PATH = "/livez"
READYZ_PATH = "/readyz"

_AUTHORIZATION = b"authorization"
_UPGRADE = b"upgrade"
# Anchored at the start of the value: HTTP parsers strip the optional whitespace around a field
# value, so what they hand over begins with the scheme.
_CALLBACK = re.compile(rb"[Bb][Ee][Aa][Rr][Ee][Rr] +bjn_v1\.")
_LOOKS_LIKE = re.compile(rb"[Bb][Ee][Aa][Rr][Ee][Rr][ \t]*bjn_v1\.")


class Kind(enum.StrEnum):
    """What a routed request is; also the ``kind`` label of the edge's metrics."""

    COMMAND = enum.auto()  # POST /_beyond/agent
    WEBSOCKET = enum.auto()  # GET under /_beyond/agent with Upgrade: websocket
    SSE = enum.auto()  # GET /_beyond/agent/events
    CALLBACK = enum.auto()  # a job-end callback: POST /_beyond/agent with a bjn_v1 token
    OTHER = enum.auto()  # anything else, routed or not


class AuthClass(enum.Enum):
    NONE = enum.auto()
    CALLBACK = enum.auto()
    LOOKALIKE = enum.auto()


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


def classify_authorization(headers: Iterable[tuple[bytes, bytes]]) -> AuthClass:
    """Rule E1 on raw ``(name, value)`` pairs; names compare case-insensitively."""
    values = [value for name, value in headers if name.lower() == _AUTHORIZATION]
    if not values:
        return AuthClass.NONE
    if not any(_LOOKS_LIKE.match(value) for value in values):
        return AuthClass.NONE
    if len(values) == 1 and _CALLBACK.match(values[0]) and _is_utf8(values[0]):
        return AuthClass.CALLBACK
    return AuthClass.LOOKALIKE


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def split_target(target: str) -> tuple[str, str]:
    """``(decoded path, raw query)`` of an origin-form request-target, as uvicorn splits it.

    A fragment is cut off first (a ``?`` inside it belongs to it), then the query; the path is
    percent-decoded as UTF-8 with replacement, exactly like ``urllib.parse.unquote``.
    """
    target = target.partition("#")[0]
    path, _, query = target.partition("?")
    return unquote(path), query


def query_values(query: str, key: str) -> list[str]:
    """Every value of ``key`` in ``query``, decoded as the replica's query parser decodes it."""
    if "%" in query or "+" in query:
        return [v for k, v in parse_qsl(query, keep_blank_values=True) if k == key]
    # Nothing to unquote: the same split parse_qsl makes ('&' only, first '=' splits, empty
    # parts skipped, a bare name is a blank value), without its per-pair decoding.
    values: list[str] = []
    for part in query.split("&"):
        name, _, value = part.partition("=")
        if name == key:
            values.append(value)
    return values


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
        return Refused(Kind.OTHER, 400, "the request target must be a path starting with /")
    path, query = split_target(target)
    auth = classify_authorization(headers)
    if auth is AuthClass.LOOKALIKE:
        return Refused(
            Kind.CALLBACK,
            400,
            "malformed job-end callback: send exactly one Authorization header "
            "'Bearer bjn_v1.<token>' (one or more spaces, no tabs, UTF-8)",
        )
    if auth is AuthClass.CALLBACK:
        if method != "POST" or path != AGENT_PATH:
            text = "a job-end callback token is accepted only on POST /_beyond/agent"
            return Refused(Kind.CALLBACK, 403, text)
        kind = Kind.CALLBACK
    elif _is_routed_path(path):
        kind = _kind(method, path, headers)
    elif path == LIVEZ_PATH:
        return Local(Probe.LIVEZ)
    elif path == READYZ_PATH:
        return Local(Probe.READYZ)
    else:
        return Refused(Kind.OTHER, 404, "not found: the edge serves /_beyond/agent only")
    ids = query_values(query, "session_id")
    if not ids:
        return Refused(kind, 400, "session_id is missing from the query string")
    if len(ids) > 1:
        return Refused(kind, 400, "session_id is given more than once in the query string")
    return Routed(kind, ids[0], path)
