from __future__ import annotations

import json
import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from fleet_sim.keys import generate_keyset
from replica.keyfiles import write_key_file
from replica.segments import segment_name
from replica.store import SessionStore
from replica.transcript import Message
from wire.names import parse_session_id

DEK = bytes(range(32))
SID = "a07-s3.cli1"
# The installed entry point, as a person types it.
FLEET_REPLICA = shutil.which("fleet-replica", path=str(Path(sys.executable).parent))


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


# --- the installed entry point -----------------------------------------------------------------


def fleet_replica(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert FLEET_REPLICA is not None, f"fleet-replica is not installed next to {sys.executable}"
    return subprocess.run(
        [FLEET_REPLICA, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def serve_args(keys: Path, shard: Path, name: str) -> list[str]:
    keyset = generate_keyset(keys)
    args = ["serve", "--service", "--listen", "127.0.0.1:0", "--name", name]
    for value in keyset.grant_key_args:
        args += ["--grant-key", value]
    # Key files relative to the working directory, as typed there; shard paths must be absolute.
    args += ["--seal-key", "keys/seal.key", "--notify-key", "keys/notify.key"]
    return [*args, "--notify-origin", "http://127.0.0.1:9", "--shard", f"a07-s1={shard}"]


def test_help_and_a_bad_flag(tmp_path: Path) -> None:
    helped = fleet_replica(tmp_path, "--help")
    assert helped.returncode == 0 and "serve" in helped.stdout and "store" in helped.stdout
    serve_help = fleet_replica(tmp_path, "serve", "--help")
    assert serve_help.returncode == 0
    flat = " ".join(serve_help.stdout.split())
    assert "--name NAME" in flat and "printable ASCII without whitespace, 1-255 bytes" in flat
    bad = fleet_replica(tmp_path, "serve", "--listen", "127.0.0.1:0", "--bogus")
    assert bad.returncode == 2 and bad.stdout == "" and "Traceback" not in bad.stderr
    errors = [line for line in bad.stderr.splitlines() if "error:" in line]
    assert errors == ["fleet-replica: error: unrecognized arguments: --bogus"], bad.stderr
    assert list(tmp_path.iterdir()) == []


def test_coalescing_flags_are_explained_and_checked(tmp_path: Path) -> None:
    flat = " ".join(fleet_replica(tmp_path, "serve", "--help").stdout.split())
    assert "--coalesce-ms MS send a session's streamed text at most once every MS" in flat
    assert "0 sends every delta as its own frame (default 25)" in flat
    assert "--coalesce-max-chars N send the gathered text at once" in flat
    shard = tmp_path / "shard"
    shard.mkdir()
    args = serve_args(tmp_path / "keys", shard, "r1")
    for value in ("nan", "-1"):
        proc = fleet_replica(tmp_path, *args, "--coalesce-ms", value)
        assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
        (line,) = proc.stderr.splitlines()
        assert line.startswith("fleet-replica: --coalesce-ms must be a number of milliseconds")
    proc = fleet_replica(tmp_path, *args, "--coalesce-ms", "fast")
    assert proc.returncode == 2 and "argument --coalesce-ms: invalid float value" in proc.stderr


@pytest.mark.parametrize(
    ("name", "why"),
    [("r 1", "' ' at position 1"), ("r\t1", "'\\t' at position 1"), ("", "is empty")],
)
def test_serve_refuses_a_name_outside_the_ring_rule(tmp_path: Path, name: str, why: str) -> None:
    shard = tmp_path / "shard"
    shard.mkdir()
    proc = fleet_replica(tmp_path, *serve_args(tmp_path / "keys", shard, name))
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith("fleet-replica: --name: replica name ") and why in line
    assert "1-255 bytes of printable ASCII without whitespace" in line


@pytest.mark.parametrize("name", ["10.0.4.17:9000", "rack/7/10.0.4.17:9000"])
def test_serve_named_by_address_is_ready(tmp_path: Path, name: str) -> None:
    # The readiness probe writes a file per replica on each shard; a name with '/' used to name
    # a directory that is not there, and the shard read as missing.
    shard = tmp_path / "shard"
    shard.mkdir()
    assert FLEET_REPLICA is not None
    log = tmp_path / "replica.log"
    with (
        log.open("w") as err,
        subprocess.Popen(
            [FLEET_REPLICA, *serve_args(tmp_path / "keys", shard, name)],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        ) as proc,
    ):
        try:
            assert proc.stdout is not None
            readable, _, _ = select.select([proc.stdout], [], [], 30)
            assert readable, "the replica printed nothing in 30 s"
            line = proc.stdout.readline()
            assert line, log.read_text()
            url = json.loads(line)["url"]
            ready = httpx.get(f"{url}/readyz", timeout=10)
            assert ready.status_code == 200, ready.text
            assert httpx.get(f"{url}/livez", timeout=10).status_code == 200
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert (shard / ".beyond-probe").is_dir()
    assert list((shard / ".beyond-probe").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys", "replica.log", "shard"]
    assert "Traceback" not in log.read_text()
