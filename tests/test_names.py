from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replica.errors import InvalidName
from replica.names import (
    MAX_SESSION_ID,
    parse_session_id,
    parse_shard,
    parse_tenant,
    session_dir,
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
