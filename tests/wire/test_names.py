from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replica.layout import session_dir
from wire.errors import InvalidName
from wire.names import (
    MAX_REPLICA_NAME,
    MAX_SESSION_ID,
    parse_replica_name,
    parse_session_id,
    parse_shard,
    parse_tenant,
)

ROOT = Path("/srv/shards/a07-s3")


def test_session_id_parts() -> None:
    sid = parse_session_id("a07-s3.Zk_9-x")
    assert (sid.slice, sid.shard.name, sid.opaque, str(sid)) == (
        "a07",
        "s3",
        "Zk_9-x",
        "a07-s3.Zk_9-x",
    )
    assert parse_shard("a07-hot-2").name == "hot-2"


@pytest.mark.parametrize(
    "value",
    [
        "",
        ".",
        "a07-s3.",
        ".abc",
        "a07.abc",
        "-s3.abc",
        "a07-.abc",
        "a07-s3.a.b",
        "a07-s3/..",
        "../a07-s3.x",
        "a07-s3.x/y",
        "a07-s3.x\0",
        "a07-s3.\u0430bc",
        "a07-s3.x\n",
        "a07 s3.x",
        "a07-s3.x%2f",
        "a" * 65 + "-s.x",
        "a07-s3." + "x" * 97,
        "a\u200b07-s3.x",
        None,
        7,
        b"a-b.c",
    ],
)
def test_session_id_rejections(value: object) -> None:
    with pytest.raises(InvalidName):
        parse_session_id(value)


@pytest.mark.parametrize(
    "value", ["", ".", "..", "a..b", ".hidden", "a/b", "a\\b", "a\0", "x" * 129, "caf\u00e9", "-x"]
)
def test_tenant_rejections(value: str) -> None:
    with pytest.raises(InvalidName):
        parse_tenant(value)


def test_tenant_accepts_dotted_names() -> None:
    assert parse_tenant("acme.example-1_2") == "acme.example-1_2"


def test_session_dir_layout() -> None:
    path = session_dir(ROOT, "acme", parse_session_id("a07-s3.abc"))
    assert path == ROOT / "acme" / "sessions" / "a07-s3.abc"
    with pytest.raises(InvalidName):
        session_dir(Path("relative"), "acme", parse_session_id("a07-s3.abc"))


@given(st.text(max_size=MAX_SESSION_ID + 20), st.text(max_size=140))
def test_any_input_parses_inside_the_root_or_is_refused(sid: str, tenant: str) -> None:
    try:
        path = session_dir(ROOT, parse_tenant(tenant), parse_session_id(sid))
    except InvalidName:
        return
    assert ROOT in path.parents
    assert path.resolve() == path  # no '..', no symlink games in the name itself
    assert len(path.relative_to(ROOT).parts) == 3
    assert all(part.isascii() and part not in (".", "..") for part in path.parts[1:])


@given(st.from_regex(r"[A-Za-z0-9_]{1,8}-[A-Za-z0-9_-]{1,8}\.[A-Za-z0-9_-]{1,20}", fullmatch=True))
def test_well_formed_ids_round_trip(sid: str) -> None:
    assert str(parse_session_id(sid)) == sid


# --- replica (ring) names: not paths, hashed as given -------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["r1", "10.0.4.17:9000", "[::1]:9000", "rack/7/../r1", "#", "~!\"$%&'()*+,", "r" * 255],
)
def test_replica_names_are_printable_ascii_without_whitespace(name: str) -> None:
    assert parse_replica_name(name) == name  # unchanged: the ring hashes these exact bytes


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("", "replica name is empty"),
        ("r 1", "has ' ' at position 1"),
        ("r\t1", "has '\\t' at position 1"),
        ("r\n", "has '\\n' at position 1"),
        ("\x00r", "has '\\x00' at position 0"),
        ("r\x7f", "has '\\x7f' at position 1"),
        ("r\x1b[31m", "has '\\x1b' at position 1"),
        ("r\u00e9", "has '\\xe9' at position 1"),
        ("r\u00a0", "has '\\xa0' at position 1"),  # a no-break space is whitespace too
        ("r\udce9", "has '\\udce9' at position 1"),  # a non-UTF-8 argv byte, as Python keeps it
        ("r" * (MAX_REPLICA_NAME + 1), "is 256 bytes long"),
        (7, "replica name must be a string"),
        (None, "replica name must be a string"),
    ],
)
def test_replica_name_rejections_say_why(value: object, fragment: str) -> None:
    with pytest.raises(InvalidName) as err:
        parse_replica_name(value)
    message = str(err.value)
    assert fragment in message
    if isinstance(value, str):
        assert "1-255 bytes of printable ASCII without whitespace" in message
        assert message.isascii() and message.isprintable()  # safe to print on any terminal


@given(st.text(st.characters(max_codepoint=0x80), max_size=300) | st.text(max_size=20))
def test_any_text_is_a_replica_name_exactly_when_the_rule_says(text: str) -> None:
    expected = 0 < len(text) <= 255 and all(0x21 <= ord(c) <= 0x7E for c in text)
    try:
        assert parse_replica_name(text) == text
        accepted = True
    except InvalidName:
        accepted = False
    assert accepted == expected
