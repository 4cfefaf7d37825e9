"""Fuzz the edge's request classifier (rule E1 on raw header bytes, routing, refusals).

Input: an HTTP/1.1 request head (``fuzz.formats.request_head``). ``classify`` documents no error
at all: it must return a decision for anything. Beyond not raising, every input is checked
against restatements written here without the classifier's regexes:

* E1 on the raw ``Authorization`` values, scanned byte by byte;
* a look-alike is refused 400, a callback off ``POST /_beyond/agent`` 403;
* a routed request's session id is the one value Starlette's ``QueryParams`` reads from the
  query uvicorn (httptools) splits off the same target, and its path is uvicorn's path.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fuzz.common import instrument

    instrument("edge.core.classify", "wire.auth", "wire.target")

from urllib.parse import unquote

import httptools
from starlette.datastructures import QueryParams

from edge.core.classify import Kind, Local, Refused, Routed, classify
from fuzz.common import Harness, main
from fuzz.formats import request_head
from fuzz.known import Mismatch
from wire.auth import AuthClass, classify_authorization
from wire.http import AGENT_PATH

_BEARER = b"bearer"
_TOKEN = b"bjn_v1."


def _scheme_then(value: bytes, gap: bytes, at_least_one: bool) -> bool:
    """``bearer`` in any ASCII case, a run of bytes from ``gap``, then ``bjn_v1.``."""
    if value[: len(_BEARER)].lower() != _BEARER:
        return False
    rest = value[len(_BEARER) :]
    run = len(rest) - len(rest.lstrip(gap))
    if at_least_one and run == 0:
        return False
    return rest[run:].startswith(_TOKEN)


def e1(headers: list[tuple[bytes, bytes]]) -> AuthClass:
    values = [value for name, value in headers if name.lower() == b"authorization"]
    if not any(_scheme_then(value, b" \t", False) for value in values):
        return AuthClass.NONE
    if len(values) == 1 and _scheme_then(values[0], b" ", True):
        try:
            values[0].decode("utf-8", "strict")
        except UnicodeDecodeError:
            return AuthClass.LOOKALIKE
        return AuthClass.CALLBACK
    return AuthClass.LOOKALIKE


def uvicorn_split(target: str) -> tuple[str, bytes] | None:
    """``(path, raw query)`` as uvicorn's httptools protocol sets them, or None where it would
    refuse the request before any application sees it."""
    try:
        url = httptools.parse_url(target.encode("latin-1"))
        path: str = url.path.decode("ascii")
    except (httptools.HttpParserInvalidURLError, UnicodeDecodeError):
        return None
    return (unquote(path) if "%" in path else path), (url.query or b"")


def check(data: bytes) -> None:
    method, target, headers = request_head(data)
    auth = classify_authorization(headers)
    expected = e1(headers)
    if auth is not expected:
        raise Mismatch("e1", f"classifier says {auth}, the rule says {expected}: {headers!r}")
    decision = classify(method, target, headers)
    if isinstance(decision, Local):
        if auth is not AuthClass.NONE:
            raise Mismatch("probe", f"a request with {auth} was answered as a probe")
        return
    if isinstance(decision, Refused):
        if decision.status not in (400, 403, 404) or not decision.reason.isascii():
            raise Mismatch("refusal", f"bad refusal {decision!r}")
        lookalike = auth is AuthClass.LOOKALIKE and target.startswith("/")
        if lookalike and (decision.status, decision.kind) != (400, Kind.CALLBACK):
            raise Mismatch("lookalike", f"a look-alike got {decision!r}")
        return
    if not isinstance(decision, Routed):
        raise Mismatch("type", f"classify returned {decision!r}")
    if auth is AuthClass.LOOKALIKE:
        raise Mismatch("lookalike", "a look-alike was routed")
    if (auth is AuthClass.CALLBACK) != (decision.kind is Kind.CALLBACK):
        raise Mismatch("callback-kind", f"{auth} routed as {decision.kind}")
    if decision.kind is Kind.CALLBACK and (method != "POST" or decision.path != AGENT_PATH):
        raise Mismatch("callback-route", f"a callback routed for {method} {decision.path}")
    split = uvicorn_split(target)
    if split is None:
        return
    path, query = split
    if decision.path != path:
        raise Mismatch("path", f"edge path {decision.path!r}, replica path {path!r}")
    if QueryParams(query).getlist("session_id") != [decision.session_id]:
        raise Mismatch("session-id", f"edge routes by {decision.session_id!r}, query {query!r}")


HARNESS = Harness(
    target="classify",
    test=check,
    tokens=(
        b"Authorization: ",
        b"authorization:",
        b"Bearer ",
        b"bearer\t",
        b"BEARER",
        b"bjn_v1.",
        b"Upgrade: websocket",
        b"/_beyond/agent",
        b"/_beyond/agent/events",
        b"session_id=",
        b"session%5Fid=",
        b"%2F",
        b"\xff",
        b"\xc3\xa9",
        b"POST ",
        b"GET ",
        b" HTTP/1.1\r\n",
    ),
    max_len=2048,
)

if __name__ == "__main__":
    main(HARNESS)
