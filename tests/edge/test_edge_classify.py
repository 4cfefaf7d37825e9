from __future__ import annotations

import re
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.datastructures import QueryParams

from edge.core.classify import Kind, Local, Probe, Refused, Routed, classify
from wire.auth import AuthClass, classify_authorization
from wire.target import query_values, split_target

SID = "a07-s1.abc"
TARGET = f"/_beyond/agent?session_id={SID}&tenant=t1"


def auth(*values: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"Host", b"edge"), *((b"Authorization", v) for v in values)]


@pytest.mark.parametrize(
    "value",
    [
        b"Bearer bjn_v1.tok",
        b"bearer bjn_v1.tok",
        b"BEARER   bjn_v1.tok",
        b"BeArEr bjn_v1.",
        b"Bearer bjn_v1.tok\xc3\xa9",
    ],
)
def test_one_well_formed_header_is_a_callback(value: bytes) -> None:
    assert classify_authorization(auth(value)) is AuthClass.CALLBACK


@pytest.mark.parametrize(
    "values",
    [
        (b"Bearer\tbjn_v1.tok",),  # a tab
        (b"Bearerbjn_v1.tok",),  # no space
        (b"Bearer \tbjn_v1.tok",),  # space then tab
        (b"Bearer bjn_v1.tok\xff",),  # not UTF-8
        (b"Bearer bjn_v1.a", b"Bearer bjn_v1.a"),  # two headers
        (b"Bearer bjn_v1.a", b"Bearer user-token"),  # two, one of them a callback
        (b"Bearer user-token", b"bearer\t\tbjn_v1.x"),
    ],
)
def test_look_alikes_are_not_callbacks(values: tuple[bytes, ...]) -> None:
    assert classify_authorization(auth(*values)) is AuthClass.LOOKALIKE


@pytest.mark.parametrize(
    "values",
    [
        (),
        (b"Bearer eyJhbGciOi.user",),
        (b"Basic dXNlcjpwYXNz",),
        (b"Bearer  BJN_V1.upper",),
        (b"Token bjn_v1.x",),
        (b"Bearer x bjn_v1.y",),
        (b"Bearer user", b"Basic x"),
    ],
)
def test_other_authorization_is_not_a_callback(values: tuple[bytes, ...]) -> None:
    assert classify_authorization(auth(*values)) is AuthClass.NONE


def test_header_names_compare_case_insensitively() -> None:
    headers = [(b"AUTHORIZATION", b"Bearer bjn_v1.x"), (b"authorization", b"Bearer bjn_v1.x")]
    assert classify_authorization(headers) is AuthClass.LOOKALIKE
    assert classify_authorization(headers[:1]) is AuthClass.CALLBACK


# --- E1 as a property: the classifier equals the rule, written independently ------------------

_TOKEN_CHARS = st.sampled_from([b" ", b"\t", b"b", b"B", b"e", b"E", b"a", b"r", b"R", b"x"])
_PIECES = st.sampled_from(
    [
        b"Bearer",
        b"bearer",
        b"BEARER",
        b" ",
        b"  ",
        b"\t",
        b"bjn_v1.",
        b"bjn_v1",
        b"tok",
        b"\xff",
        b"\xc3\xa9",
    ]
)
_VALUES = st.lists(st.one_of(_PIECES, _TOKEN_CHARS), max_size=6).map(b"".join)
_NAMES = st.sampled_from([b"Authorization", b"authorization", b"AUTHORIZATION", b"X-Other"])


def _spec(headers: list[tuple[bytes, bytes]]) -> AuthClass:
    values = [v for n, v in headers if n.lower() == b"authorization"]
    looks = [v for v in values if re.match(rb"(?i:bearer)[ \t]*bjn_v1\.", v)]
    if not looks:
        return AuthClass.NONE
    if len(values) == 1 and re.match(rb"(?i:bearer) +bjn_v1\.", values[0]):
        try:
            values[0].decode("utf-8")
        except UnicodeDecodeError:
            return AuthClass.LOOKALIKE
        return AuthClass.CALLBACK
    return AuthClass.LOOKALIKE


@given(st.lists(st.tuples(_NAMES, _VALUES), max_size=4))
def test_classifier_matches_the_rule(headers: list[tuple[bytes, bytes]]) -> None:
    assert classify_authorization(headers) is _spec(headers)


@given(st.lists(st.tuples(st.binary(max_size=12), st.binary(max_size=40)), max_size=5))
def test_classifier_takes_any_bytes(headers: list[tuple[bytes, bytes]]) -> None:
    assert classify_authorization(headers) is _spec(headers)


# --- targets and query strings -------------------------------------------------------------------


@given(st.text(max_size=40))
def test_query_decoding_matches_starlette(query: str) -> None:
    raw = query.encode("utf-8", "surrogatepass")
    assert query_values(raw.decode("latin-1"), "session_id") == QueryParams(raw).getlist(
        "session_id"
    )


@pytest.mark.parametrize(
    ("query", "values"),
    [
        ("session_id=a07-s1.x", ["a07-s1.x"]),
        ("session%5Fid=a07-s1.x", ["a07-s1.x"]),
        ("session_id=a07-s1.x&session_id=a07-s1.y", ["a07-s1.x", "a07-s1.y"]),
        ("session_id=a07-s1.x;session_id=a07-s1.y", ["a07-s1.x;session_id=a07-s1.y"]),
        ("session_id=a%30", ["a0"]),
        ("session_id", [""]),
        ("session_id=", [""]),
        ("session_id=a+b", ["a b"]),
        ("Session_id=x", []),
    ],
)
def test_query_values(query: str, values: list[str]) -> None:
    assert query_values(query, "session_id") == values


def test_split_target_cuts_fragment_then_query_and_decodes_the_path() -> None:
    assert split_target("/_beyond/%61gent?session_id=x") == ("/_beyond/agent", "session_id=x")
    assert split_target("/_beyond/agent#f?session_id=x") == ("/_beyond/agent", "")
    assert split_target("/_beyond/agent?session_id=x#f") == ("/_beyond/agent", "session_id=x")


# --- whole requests ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "target", "headers", "kind"),
    [
        ("POST", TARGET, [], Kind.COMMAND),
        ("GET", TARGET, [(b"Upgrade", b"websocket")], Kind.WEBSOCKET),
        ("GET", TARGET, [(b"upgrade", b"WebSocket")], Kind.WEBSOCKET),
        ("GET", f"/_beyond/agent/events?session_id={SID}", [], Kind.SSE),
        ("GET", f"/_beyond/agent/events?session_id={SID}&since=m1", [], Kind.SSE),
        ("GET", TARGET, [], Kind.OTHER),
        ("DELETE", TARGET, [], Kind.OTHER),
        ("POST", f"/_beyond/agent/other?session_id={SID}", [], Kind.OTHER),
        ("POST", TARGET, auth(b"Bearer bjn_v1.t")[1:], Kind.CALLBACK),
        (
            "POST",
            "/_beyond/%61gent?session_id=" + quote(SID),
            auth(b"Bearer bjn_v1.t"),
            Kind.CALLBACK,
        ),
    ],
)
def test_routed_kinds(
    method: str, target: str, headers: list[tuple[bytes, bytes]], kind: Kind
) -> None:
    decision = classify(method, target, headers)
    assert isinstance(decision, Routed)
    assert (decision.kind, decision.session_id) == (kind, SID)


@pytest.mark.parametrize(
    ("method", "target", "headers", "status"),
    [
        ("POST", "/_beyond/agent", [], 400),
        ("POST", "/_beyond/agent?tenant=t", [], 400),
        ("POST", f"/_beyond/agent?session_id={SID}&session_id={SID}", [], 400),
        ("POST", f"/_beyond/agent?session_id={SID}&session%5Fid={SID}", [], 400),
        ("POST", TARGET, auth(b"Bearer\tbjn_v1.t"), 400),
        ("GET", "/livez", auth(b"Bearer\tbjn_v1.t"), 400),
        ("GET", TARGET, auth(b"Bearer bjn_v1.t"), 403),
        ("POST", f"/_beyond/agent/x?session_id={SID}", auth(b"Bearer bjn_v1.t"), 403),
        ("POST", "/elsewhere", auth(b"Bearer bjn_v1.t"), 403),
        ("GET", "/livez", auth(b"Bearer bjn_v1.t"), 403),
        (
            "POST",
            f"/_beyond/agent?session_id={SID}&session_id=a07-s1.other",
            auth(b"Bearer bjn_v1.t"),
            400,
        ),
        ("GET", "/", [], 404),
        ("GET", "/_beyond/agentx?session_id=" + SID, [], 404),
        ("GET", "http://edge/_beyond/agent?session_id=" + SID, [], 400),
        ("OPTIONS", "*", [], 400),
    ],
)
def test_refusals(
    method: str, target: str, headers: list[tuple[bytes, bytes]], status: int
) -> None:
    decision = classify(method, target, headers)
    assert isinstance(decision, Refused)
    assert decision.status == status
    assert "bjn_v1.t" not in decision.reason


def test_probes() -> None:
    assert classify("GET", "/livez", []) == Local(Probe.LIVEZ)
    assert classify("GET", "/readyz?x=1", []) == Local(Probe.READYZ)
