"""The ``x-beyond-grant`` header: what a grant must say and how a replica verifies it.

A grant is a compact JWS (a JWT) signed by the control plane with Ed25519. It names one tenant
and one session and carries, sealed to the fleet key (:mod:`replica.secretbox`), the secrets a
replica needs to serve it: the tenant's 32-byte data key and the headers for the session's
sandbox exec endpoint.

Header: ``{"alg": "EdDSA", "kid": ..., "typ": "JWT"?}``; no other parameter is accepted, so no
``jku``/``jwk``/``crit`` trick can get a say in how the token is checked. Payload::

    exp, iat      NumericDate integers; exp - iat at most ``max_lifetime_s``; nbf optional
    aud, iss      exactly the verifier's audience and issuer (strings, not lists)
    ten           tenant             (wire.names.parse_tenant)
    sid           session id         (wire.names.parse_session_id)
    shard         home shard         (wire.names.parse_shard; equal to the id's shard)
    ws            workspace root     (absolute POSIX path, no control characters)
    exec          exec endpoint URL  (http or https, no credentials or fragment)
    sec           base64url of the sealed box

The box opens only under ``secrets_context(tenant, session id)``, so a box lifted out of one grant
and put into another (another tenant, another session) does not open. Its plaintext is JSON:
``{"dek": base64url(32 bytes), "exec_headers": {name: value}}``.

Verification order: size and shape; both JSON segments parsed strictly here (duplicate keys,
``NaN`` and non-objects are refused, since two parsers reading a duplicated key differently is how
a checked claim differs from a used one); ``alg`` must be ``EdDSA``; ``kid`` picks the key; PyJWT
checks the signature (with the algorithm list fixed to ``["EdDSA"]``), ``aud``, ``iss`` and that
the registered claims are present; then the times (against ``now``, so tests need no clock), our
claims, and finally the box. Nothing but the signature decides which key checks it, and no claim
is used before the signature has been checked.

Which error, when (each a leaf of :class:`~replica.errors.GrantError`):

- :class:`GrantMalformed`: too large, not three base64url segments, not JSON objects, duplicate
  keys, a header parameter we do not know, a missing ``kid``, and any ``alg`` other than
  ``EdDSA`` (``none`` and ``HS256`` included): we refuse the header before looking for a key.
- :class:`GrantUnknownKid`: a well-formed header naming a key this replica was not given.
- :class:`GrantBadSignature`: the Ed25519 signature does not verify with the named key.
- :class:`GrantExpired`: ``exp`` is missing or past (with ``leeway``).
- :class:`GrantBadClaims`: wrong ``aud``/``iss``; missing or ill-typed claims; ``iat``/``nbf`` in
  the future; a lifetime over the bound; any of our claims failing its parser.
- :class:`GrantSealError`: ``sec`` is not a box, does not open with our key under this grant's
  context, or holds a plaintext of the wrong shape.

No message names a secret, and each error is raised ``from None`` so a caught cryptography or
PyJWT exception is never shown as its context.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, NoReturn
from urllib.parse import urlsplit

import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from replica.errors import (
    GrantBadClaims,
    GrantBadSignature,
    GrantError,
    GrantExpired,
    GrantMalformed,
    GrantSealError,
    GrantUnknownKid,
)
from replica.keyfiles import b64url_decode, b64url_encode
from replica.secretbox import open_sealed
from wire.errors import InvalidName
from wire.names import SessionId, Shard, parse_session_id, parse_shard, parse_tenant

ALGORITHM: Final = "EdDSA"
# Fixed here, never read from a token.
ALGORITHMS: Final = (ALGORITHM,)
DEFAULT_AUDIENCE: Final = "beyond-fleet"
DEFAULT_ISSUER: Final = "beyond-control-plane"
DEFAULT_MAX_BYTES: Final = 12 * 1024
DEFAULT_LEEWAY_S: Final = 5
DEFAULT_MAX_LIFETIME_S: Final = 24 * 3600

DEK_LEN: Final = 32
MAX_WORKSPACE_ROOT: Final = 4096
MAX_EXEC_URL: Final = 2048
MAX_EXEC_HEADERS: Final = 32
MAX_HEADER_NAME: Final = 128
MAX_HEADER_VALUE: Final = 4096
# A box of the largest secrets plaintext we accept fits well inside this.
MAX_SEALED_TEXT: Final = 10 * 1024

REQUIRED_CLAIMS: Final = ("exp", "iat", "aud", "iss", "ten", "sid", "shard", "ws", "exec", "sec")
_HEADER_PARAMS: Final = frozenset({"alg", "kid", "typ"})
_SECRETS_KEYS: Final = frozenset({"dek", "exec_headers"})
_CONTEXT_LABEL: Final = b"beyond-grant-secrets/v1\0"

_TOKEN: Final = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")
# RFC 9110 token characters, the only ones a field name may use.
_HEADER_TOKEN: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
# Visible ASCII, space and tab: no CR/LF (header injection) and no other control characters.
_HEADER_VALUE: Final = re.compile(r"[\x20-\x7e\t]*")
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")
# Headers that belong to the connection or to the request framing, never to a tenant's secrets.
_RESERVED_HEADERS: Final = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "upgrade", "te", "trailer"}
)


@dataclass(frozen=True, slots=True)
class GrantVerifier:
    """Everything a replica needs to verify grants; built once from flags at start-up."""

    keys: Mapping[str, Ed25519PublicKey]
    seal_key: X25519PrivateKey = field(repr=False)
    audience: str = DEFAULT_AUDIENCE
    issuer: str = DEFAULT_ISSUER
    max_bytes: int = DEFAULT_MAX_BYTES
    leeway_s: float = DEFAULT_LEEWAY_S
    max_lifetime_s: int = DEFAULT_MAX_LIFETIME_S

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError("a grant verifier needs at least one key")
        # A read-only copy, so a caller mutating its dict cannot change a running verifier.
        object.__setattr__(self, "keys", MappingProxyType(dict(self.keys)))
        if self.max_bytes <= 0 or self.leeway_s < 0 or self.max_lifetime_s <= 0:
            raise ValueError("max_bytes and max_lifetime_s must be positive, leeway_s not negative")


@dataclass(frozen=True, slots=True)
class Grant:
    """A verified grant. ``dek`` and ``exec_headers`` are secrets and stay out of ``repr``."""

    tenant: str
    session: SessionId
    home_shard: Shard
    workspace_root: str
    exec_url: str
    dek: bytes = field(repr=False)
    exec_headers: tuple[tuple[str, str], ...] = field(repr=False)
    expires_at: int
    kid: str


def secrets_context(tenant: str, session_id: str) -> bytes:
    """Associated data for a grant's box: binds it to one tenant and one session."""
    return _CONTEXT_LABEL + tenant.encode("ascii") + b"\0" + session_id.encode("ascii")


# --- claim validators, shared with the minting side so it refuses what we would refuse ---


def validate_workspace_root(value: object) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise GrantBadClaims("grant claim 'ws' must be an absolute POSIX path")
    if len(value) > MAX_WORKSPACE_ROOT:
        raise GrantBadClaims(f"grant claim 'ws' is longer than {MAX_WORKSPACE_ROOT} characters")
    if _CONTROL.search(value):
        raise GrantBadClaims("grant claim 'ws' contains NUL or another control character")
    return value


def validate_exec_url(value: object) -> str:
    if not isinstance(value, str) or not value.isascii():
        raise GrantBadClaims("grant claim 'exec' must be an ASCII URL")
    if len(value) > MAX_EXEC_URL:
        raise GrantBadClaims(f"grant claim 'exec' is longer than {MAX_EXEC_URL} characters")
    if _CONTROL.search(value) or " " in value:
        raise GrantBadClaims("grant claim 'exec' contains whitespace or control characters")
    try:
        parts = urlsplit(value)
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        raise GrantBadClaims("grant claim 'exec' is not a valid URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise GrantBadClaims("grant claim 'exec' must be an http or https URL with a host")
    if parts.username is not None or parts.password is not None or parts.fragment:
        # Credentials belong in the sealed exec headers, where a client cannot read them.
        raise GrantBadClaims("grant claim 'exec' must carry no credentials or fragment")
    return value


def validate_exec_headers(value: object) -> tuple[tuple[str, str], ...]:
    """Exec headers as sorted pairs; ``GrantSealError`` because they only ever live in the box."""
    if not isinstance(value, Mapping):
        raise GrantSealError("sealed secrets: 'exec_headers' must be an object")
    if len(value) > MAX_EXEC_HEADERS:
        raise GrantSealError(f"sealed secrets: more than {MAX_EXEC_HEADERS} exec headers")
    seen: set[str] = set()
    pairs: list[tuple[str, str]] = []
    for name, header_value in value.items():
        if (
            not isinstance(name, str)
            or len(name) > MAX_HEADER_NAME
            or not _HEADER_TOKEN.fullmatch(name)
        ):
            raise GrantSealError("sealed secrets: an exec header name is not a valid field name")
        if name.lower() in _RESERVED_HEADERS or name.lower() in seen:
            raise GrantSealError("sealed secrets: an exec header name is reserved or repeated")
        if (
            not isinstance(header_value, str)
            or len(header_value) > MAX_HEADER_VALUE
            or not _HEADER_VALUE.fullmatch(header_value)
        ):
            raise GrantSealError("sealed secrets: an exec header value is not a valid field value")
        seen.add(name.lower())
        pairs.append((name, header_value))
    return tuple(sorted(pairs))


def encode_secrets(dek: bytes, exec_headers: Mapping[str, str]) -> bytes:
    """The plaintext a grant's box carries (the minting side seals this)."""
    if not isinstance(dek, bytes) or len(dek) != DEK_LEN:
        raise GrantSealError(f"sealed secrets: the data key must be {DEK_LEN} bytes")
    headers = dict(validate_exec_headers(exec_headers))
    document = {"dek": b64url_encode(dek), "exec_headers": headers}
    return json.dumps(document, separators=(",", ":"), sort_keys=True).encode("ascii")


def decode_secrets(plaintext: bytes) -> tuple[bytes, tuple[tuple[str, str], ...]]:
    try:
        document = _strict_json(plaintext)
    except ValueError:
        raise GrantSealError("sealed secrets: not a JSON object") from None
    if set(document) != _SECRETS_KEYS:
        raise GrantSealError("sealed secrets: must hold exactly 'dek' and 'exec_headers'")
    dek_text = document["dek"]
    try:
        dek = b64url_decode(dek_text) if isinstance(dek_text, str) else b""
    except ValueError:
        dek = b""
    if len(dek) != DEK_LEN:
        raise GrantSealError(f"sealed secrets: 'dek' must be base64url of {DEK_LEN} bytes")
    return dek, validate_exec_headers(document["exec_headers"])


# --- verification ---


def verify_grant(verifier: GrantVerifier, token: str | bytes, *, now: float | None = None) -> Grant:
    """Verify a grant and open its secrets, or raise one leaf of :class:`GrantError`."""
    text = _token_text(token, verifier.max_bytes)
    header_b64, payload_b64, _signature = text.split(".")
    header = _segment_json(header_b64, "header")
    payload = _segment_json(payload_b64, "payload")
    kid = _check_header(header)
    key = verifier.keys.get(kid)
    if key is None:
        raise GrantUnknownKid("grant is signed with a key id this replica does not know")
    _verify_with_pyjwt(verifier, text, key)
    when = time.time() if now is None else now
    expires_at = _check_times(verifier, payload, when)
    return _build_grant(verifier, payload, kid, expires_at)


def _token_text(token: object, max_bytes: int) -> str:
    if isinstance(token, bytes):
        if len(token) > max_bytes:
            raise GrantMalformed(f"grant is larger than {max_bytes} bytes")
        try:
            token = token.decode("ascii")
        except UnicodeDecodeError:
            raise GrantMalformed("grant is not ASCII") from None
    if not isinstance(token, str):
        raise GrantMalformed("grant must be text")
    if len(token) > max_bytes:
        raise GrantMalformed(f"grant is larger than {max_bytes} bytes")
    if not token.isascii() or not _TOKEN.fullmatch(token):
        raise GrantMalformed("grant is not three base64url segments joined by '.'")
    return token


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise ValueError("duplicate key")
        document[key] = value
    return document


def _reject_constant(_name: str) -> NoReturn:
    raise ValueError("NaN and Infinity are not JSON")


def _strict_json(data: bytes) -> dict[str, Any]:
    """Parse a JSON object, refusing duplicate keys and non-finite numbers (``ValueError``)."""
    try:
        document = json.loads(
            data.decode("utf-8"),
            object_pairs_hook=_reject_duplicates,
            parse_constant=_reject_constant,
        )
    except (UnicodeDecodeError, RecursionError):
        raise ValueError("not UTF-8 JSON") from None
    if not isinstance(document, dict):
        raise ValueError("not a JSON object")
    return document


def _segment_json(segment: str, what: str) -> dict[str, Any]:
    try:
        return _strict_json(b64url_decode(segment))
    except ValueError:
        raise GrantMalformed(
            f"grant {what} is not a base64url JSON object with unique keys"
        ) from None


def _check_header(header: dict[str, Any]) -> str:
    if not set(header) <= _HEADER_PARAMS:
        raise GrantMalformed("grant header has parameters other than alg, kid and typ")
    if header.get("alg") != ALGORITHM:
        raise GrantMalformed(f"grant header alg must be {ALGORITHM}")
    if "typ" in header and header["typ"] != "JWT":
        raise GrantMalformed("grant header typ must be JWT when present")
    kid = header.get("kid")
    if not isinstance(kid, str) or not kid:
        raise GrantMalformed("grant header has no kid")
    return kid


def _verify_with_pyjwt(verifier: GrantVerifier, token: str, key: Ed25519PublicKey) -> None:
    try:
        jwt.decode(
            token,
            key,
            algorithms=list(ALGORITHMS),
            audience=verifier.audience,
            issuer=verifier.issuer,
            options={
                # Times are checked by _check_times against an injectable clock.
                "verify_exp": False,
                "verify_iat": False,
                "verify_nbf": False,
                "strict_aud": True,
                "require": ["exp", "iat", "aud", "iss"],
            },
        )
    except jwt.InvalidSignatureError:
        raise GrantBadSignature("grant signature does not verify") from None
    except jwt.MissingRequiredClaimError as exc:
        if exc.claim == "exp":
            raise GrantExpired("grant has no exp claim") from None
        raise GrantBadClaims(f"grant is missing the {exc.claim!r} claim") from None
    except jwt.InvalidAudienceError:
        raise GrantBadClaims("grant aud does not name this fleet") from None
    except jwt.InvalidIssuerError:
        raise GrantBadClaims("grant iss is not the control plane") from None
    except (jwt.DecodeError, jwt.InvalidAlgorithmError, jwt.InvalidKeyError):
        raise GrantMalformed("grant could not be decoded") from None
    except jwt.PyJWTError:
        raise GrantBadClaims("grant claims are not acceptable") from None


def _numeric_date(payload: Mapping[str, Any], claim: str) -> int:
    value = payload[claim]
    # bool is an int in Python but never a date; floats are refused to keep one encoding.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**53:
        raise GrantBadClaims(f"grant claim {claim!r} must be an integer NumericDate")
    return value


def _check_times(verifier: GrantVerifier, payload: Mapping[str, Any], now: float) -> int:
    if not math.isfinite(now):
        raise ValueError("now must be finite")
    exp = _numeric_date(payload, "exp")
    iat = _numeric_date(payload, "iat")
    if exp <= now - verifier.leeway_s:
        raise GrantExpired("grant has expired")
    if iat > now + verifier.leeway_s:
        raise GrantBadClaims("grant was issued in the future")
    if "nbf" in payload and _numeric_date(payload, "nbf") > now + verifier.leeway_s:
        raise GrantBadClaims("grant is not valid yet (nbf)")
    if not 0 < exp - iat <= verifier.max_lifetime_s:
        raise GrantBadClaims(f"grant lifetime must be 1-{verifier.max_lifetime_s} seconds")
    return exp


def _build_grant(
    verifier: GrantVerifier, payload: Mapping[str, Any], kid: str, expires_at: int
) -> Grant:
    missing = [claim for claim in REQUIRED_CLAIMS if claim not in payload]
    if missing:
        raise GrantBadClaims(f"grant is missing claims: {', '.join(missing)}")
    try:
        tenant = parse_tenant(payload["ten"])
        session = parse_session_id(payload["sid"])
        shard = parse_shard(payload["shard"])
    except InvalidName as exc:
        raise GrantBadClaims(f"grant names are not acceptable: {exc}") from None
    if shard != session.shard:
        raise GrantBadClaims("grant claim 'shard' is not the session id's shard")
    workspace_root = validate_workspace_root(payload["ws"])
    exec_url = validate_exec_url(payload["exec"])
    sealed_text = payload["sec"]
    if not isinstance(sealed_text, str) or len(sealed_text) > MAX_SEALED_TEXT:
        raise GrantSealError("grant claim 'sec' must be base64url text of a sealed box")
    try:
        sealed = b64url_decode(sealed_text)
    except ValueError:
        raise GrantSealError("grant claim 'sec' is not base64url") from None
    context = secrets_context(tenant, str(session))
    dek, exec_headers = decode_secrets(open_sealed(verifier.seal_key, sealed, context=context))
    return Grant(
        tenant=tenant,
        session=session,
        home_shard=shard,
        workspace_root=workspace_root,
        exec_url=exec_url,
        dek=dek,
        exec_headers=exec_headers,
        expires_at=expires_at,
        kid=kid,
    )


__all__ = [
    "ALGORITHMS",
    "DEFAULT_AUDIENCE",
    "DEFAULT_ISSUER",
    "Grant",
    "GrantError",
    "GrantVerifier",
    "decode_secrets",
    "encode_secrets",
    "secrets_context",
    "validate_exec_headers",
    "validate_exec_url",
    "validate_workspace_root",
    "verify_grant",
]
