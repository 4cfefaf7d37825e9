from __future__ import annotations

import base64
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from replica.errors import ConfigError
from replica.keyfiles import (
    b64url_decode,
    b64url_encode,
    parse_grant_key_arg,
    read_key_file,
    read_seal_key,
    write_key_file,
)

KEY = bytes(range(32))


def test_write_then_read_round_trips_with_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "k.key"
    write_key_file(path, KEY)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == b64url_encode(KEY) + "\n"
    assert read_key_file(path, what="test") == KEY


def test_write_refuses_existing_file_unless_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "k.key"
    path.write_text("old\n")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="already exists"):
        write_key_file(path, KEY)
    assert path.read_text() == "old\n"
    write_key_file(path, KEY, overwrite=True)
    assert read_key_file(path, what="test") == KEY
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["k.key"]


def test_write_rejects_wrong_length() -> None:
    with pytest.raises(ValueError):
        write_key_file(Path("/nonexistent/k"), b"short")


@pytest.mark.parametrize(
    "text",
    [
        base64.urlsafe_b64encode(KEY).decode(),  # padded
        b64url_encode(KEY),  # unpadded
        b64url_encode(KEY) + "\r\n",
    ],
)
def test_read_accepts_padded_unpadded_and_newline(tmp_path: Path, text: str) -> None:
    path = tmp_path / "k"
    path.write_text(text)
    assert read_key_file(path, what="test") == KEY


SECRET_TEXT = b64url_encode(b"\xab" * 31)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "is empty"),
        (SECRET_TEXT.encode() + b"\n", "holds 31 bytes, expected 32"),
        (base64.b64encode(b"\xfb" * 32), "not one line of base64url"),  # standard alphabet
        (b64url_encode(KEY).encode() + b"\n\n", "not one line"),
        (b" " + b64url_encode(KEY).encode(), "not one line"),
        (b"\xff" * 44, "not ASCII"),
        (b"A" * 500, "too large"),
    ],
)
def test_read_rejects_bad_content_without_echoing_it(
    tmp_path: Path, content: bytes, reason: str
) -> None:
    path = tmp_path / "k"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=reason) as info:
        read_key_file(path, what="seal")
    message = str(info.value)
    assert message.startswith(f"seal key file {path}")
    assert SECRET_TEXT not in message
    assert info.value.__context__ is None or info.value.__suppress_context__


def test_read_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        read_key_file(tmp_path / "absent", what="notify")
    with pytest.raises(ConfigError, match="is a directory"):
        read_key_file(tmp_path, what="notify")


def test_decode_is_canonical() -> None:
    assert b64url_decode("AA") == b"\x00"
    for bad in ("AB", "A", "AA=", "AA==", "A+", "AA\n", "ÀA"):
        with pytest.raises(ValueError):
            b64url_decode(bad)
    assert b64url_decode("AA==", allow_padding=True) == b"\x00"


def test_parse_grant_key_arg() -> None:
    public = Ed25519PrivateKey.generate().public_key()
    raw = public.public_bytes(Encoding.Raw, PublicFormat.Raw)
    kid, key = parse_grant_key_arg(f"k-1.a_b={b64url_encode(raw)}")
    assert kid == "k-1.a_b"
    assert key.public_bytes(Encoding.Raw, PublicFormat.Raw) == raw
    for bad in (
        b64url_encode(raw),
        f"={b64url_encode(raw)}",
        f"{'k' * 65}={b64url_encode(raw)}",
        f"k/1={b64url_encode(raw)}",
        "k1=" + b64url_encode(raw[:31]),
        "k1=notbase64!",
    ):
        with pytest.raises(ConfigError, match=r"--grant-key|key id"):
            parse_grant_key_arg(bad)


def test_read_seal_key(tmp_path: Path) -> None:
    path = tmp_path / "seal.key"
    write_key_file(path, KEY)
    key = read_seal_key(path)
    assert key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()) == KEY
