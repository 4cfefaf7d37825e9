from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fleet_sim.cli import main
from fleet_sim.keys import (
    GRANT_KEYS_FILE,
    KEYSET_FILES,
    SEAL_PUB_FILE,
    KeySet,
    derive_tenant_dek,
    generate_keyset,
    load_keyset,
    mint_grant,
    new_tenant_dek,
)
from replica.errors import ConfigError, GrantBadClaims, GrantMalformed
from replica.grants import GrantVerifier, verify_grant
from replica.keyfiles import (
    b64url_encode,
    parse_grant_key_arg,
    read_key_file,
    read_seal_key,
    write_key_file,
)
from wire.errors import InvalidName

FLEET_SIM = Path(sys.executable).parent / "fleet-sim"
NOW = 1_800_000_000


def replica_verifier(directory: Path) -> GrantVerifier:
    """Build a verifier only from what a replica is given: --grant-key lines and --seal-key."""
    lines = (directory / GRANT_KEYS_FILE).read_text().splitlines()
    keys = dict(parse_grant_key_arg(line) for line in lines)
    return GrantVerifier(keys, read_seal_key(directory / "seal.key"))


def mint(keyset: KeySet, **changes: object) -> str:
    arguments: dict[str, object] = {
        "tenant": "acme",
        "session_id": "a07-s3.abc",
        "workspace_root": "/workspace",
        "exec_url": "http://127.0.0.1:7700",
        "dek": bytes(32),
        "exec_headers": {"Authorization": "Bearer t"},
        "now": NOW,
    }
    arguments.update(changes)
    return mint_grant(keyset, **arguments)  # type: ignore[arg-type]


@pytest.fixture
def keys_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "keys"
    generate_keyset(directory)
    return directory


def test_generate_writes_private_files_in_a_private_directory(keys_dir: Path) -> None:
    assert stat.S_IMODE(keys_dir.stat().st_mode) == 0o700
    assert sorted(p.name for p in keys_dir.iterdir()) == sorted(KEYSET_FILES)
    for name in KEYSET_FILES:
        assert stat.S_IMODE((keys_dir / name).stat().st_mode) == 0o600, name
    keyset = load_keyset(keys_dir)
    assert keyset.kid == "k1"
    line = (keys_dir / GRANT_KEYS_FILE).read_text()
    assert line == f"{keyset.grant_key_args[0]}\n"
    assert line.startswith("k1=")


def test_generate_refuses_to_overwrite_unless_forced(keys_dir: Path) -> None:
    before = {name: (keys_dir / name).read_bytes() for name in KEYSET_FILES}
    with pytest.raises(ConfigError, match="already holds a keyset"):
        generate_keyset(keys_dir)
    assert before == {name: (keys_dir / name).read_bytes() for name in KEYSET_FILES}
    generate_keyset(keys_dir, kid="k2", force=True)
    after = {name: (keys_dir / name).read_bytes() for name in KEYSET_FILES}
    assert all(before[name] != after[name] for name in KEYSET_FILES)
    assert load_keyset(keys_dir).kid == "k2"
    assert sorted(p.name for p in keys_dir.iterdir()) == sorted(KEYSET_FILES)


def test_generate_refuses_a_directory_open_to_others(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(ConfigError, match="open to group or others"):
        generate_keyset(shared)
    assert list(shared.iterdir()) == []


def test_load_refuses_mismatched_halves(keys_dir: Path) -> None:
    write_key_file(keys_dir / SEAL_PUB_FILE, bytes(range(32)), overwrite=True)
    with pytest.raises(ConfigError, match="not the public half"):
        load_keyset(keys_dir)


def test_load_refuses_a_key_list_without_the_signing_key(keys_dir: Path) -> None:
    other = (keys_dir / GRANT_KEYS_FILE).read_text().replace("k1=", "k1=A", 1)
    (keys_dir / GRANT_KEYS_FILE).write_text("k9=" + b64url_encode(bytes(32)) + "\n")
    with pytest.raises(ConfigError, match="does not list the signing key"):
        load_keyset(keys_dir)
    (keys_dir / GRANT_KEYS_FILE).write_text(other)
    with pytest.raises(ConfigError, match="line 1"):
        load_keyset(keys_dir)


def test_load_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_keyset(tmp_path / "absent")


def test_minted_grant_verifies_with_what_a_replica_is_given(keys_dir: Path) -> None:
    keyset = load_keyset(keys_dir)
    dek = new_tenant_dek()
    grant = verify_grant(replica_verifier(keys_dir), mint(keyset, dek=dek), now=NOW + 1)
    assert (grant.tenant, str(grant.session), str(grant.home_shard)) == (
        "acme",
        "a07-s3.abc",
        "a07-s3",
    )
    assert grant.dek == dek
    assert grant.exec_headers == (("Authorization", "Bearer t"),)
    assert grant.expires_at == NOW + 3600
    assert (grant.workspace_root, grant.exec_url) == ("/workspace", "http://127.0.0.1:7700")


def test_mint_refuses_what_a_replica_would_refuse(keys_dir: Path) -> None:
    keyset = load_keyset(keys_dir)
    with pytest.raises(InvalidName):
        mint(keyset, tenant="../x")
    with pytest.raises(InvalidName):
        mint(keyset, session_id="nodot")
    with pytest.raises(GrantBadClaims):
        mint(keyset, workspace_root="relative")
    with pytest.raises(GrantBadClaims):
        mint(keyset, exec_url="file:///etc/passwd")
    for ttl in (0, -1, 86401, True):
        with pytest.raises(GrantBadClaims):
            mint(keyset, ttl_s=ttl)
    headers = {f"X-H{i}": "v" * 4000 for i in range(3)}
    with pytest.raises(GrantMalformed, match="over the replicas'"):
        mint(keyset, exec_headers=headers)


def test_tenant_dek_is_deterministic_per_tenant_and_keyset(keys_dir: Path, tmp_path: Path) -> None:
    keyset = load_keyset(keys_dir)
    first = derive_tenant_dek(keyset, "acme")
    assert len(first) == 32
    assert derive_tenant_dek(load_keyset(keys_dir), "acme") == first
    assert derive_tenant_dek(keyset, "acme2") != first
    assert derive_tenant_dek(generate_keyset(tmp_path / "other"), "acme") != first
    assert new_tenant_dek() != new_tenant_dek()


def test_keyset_repr_hides_private_material(keys_dir: Path) -> None:
    keyset = load_keyset(keys_dir)
    text = repr(keyset)
    for name in ("grant-signing.key", "seal.key", "notify.key", "tenant-root.key"):
        encoded = (keys_dir / name).read_text().strip()
        assert encoded not in text
    assert b64url_encode(keyset.notify_key) not in text


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(FLEET_SIM), *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_cli_keys_then_grant_as_processes(tmp_path: Path) -> None:
    directory = tmp_path / "k"
    made = run_cli("keys", "--dir", str(directory))
    assert made.returncode == 0, made.stderr
    key_line = (directory / GRANT_KEYS_FILE).read_text().strip()
    assert f"--grant-key {key_line}" in made.stdout

    again = run_cli("keys", "--dir", str(directory))
    assert again.returncode == 2
    assert "already holds a keyset" in again.stderr and "Traceback" not in again.stderr

    minted = run_cli(
        "grant",
        "--keys",
        str(directory),
        "--tenant",
        "acme",
        "--session",
        "a07-s3.xyz",
        "--ttl",
        "120",
        "--exec-header",
        "Authorization=Bearer secret-value",
    )
    assert minted.returncode == 0, minted.stderr
    lines = minted.stdout.splitlines()
    assert len(lines) == 1
    grant = verify_grant(replica_verifier(directory), lines[0])
    assert str(grant.session) == "a07-s3.xyz"
    assert grant.dek == derive_tenant_dek(load_keyset(directory), "acme")
    assert grant.exec_headers == (("Authorization", "Bearer secret-value"),)
    assert "secret-value" not in lines[0]


def test_cli_grant_with_dek_file(keys_dir: Path, tmp_path: Path) -> None:
    dek_file = tmp_path / "dek"
    write_key_file(dek_file, bytes(range(32)))
    out = run_cli(
        "grant", "--keys", str(keys_dir), "--tenant", "t1", "--session", "a07-s3.q",
        "--dek-file", str(dek_file),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    grant = verify_grant(replica_verifier(keys_dir), out.stdout.strip())
    assert grant.dek == read_key_file(dek_file, what="test")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tenant", "../x", "--session", "a07-s3.q"], "tenant must be"),
        (["--tenant", "t", "--session", "a07-s3/q"], "session id"),
        (["--tenant", "t", "--session", "a07-s3.q", "--ttl", "0"], "ttl"),
        (["--tenant", "t", "--session", "a07-s3.q", "--ttl", "soon"], "invalid int"),
        (["--tenant", "t", "--session", "a07-s3.q", "--exec-url", "ftp://h"], "'exec'"),
        (["--tenant", "t", "--session", "a07-s3.q", "--dek-file", "/nonexistent"], "not exist"),
        (["--tenant", "t"], "required"),
    ],
)
def test_cli_grant_bad_input_exits_2_without_traceback(
    keys_dir: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["grant", "--keys", str(keys_dir), *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err
    assert "Traceback" not in captured.err


def test_cli_bad_input_as_a_process(tmp_path: Path) -> None:
    out = run_cli("grant", "--keys", str(tmp_path / "none"), "--tenant", "t", "--session", "a-b.c")
    assert out.returncode == 2
    assert out.stderr.startswith("fleet-sim grant: error: keys directory")
    assert "Traceback" not in out.stderr
    module = subprocess.run(
        [sys.executable, "-m", "fleet_sim", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert module.returncode == 0
    assert "keys" in module.stdout and "grant" in module.stdout
