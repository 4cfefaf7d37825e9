"""The control plane's keys, and minting grants with them.

A keyset is a directory (mode 0700) of key files in the format of :mod:`replica.keyfiles`, each
mode 0600:

======================  ==========================================================  ===========
file                    what                                                        who holds it
======================  ==========================================================  ===========
``grant-signing.key``   Ed25519 private key that signs grants                       control plane
``grant-keys.txt``      ``kid=PUBLIC`` lines, each exactly a ``--grant-key`` value  replicas
``seal.key``            X25519 private key that opens the secrets in grants         replicas
``seal.pub``            its public half, which the control plane seals to           control plane
``notify.key``          32 random bytes for job-end notify tokens                   replicas
``tenant-root.key``     simulator only: root from which tenant data keys derive     simulator
======================  ==========================================================  ===========

``tenant-root.key`` is a simulator convenience. A real control plane keeps each tenant's data key
in its own secret store and never derives it from a shared root; the simulator derives it
(:func:`derive_tenant_dek`) so that every grant it mints for a tenant, in any process, carries the
same key without a database.

Errors: a keyset that cannot be written or read is :class:`~replica.errors.ConfigError` (what
``fleet-sim`` reports as bad input); a claim the replica would refuse is the same
:class:`~replica.errors.GrantError` the replica would raise, so nothing minted here can fail
verification for its content.
"""

from __future__ import annotations

import os
import secrets
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Final

import jwt
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from replica.errors import ConfigError, GrantBadClaims, GrantMalformed
from replica.grants import (
    ALGORITHM,
    DEFAULT_AUDIENCE,
    DEFAULT_ISSUER,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_LIFETIME_S,
    encode_secrets,
    secrets_context,
    validate_exec_url,
    validate_workspace_root,
)
from replica.keyfiles import (
    KEY_LEN,
    b64url_encode,
    parse_grant_key_arg,
    parse_kid,
    read_key_file,
    write_key_file,
)
from replica.secretbox import seal
from wire.names import parse_session_id, parse_tenant

SIGNING_KEY_FILE: Final = "grant-signing.key"
GRANT_KEYS_FILE: Final = "grant-keys.txt"
SEAL_KEY_FILE: Final = "seal.key"
SEAL_PUB_FILE: Final = "seal.pub"
NOTIFY_KEY_FILE: Final = "notify.key"
TENANT_ROOT_FILE: Final = "tenant-root.key"
KEYSET_FILES: Final = (
    SIGNING_KEY_FILE,
    GRANT_KEYS_FILE,
    SEAL_KEY_FILE,
    SEAL_PUB_FILE,
    NOTIFY_KEY_FILE,
    TENANT_ROOT_FILE,
)
DEFAULT_TTL_S: Final = 3600
_MAX_GRANT_KEYS_BYTES: Final = 64 * 1024
_TENANT_DEK_INFO: Final = b"beyond-fleet-sim tenant dek v1\0"


@dataclass(frozen=True, slots=True)
class KeySet:
    """A loaded keyset. Private keys stay out of ``repr``."""

    directory: Path
    kid: str
    signing_key: Ed25519PrivateKey = field(repr=False)
    grant_keys: Mapping[str, Ed25519PublicKey] = field(repr=False)
    seal_key: X25519PrivateKey = field(repr=False)
    seal_public: X25519PublicKey = field(repr=False)
    notify_key: bytes = field(repr=False)
    tenant_root: bytes | None = field(repr=False)

    @property
    def grant_key_args(self) -> tuple[str, ...]:
        """The ``--grant-key`` values a replica of this fleet is started with."""
        return tuple(f"{kid}={_raw_public(key)}" for kid, key in self.grant_keys.items())

    @property
    def seal_key_path(self) -> Path:
        return self.directory / SEAL_KEY_FILE

    @property
    def notify_key_path(self) -> Path:
        return self.directory / NOTIFY_KEY_FILE


def _raw_public(key: Ed25519PublicKey | X25519PublicKey) -> str:
    return b64url_encode(key.public_bytes(Encoding.Raw, PublicFormat.Raw))


def _raw_private(key: Ed25519PrivateKey | X25519PrivateKey) -> bytes:
    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def _prepare_directory(directory: Path) -> None:
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = directory.stat()
    except OSError as exc:
        raise ConfigError(f"keys directory {directory} cannot be created: {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"keys directory {directory} is not a directory")
    if info.st_uid != os.getuid():
        raise ConfigError(f"keys directory {directory} belongs to another user")
    if info.st_mode & 0o077:
        # Tightening a directory someone else chose (say /tmp) would be worse than refusing.
        raise ConfigError(
            f"keys directory {directory} is open to group or others; "
            "use a new directory or chmod 700 it"
        )


def generate_keyset(directory: Path, *, kid: str = "k1", force: bool = False) -> KeySet:
    """Create a fresh keyset in ``directory``; an existing one is replaced only with ``force``."""
    kid = parse_kid(kid)
    _prepare_directory(directory)
    existing = [name for name in KEYSET_FILES if (directory / name).exists()]
    if existing and not force:
        raise ConfigError(
            f"keys directory {directory} already holds a keyset ({', '.join(existing)}); "
            "pass --force to replace it"
        )
    signing = Ed25519PrivateKey.generate()
    seal_private = X25519PrivateKey.generate()
    write_key_file(directory / SIGNING_KEY_FILE, _raw_private(signing), overwrite=force)
    write_key_file(directory / SEAL_KEY_FILE, _raw_private(seal_private), overwrite=force)
    pub = seal_private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    write_key_file(directory / SEAL_PUB_FILE, pub, overwrite=force)
    write_key_file(directory / NOTIFY_KEY_FILE, secrets.token_bytes(KEY_LEN), overwrite=force)
    write_key_file(directory / TENANT_ROOT_FILE, secrets.token_bytes(KEY_LEN), overwrite=force)
    _write_text(
        directory / GRANT_KEYS_FILE, f"{kid}={_raw_public(signing.public_key())}\n", force=force
    )
    return load_keyset(directory)


def _write_text(path: Path, text: str, *, force: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_TRUNC if force else os.O_EXCL)
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_grant_keys(path: Path) -> dict[str, Ed25519PublicKey]:
    try:
        with path.open("rb") as handle:
            raw = handle.read(_MAX_GRANT_KEYS_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"grant key list {path} cannot be read: {exc.strerror}") from None
    if len(raw) > _MAX_GRANT_KEYS_BYTES:
        raise ConfigError(f"grant key list {path} is too large")
    try:
        lines = raw.decode("ascii").splitlines()
    except UnicodeDecodeError:
        raise ConfigError(f"grant key list {path} is not ASCII text") from None
    keys: dict[str, Ed25519PublicKey] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            kid, key = parse_grant_key_arg(line.strip())
        except ConfigError as exc:
            raise ConfigError(f"grant key list {path} line {number}: {exc}") from None
        if kid in keys:
            raise ConfigError(f"grant key list {path} line {number}: key id {kid} repeated")
        keys[kid] = key
    if not keys:
        raise ConfigError(f"grant key list {path} names no key")
    return keys


def load_keyset(directory: Path) -> KeySet:
    """Load a keyset written by :func:`generate_keyset`, checking that its halves match."""
    if not directory.is_dir():
        raise ConfigError(
            f"keys directory {directory} does not exist (create it with fleet-sim keys)"
        )
    signing = Ed25519PrivateKey.from_private_bytes(
        read_key_file(directory / SIGNING_KEY_FILE, what="grant signing")
    )
    grant_keys = _read_grant_keys(directory / GRANT_KEYS_FILE)
    signing_public = _raw_public(signing.public_key())
    # The signing key's kid is whichever listed key it is the private half of; older keys may
    # stay listed during a rotation.
    kids = [kid for kid, key in grant_keys.items() if _raw_public(key) == signing_public]
    if not kids:
        raise ConfigError(f"{GRANT_KEYS_FILE} in {directory} does not list the signing key")
    seal_private = X25519PrivateKey.from_private_bytes(
        read_key_file(directory / SEAL_KEY_FILE, what="seal")
    )
    seal_public = X25519PublicKey.from_public_bytes(
        read_key_file(directory / SEAL_PUB_FILE, what="seal public")
    )
    if _raw_public(seal_public) != _raw_public(seal_private.public_key()):
        raise ConfigError(f"{SEAL_PUB_FILE} in {directory} is not the public half of seal.key")
    notify = read_key_file(directory / NOTIFY_KEY_FILE, what="notify")
    root_path = directory / TENANT_ROOT_FILE
    tenant_root = read_key_file(root_path, what="tenant root") if root_path.exists() else None
    return KeySet(
        directory=directory,
        kid=kids[0],
        signing_key=signing,
        grant_keys=MappingProxyType(grant_keys),
        seal_key=seal_private,
        seal_public=seal_public,
        notify_key=notify,
        tenant_root=tenant_root,
    )


def new_tenant_dek() -> bytes:
    """A fresh random 32-byte tenant data key."""
    return secrets.token_bytes(KEY_LEN)


def derive_tenant_dek(keyset: KeySet, tenant: str) -> bytes:
    """The simulator's data key for ``tenant``: the same for every grant minted from this keyset."""
    tenant = parse_tenant(tenant)
    if keyset.tenant_root is None:
        raise ConfigError(
            f"keys directory {keyset.directory} has no {TENANT_ROOT_FILE}; pass a data key file"
        )
    hkdf = HKDF(
        algorithm=hashes.SHA256(),
        length=KEY_LEN,
        salt=None,
        info=_TENANT_DEK_INFO + tenant.encode("ascii"),
    )
    return hkdf.derive(keyset.tenant_root)


def mint_grant(
    keyset: KeySet,
    *,
    tenant: str,
    session_id: str,
    workspace_root: str,
    exec_url: str,
    dek: bytes,
    exec_headers: Mapping[str, str],
    ttl_s: int = DEFAULT_TTL_S,
    now: float | None = None,
    audience: str = DEFAULT_AUDIENCE,
    issuer: str = DEFAULT_ISSUER,
) -> str:
    """Sign a grant for one session, its secrets sealed to the fleet's seal key."""
    tenant = parse_tenant(tenant)
    session = parse_session_id(session_id)
    workspace_root = validate_workspace_root(workspace_root)
    exec_url = validate_exec_url(exec_url)
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int):
        raise GrantBadClaims("grant ttl must be an integer number of seconds")
    if not 0 < ttl_s <= DEFAULT_MAX_LIFETIME_S:
        raise GrantBadClaims(f"grant ttl must be 1-{DEFAULT_MAX_LIFETIME_S} seconds")
    issued_at = int(time.time() if now is None else now)
    plaintext = encode_secrets(dek, exec_headers)
    sealed = seal(keyset.seal_public, plaintext, context=secrets_context(tenant, str(session)))
    claims = {
        "iss": issuer,
        "aud": audience,
        "iat": issued_at,
        "exp": issued_at + ttl_s,
        "ten": tenant,
        "sid": str(session),
        "shard": str(session.shard),
        "ws": workspace_root,
        "exec": exec_url,
        "sec": b64url_encode(sealed),
    }
    token = jwt.encode(
        claims,
        keyset.signing_key,
        algorithm=ALGORITHM,
        headers={"kid": keyset.kid, "typ": "JWT"},
    )
    if len(token) > DEFAULT_MAX_BYTES:
        raise GrantMalformed(
            f"grant would be {len(token)} bytes, over the replicas' {DEFAULT_MAX_BYTES}-byte bound"
        )
    return token
