from __future__ import annotations

import os
from pathlib import Path

from replica.listing import PREVIEW_CHARS, candidates, describe, list_sessions
from replica.segments import segment_name
from replica.store import SessionStore
from replica.transcript import Message
from wire.names import parse_session_id

DEK = bytes(range(32))
OTHER_DEK = bytes(range(1, 33))


def make_session(
    root: Path,
    sid: str,
    updated: float,
    *,
    title: str,
    reply: str,
    cwd: str = "/work/repo",
    tenant: str = "acme",
    dek: bytes = DEK,
) -> None:
    store = SessionStore(root)
    owned = store.open(tenant, parse_session_id(sid), dek)
    owned.commit(
        [
            Message(f"{sid}u", None, "user", title, 1.0, {"title": title, "cwd": cwd}),
            Message(f"{sid}a", None, "assistant", reply, 2.0),
        ]
    )
    owned.release()
    for segment in owned.directory.glob("*.seg"):
        os.utime(segment, (updated, updated))


def ids(rows: list[dict[str, object]]) -> list[object]:
    return [r["session_id"] for r in rows]


def test_newest_first_with_metadata(tmp_path: Path) -> None:
    make_session(tmp_path, "a07-s1.old", 1_000, title="fix the parser", reply="done")
    make_session(tmp_path, "a07-s1.new", 3_000, title="write docs", reply="x" * 500)
    make_session(tmp_path, "a07-s1.mid", 2_000, title="bump deps", reply="", cwd="/srv/app")
    rows = list_sessions([tmp_path], "acme", DEK, "", 50)
    assert ids(rows) == ["a07-s1.new", "a07-s1.mid", "a07-s1.old"]
    assert rows[0] == {
        "session_id": "a07-s1.new",
        "title": "write docs",
        "preview": "x" * PREVIEW_CHARS,
        "cwd": "/work/repo",
        "updated": 3_000,
        "messages": 2,
    }
    # The preview is the newest message with text.
    assert rows[1]["preview"] == "bump deps" and rows[1]["cwd"] == "/srv/app"


def test_query_matches_title_id_preview_and_cwd(tmp_path: Path) -> None:
    make_session(tmp_path, "a07-s1.aaa", 1, title="Fix the Parser", reply="tests pass")
    make_session(tmp_path, "a07-s1.bbb", 2, title="docs", reply="wrote README", cwd="/srv/site")
    make_session(tmp_path, "a07-s1.ccc", 3, title="deps", reply="bumped")

    def found(query: str) -> list[object]:
        return ids(list_sessions([tmp_path], "acme", DEK, query, 50))

    assert found("parser") == ["a07-s1.aaa"]  # title, any case
    assert found("PARSER") == ["a07-s1.aaa"]
    assert found("s1.ccc") == ["a07-s1.ccc"]  # id
    assert found("readme") == ["a07-s1.bbb"]  # preview
    assert found("/srv/") == ["a07-s1.bbb"]  # cwd
    assert found("a07-s1") == ["a07-s1.ccc", "a07-s1.bbb", "a07-s1.aaa"]
    assert found("nothing like it") == []


def test_limit_stops_the_listing(tmp_path: Path) -> None:
    for n in range(6):
        make_session(tmp_path, f"a07-s1.n{n}", 100 + n, title=f"task {n}", reply="ok")
    assert ids(list_sessions([tmp_path], "acme", DEK, "", 2)) == ["a07-s1.n5", "a07-s1.n4"]
    assert ids(list_sessions([tmp_path], "acme", DEK, "task", 1)) == ["a07-s1.n5"]
    assert len(list_sessions([tmp_path], "acme", DEK, "", 500)) == 6


def test_sessions_sealed_with_another_key_are_skipped(tmp_path: Path) -> None:
    make_session(tmp_path, "a07-s1.mine", 1, title="mine", reply="ok")
    make_session(tmp_path, "a07-s1.rekeyed", 2, title="other", reply="ok", dek=OTHER_DEK)
    assert ids(list_sessions([tmp_path], "acme", DEK, "", 50)) == ["a07-s1.mine"]
    assert ids(list_sessions([tmp_path], "acme", OTHER_DEK, "", 50)) == ["a07-s1.rekeyed"]
    # A skipped session does not use up the limit.
    assert ids(list_sessions([tmp_path], "acme", DEK, "", 1)) == ["a07-s1.mine"]


def test_only_this_tenant_across_shards(tmp_path: Path) -> None:
    one, two = tmp_path / "s1", tmp_path / "s2"
    one.mkdir()
    two.mkdir()
    make_session(one, "a07-s1.x", 1, title="first shard", reply="ok")
    make_session(two, "a07-s2.y", 2, title="second shard", reply="ok")
    make_session(one, "a07-s1.z", 3, title="not yours", reply="ok", tenant="globex")
    rows = list_sessions([one, two, tmp_path / "absent"], "acme", DEK, "", 50)
    assert ids(rows) == ["a07-s2.y", "a07-s1.x"]
    assert ids(list_sessions([one], "globex", DEK, "", 50)) == ["a07-s1.z"]
    assert list_sessions([one, two], "initech", DEK, "", 50) == []


def test_strays_in_the_tenant_directory_are_ignored(tmp_path: Path) -> None:
    make_session(tmp_path, "a07-s1.real", 1, title="real", reply="ok")
    sessions = tmp_path / "acme" / "sessions"
    (sessions / "not-a-session-id").mkdir()
    (sessions / "not-a-session-id" / segment_name(1)).write_bytes(b"junk")
    (sessions / "a07-s1.empty").mkdir()  # no segment yet
    (sessions / "a07-s1.file").write_text("not a directory")
    (sessions / "a07-s1.junk").mkdir()
    (sessions / "a07-s1.junk" / segment_name(1)).write_bytes(b"junk" * 40)
    found = candidates([tmp_path], "acme")
    assert sorted(c.session_id for c in found) == ["a07-s1.junk", "a07-s1.real"]
    assert describe(next(c for c in found if c.session_id == "a07-s1.junk"), "acme", DEK) is None
    assert ids(list_sessions([tmp_path], "acme", DEK, "", 50)) == ["a07-s1.real"]
