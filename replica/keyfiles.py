"""The small key files the command lines take, and the ``--grant-key KID=PUBKEY`` flag.

A key file holds one line: the raw key bytes (32 for every key the fleet uses) as base64url,
padded or not, optionally followed by a newline. Text rather than raw bytes so an operator can
move keys through secret stores and environment files without a binary-safe channel.

Reading is strict: one canonical encoding of exactly the expected length, nothing else in the
file. Every complaint is a :class:`~replica.errors.ConfigError` that names the file and what is
wrong with it, and never echoes what the file holds (a truncated private key is still secret).
Writing creates the file with mode 0600 and, unless told to replace it, refuses to clobber an
existing one.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import secrets
from pathlib import Path
from typing import Final

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from replica.errors import ConfigError

KEY_LEN: Final = 32
# A 32-byte key is 44 characters padded; the rest is room for a newline, never for content.
_MAX_FILE_BYTES: Final = 128
_B64URL: Final = re.compile(r"[A-Za-z0-9_-]*={0,2}")
_KID: Final = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def b64url_encode(data: bytes) -> str:
    """Unpadded base64url, as JOSE and our key files use it."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64url_decode(text: str, *, allow_padding: bool = False) -> bytes:
    """Decode base64url strictly; raise ``ValueError`` on anything but one canonical encoding.

    Python's decoder skips characters outside the alphabet and ignores stray low bits; both would
    let two different strings stand for the same bytes, so both are refused here.
    """
    if not isinstance(text, str) or not text.isascii() or not _B64URL.fullmatch(text):
        raise ValueError("not base64url")
    body = text.rstrip("=")
    if body != text and (not allow_padding or len(text) % 4 != 0):
        raise ValueError("bad base64url padding")
    if len(body) % 4 == 1:
        raise ValueError("bad base64url length")
    try:
        data = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    except binascii.Error:
        raise ValueError("not base64url") from None
    if b64url_encode(data) != body:
        raise ValueError("non-canonical base64url")
    return data


def decode_key_text(text: str, *, length: int = KEY_LEN) -> bytes:
    """Decode a key file's text; ``ValueError`` with a reason that never quotes the text."""
    if text.endswith("\r\n"):
        text = text[:-2]
    elif text.endswith("\n"):
        text = text[:-1]
    if not text:
        raise ValueError("is empty")
    try:
        key = b64url_decode(text, allow_padding=True)
    except ValueError:
        raise ValueError("is not one line of base64url text") from None
    if len(key) != length:
        raise ValueError(f"holds {len(key)} bytes, expected {length}")
    return key


def read_key_file(path: Path, *, what: str, length: int = KEY_LEN) -> bytes:
    """Read a key file written by :func:`write_key_file` (or by hand in the same format)."""
    try:
        with path.open("rb") as handle:
            raw = handle.read(_MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{what} key file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} key file {path} is a directory") from None
    except OSError as exc:
        raise ConfigError(f"{what} key file {path} cannot be read: {exc.strerror}") from None
    if len(raw) > _MAX_FILE_BYTES:
        raise ConfigError(f"{what} key file {path} is too large to be a {length}-byte key")
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise ConfigError(f"{what} key file {path} is not ASCII text") from None
    try:
        return decode_key_text(text, length=length)
    except ValueError as exc:
        raise ConfigError(f"{what} key file {path} {exc}") from None


def write_key_file(path: Path, key: bytes, *, overwrite: bool = False) -> None:
    """Write ``key`` as one line of base64url to a new file with mode 0600.

    Without ``overwrite`` an existing file is an error (``O_EXCL``). With it, the new key goes to a
    private temporary file that then replaces the old one, so no reader ever sees a half-written
    key and a file that was once world-readable does not stay so.
    """
    if not isinstance(key, bytes) or len(key) != KEY_LEN:
        raise ValueError(f"a key file holds exactly {KEY_LEN} bytes")
    data = (b64url_encode(key) + "\n").encode("ascii")
    if not overwrite:
        try:
            _write_new(path, data)
        except FileExistsError:
            raise ConfigError(f"key file {path} already exists; refusing to overwrite it") from None
        return
    temp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        _write_new(temp, data)
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def _write_new(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        # The umask can only remove bits, but the file may sit on a filesystem that ignores the
        # creation mode; say it again explicitly.
        os.fchmod(fd, 0o600)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def parse_kid(value: str) -> str:
    """A key id: 1-64 characters of ``[A-Za-z0-9_.-]``."""
    if not isinstance(value, str) or not _KID.fullmatch(value):
        raise ConfigError("key id must be 1-64 characters of [A-Za-z0-9_.-]")
    return value


def parse_grant_key_arg(value: str) -> tuple[str, Ed25519PublicKey]:
    """Parse one ``--grant-key KID=PUBKEY`` value: a key id and a raw Ed25519 public key."""
    kid, sep, encoded = value.partition("=")
    if not sep:
        raise ConfigError("--grant-key must be KID=PUBKEY (PUBKEY: base64url of 32 bytes)")
    kid = parse_kid(kid)
    try:
        raw = decode_key_text(encoded)
    except ValueError as exc:
        raise ConfigError(f"--grant-key {kid}: public key {exc}") from None
    return kid, Ed25519PublicKey.from_public_bytes(raw)


def read_seal_key(path: Path) -> X25519PrivateKey:
    """The fleet's X25519 private key (``--seal-key``), which opens the secrets in grants."""
    return X25519PrivateKey.from_private_bytes(read_key_file(path, what="seal"))


def read_signing_key(path: Path) -> Ed25519PrivateKey:
    """An Ed25519 private key that signs grants (held by the control plane, not replicas)."""
    return Ed25519PrivateKey.from_private_bytes(read_key_file(path, what="grant signing"))
