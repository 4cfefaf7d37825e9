"""Fuzz grant verification (``replica.grants.verify_grant``), before and behind the signature.

Two input shapes, told apart by the first byte:

* ``{...``: three lines, the header JSON, the payload JSON and the sealed secrets' plaintext.
  The harness signs them with the verifier's real key, and where the payload holds the string
  ``"@SEALED@"`` puts there a box of the third line sealed to the real seal key under the
  payload's own tenant and session. So mutations reach the claim checks and the box, which an
  unsigned token never does.
* anything else: the raw header value, tried as bytes and as text.

The documented errors are the leaves of :class:`~replica.errors.GrantError`. A grant that does
verify must be consistent: its shard is its session's, its data key 32 bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fuzz.common import instrument

    instrument("replica.grants", "replica.keyfiles", "replica.secretbox", "wire.names", "jwt")

import json

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fuzz.common import Harness, main
from fuzz.known import Mismatch
from replica.errors import GrantError
from replica.grants import Grant, GrantVerifier, secrets_context, verify_grant
from replica.keyfiles import b64url_encode
from replica.secretbox import seal

# Fixed test keys, so seed tokens in the corpus stay valid; they guard nothing.
SIGNING = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
SEAL = X25519PrivateKey.from_private_bytes(bytes(range(32, 64)))
VERIFIER = GrantVerifier(keys={"k1": SIGNING.public_key()}, seal_key=SEAL)
NOW = 1_700_000_000
SEALED_MARK = b'"@SEALED@"'
DEFAULT_TENANT, DEFAULT_SID = "acme", "a07-s1.abc"


def _context(payload: bytes) -> bytes:
    tenant, sid = DEFAULT_TENANT, DEFAULT_SID
    try:
        claims = json.loads(payload)
    except (ValueError, RecursionError):
        claims = None
    if isinstance(claims, dict):
        ten, sid_claim = claims.get("ten"), claims.get("sid")
        if isinstance(ten, str) and ten.isascii():
            tenant = ten
        if isinstance(sid_claim, str) and sid_claim.isascii():
            sid = sid_claim
    return secrets_context(tenant, sid)


def signed_token(data: bytes) -> str:
    header, _, rest = data.partition(b"\n")
    payload, _, secrets_plain = rest.partition(b"\n")
    if SEALED_MARK in payload:
        box = seal(SEAL.public_key(), secrets_plain, context=_context(payload))
        payload = payload.replace(SEALED_MARK, b'"' + b64url_encode(box).encode() + b'"', 1)
    signing_input = b64url_encode(header) + "." + b64url_encode(payload)
    return signing_input + "." + b64url_encode(SIGNING.sign(signing_input.encode()))


def _verified(grant: Grant) -> None:
    if grant.home_shard != grant.session.shard or len(grant.dek) != 32:
        raise Mismatch("grant", f"inconsistent grant {grant!r}")
    if grant.expires_at <= NOW - VERIFIER.leeway_s or not grant.workspace_root.startswith("/"):
        raise Mismatch("grant", f"accepted an expired or relative grant {grant!r}")


def check(data: bytes) -> None:
    tokens: tuple[str | bytes, ...]
    if data.startswith(b"{"):
        tokens = (signed_token(data),)
    else:
        tokens = (data, data.decode("utf-8", "surrogateescape"))
    for token in tokens:
        try:
            grant = verify_grant(VERIFIER, token, now=NOW)
        except GrantError:
            continue
        _verified(grant)


HARNESS = Harness(
    target="grants",
    test=check,
    tokens=(
        b'"alg":"EdDSA"',
        b'"alg":"none"',
        b'"alg":"HS256"',
        b'"kid":"k1"',
        b'"typ":"JWT"',
        b'"jku":"x"',
        b'"crit":["exp"]',
        b'"exp":',
        b'"iat":',
        b'"nbf":',
        b'"aud":"beyond-fleet"',
        b'"iss":"beyond-control-plane"',
        b'"ten":"acme"',
        b'"sid":"a07-s1.abc"',
        b'"shard":"a07-s1"',
        b'"ws":"/workspace"',
        b'"exec":"http://127.0.0.1:9/x"',
        b'"sec":"@SEALED@"',
        b'"dek":"',
        b'"exec_headers":{',
        b"1700000000",
        b"1700003600",
        b"NaN",
        b"1e400",
        b"eyJ",
        b".",
    ),
    max_len=8192,
)

if __name__ == "__main__":
    main(HARNESS)
