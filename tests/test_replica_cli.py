from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from replica.keyfiles import write_key_file
from replica.names import parse_session_id
from replica.segments import segment_name
from replica.store import SessionStore
from replica.transcript import Message

DEK = bytes(range(32))
SID = "a07-s3.cli1"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "replica", *args], capture_output=True, text=True, timeout=60
    )


def make_session(root: Path, dek_file: Path) -> Path:
    write_key_file(dek_file, DEK)
    store = SessionStore(root)
    for n in range(3):
        owner = store.open("acme", parse_session_id(SID), DEK)
        owner.commit([Message(f"m{n}", None, "user", "hello", 1.0)])
        owner.release()
    return store.directory("acme", parse_session_id(SID))


def test_verify_prints_the_chain(tmp_path: Path) -> None:
    directory = make_session(tmp_path, tmp_path / "dek")
    result = run("store", "verify", str(directory), "--dek-file", str(tmp_path / "dek"))
    assert result.returncode == 0, result.stderr
    assert "ok: 3 segments, epochs 1-3, 3 batches, 3 committed messages" in result.stdout
    as_json = run("store", "verify", str(directory), "--dek-file", str(tmp_path / "dek"), "--json")
    summary = json.loads(as_json.stdout)
    assert [s["epoch"] for s in summary["segments"]] == [1, 2, 3]
    assert summary["segments"][1]["seals_prev_at"] == summary["segments"][0]["valid_end"]
    assert summary["leaf_id"] == "m2"


def test_verify_fails_on_tampering_and_wrong_key(tmp_path: Path) -> None:
    directory = make_session(tmp_path, tmp_path / "dek")
    write_key_file(tmp_path / "other", bytes(32))
    wrong = run("store", "verify", str(directory), "--dek-file", str(tmp_path / "other"))
    assert wrong.returncode == 1 and wrong.stderr.startswith("CORRUPT:")
    segment = directory / segment_name(2)
    data = bytearray(segment.read_bytes())
    data[-3] ^= 0x40
    segment.write_bytes(bytes(data))
    result = run("store", "verify", str(directory), "--dek-file", str(tmp_path / "dek"))
    assert result.returncode == 1 and "segment 2" in result.stderr


def test_verify_usage_errors(tmp_path: Path) -> None:
    directory = make_session(tmp_path, tmp_path / "dek")
    missing_key = run("store", "verify", str(directory), "--dek-file", str(tmp_path / "nope"))
    assert missing_key.returncode == 2 and "Traceback" not in missing_key.stderr
    bad_dir = run("store", "verify", str(tmp_path), "--dek-file", str(tmp_path / "dek"))
    assert bad_dir.returncode == 2 and "Traceback" not in bad_dir.stderr
    no_args = run("store", "verify")
    assert no_args.returncode == 2
