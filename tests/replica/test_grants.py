from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replica.errors import (
    GrantBadClaims,
    GrantBadSignature,
    GrantError,
    GrantExpired,
    GrantMalformed,
    GrantSealError,
    GrantUnknownKid,
)
from replica.grants import Grant, GrantVerifier, secrets_context, verify_grant
from replica.keyfiles import b64url_encode
from replica.secretbox import seal
from wire.names import parse_session_id, parse_shard

SIGNER = Ed25519PrivateKey.generate()
FLEET = X25519PrivateKey.generate()
VERIFIER = GrantVerifier({"k1": SIGNER.public_key()}, FLEET)
NOW = 1_800_000_000
TENANT = "acme"
SID = "a07-s3.abc123"
DEK = bytes(range(100, 132))
EXEC_SECRET = "Bearer sandbox-token-0123456789"
SECRET_STRINGS = (b64url_encode(DEK), DEK.hex(), repr(DEK), EXEC_SECRET, "sandbox-token")
DROP = object()


def secrets_json(**changes: Any) -> bytes:
    document: dict[str, Any] = {
        "dek": b64url_encode(DEK),
        "exec_headers": {"Authorization": EXEC_SECRET},
    }
    document.update(changes)
    return json.dumps(document).encode()


def sealed(
    tenant: str = TENANT,
    sid: str = SID,
    plaintext: bytes | None = None,
    recipient: X25519PublicKey | None = None,
) -> str:
    box = seal(
        recipient or FLEET.public_key(),
        secrets_json() if plaintext is None else plaintext,
        context=secrets_context(tenant, sid),
    )
    return b64url_encode(box)


def claims(**changes: object) -> dict[str, object]:
    payload: dict[str, object] = {
        "iss": "beyond-control-plane",
        "aud": "beyond-fleet",
        "iat": NOW - 10,
        "exp": NOW + 3600,
        "ten": TENANT,
        "sid": SID,
        "shard": "a07-s3",
        "ws": "/workspace/acme",
        "exec": "https://127.0.0.1:8443/exec",
        "sec": sealed(),
    }
    for name, value in changes.items():
        if value is DROP:
            del payload[name]
        else:
            payload[name] = value
    return payload


def token(
    payload: dict[str, object] | str | None = None,
    header: dict[str, object] | str | None = None,
    key: Ed25519PrivateKey = SIGNER,
) -> str:
    """Sign raw JSON text, so tests can say things PyJWT's encoder never would."""
    header = {"alg": "EdDSA", "kid": "k1", "typ": "JWT"} if header is None else header
    payload = claims() if payload is None else payload
    header_text = header if isinstance(header, str) else json.dumps(header)
    payload_text = payload if isinstance(payload, str) else json.dumps(payload)
    signing_input = f"{b64url_encode(header_text.encode())}.{b64url_encode(payload_text.encode())}"
    return f"{signing_input}.{b64url_encode(key.sign(signing_input.encode()))}"


def refused(value: str | bytes, kind: type[GrantError], match: str | None = None) -> GrantError:
    with pytest.raises(kind, match=match) as info:
        verify_grant(VERIFIER, value, now=NOW)
    assert type(info.value) is kind
    text = f"{info.value} {info.value!r}"
    for secret in SECRET_STRINGS:
        assert secret not in text
    # Raised `from None`, so tracebacks never show a cryptography or PyJWT exception's text.
    assert info.value.__context__ is None or info.value.__suppress_context__
    return info.value


def test_valid_grant_round_trips() -> None:
    grant = verify_grant(VERIFIER, token(), now=NOW)
    assert grant == Grant(
        tenant=TENANT,
        session=parse_session_id(SID),
        home_shard=parse_shard("a07-s3"),
        workspace_root="/workspace/acme",
        exec_url="https://127.0.0.1:8443/exec",
        dek=DEK,
        exec_headers=(("Authorization", EXEC_SECRET),),
        expires_at=NOW + 3600,
        kid="k1",
    )
    assert verify_grant(VERIFIER, token().encode(), now=NOW) == grant


def test_secrets_are_absent_from_repr_and_str() -> None:
    grant = verify_grant(VERIFIER, token(), now=NOW)
    for text in (repr(grant), str(grant), repr(VERIFIER)):
        for secret in SECRET_STRINGS:
            assert secret not in text
    assert "acme" in repr(grant)


def test_alg_none_is_refused() -> None:
    real = token()
    none_header = b64url_encode(json.dumps({"alg": "none", "kid": "k1"}).encode())
    _header, payload, signature = real.split(".")
    refused(f"{none_header}.{payload}.", GrantMalformed)
    refused(f"{none_header}.{payload}.{signature}", GrantMalformed, "alg must be EdDSA")


@pytest.mark.parametrize("encode_key", [False, True])
def test_hs256_keyed_with_the_public_key_is_refused(encode_key: bool) -> None:
    raw = SIGNER.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    secret = b64url_encode(raw).encode() if encode_key else raw
    header = b64url_encode(json.dumps({"alg": "HS256", "kid": "k1"}).encode())
    signing_input = f"{header}.{b64url_encode(json.dumps(claims()).encode())}"
    mac = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
    refused(f"{signing_input}.{b64url_encode(mac)}", GrantMalformed, "alg must be EdDSA")


def test_unknown_and_missing_kid() -> None:
    refused(token(header={"alg": "EdDSA", "kid": "k2"}), GrantUnknownKid)
    refused(token(header={"alg": "EdDSA"}), GrantMalformed, "no kid")
    refused(token(header={"alg": "EdDSA", "kid": 1}), GrantMalformed, "no kid")


def test_header_parameters_beyond_alg_kid_typ_are_refused() -> None:
    refused(token(header={"alg": "EdDSA", "kid": "k1", "jku": "http://x"}), GrantMalformed)
    refused(token(header={"alg": "EdDSA", "kid": "k1", "typ": "at+jwt"}), GrantMalformed)


def test_bad_signatures() -> None:
    refused(token(key=Ed25519PrivateKey.generate()), GrantBadSignature)
    head, _payload, signature = token().split(".")
    _h, other_payload, _s = token(claims(ten="other")).split(".")
    refused(f"{head}.{other_payload}.{signature}", GrantBadSignature)


def test_non_canonical_signature_encoding_is_refused() -> None:
    head, payload, signature = token().split(".")
    # 64 bytes encode to 86 characters; the last one carries 4 unused bits.
    last = signature[-1]
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    twin = alphabet[alphabet.index(last) ^ 1]
    refused(f"{head}.{payload}.{signature[:-1]}{twin}", GrantMalformed)


def test_missing_exp_and_expired() -> None:
    refused(token(claims(exp=DROP)), GrantExpired, "no exp")
    refused(token(claims(exp=None)), GrantExpired, "no exp")
    refused(token(claims(exp=NOW - 6)), GrantExpired, "expired")
    # Inside the leeway it still verifies.
    assert verify_grant(VERIFIER, token(claims(exp=NOW - 4)), now=NOW).expires_at == NOW - 4


@pytest.mark.parametrize(
    "changes",
    [
        {"aud": "someone-else"},
        {"aud": ["beyond-fleet", "other"]},
        {"aud": DROP},
        {"iss": "mallory"},
        {"iss": DROP},
        {"iat": DROP},
        {"iat": NOW + 60},
        {"nbf": NOW + 60},
        {"exp": NOW + 2 * 86400},
        {"exp": "1900000000"},
        {"exp": float(NOW + 60)},
        {"iat": True},
        {"ten": "../x"},
        {"ten": ""},
        {"ten": 7},
        {"sid": "a07-s3/../x"},
        {"sid": "nodot"},
        {"sid": DROP},
        {"shard": "a07-s4"},
        {"shard": "b07-s3"},
        {"ws": "relative/path"},
        {"ws": "/work\x00space"},
        {"ws": "/" + "a" * 5000},
        {"exec": "ftp://127.0.0.1/x"},
        {"exec": "http://user:pw@127.0.0.1/x"},
        {"exec": "http:///nohost"},
        {"exec": "http://[::1/x"},
        {"exec": "http://127.0.0.1:0/x"},
    ],
)
def test_bad_claims(changes: dict[str, object]) -> None:
    refused(token(claims(**changes)), GrantBadClaims)


def test_duplicate_keys_are_refused() -> None:
    payload = json.dumps(claims())
    dup_payload = payload[:-1] + ', "ten": "other"}'
    refused(token(dup_payload), GrantMalformed, "unique keys")
    dup_header = '{"alg": "EdDSA", "kid": "k2", "kid": "k1"}'
    refused(token(header=dup_header), GrantMalformed, "unique keys")
    nested = payload[:-1] + ', "x": {"a": 1, "a": 2}}'
    refused(token(nested), GrantMalformed)


@pytest.mark.parametrize("payload", ["[1, 2]", '"text"', '{"exp": NaN}', "{"])
def test_payload_that_is_not_a_json_object(payload: str) -> None:
    refused(token(payload), GrantMalformed)


def test_oversized_token() -> None:
    big = token(claims(pad="x" * 13000))
    refused(big, GrantMalformed, "larger than")
    refused(big.encode(), GrantMalformed, "larger than")
    small = GrantVerifier({"k1": SIGNER.public_key()}, FLEET, max_bytes=100)
    with pytest.raises(GrantMalformed):
        verify_grant(small, token(), now=NOW)


@pytest.mark.parametrize("value", ["", "a.b", "a.b.c.d", "a.b.c\n", "a b.c.d", "é.b.c"])
def test_not_three_segments(value: str) -> None:
    refused(value, GrantMalformed)


def test_box_moved_from_another_grant_does_not_open() -> None:
    other_tenant = sealed(tenant="other")
    refused(token(claims(sec=other_tenant)), GrantSealError, "does not open")
    other_session = sealed(sid="a07-s3.zzz")
    refused(token(claims(sec=other_session)), GrantSealError, "does not open")


def test_box_sealed_to_another_fleet_key() -> None:
    elsewhere = sealed(recipient=X25519PrivateKey.generate().public_key())
    refused(token(claims(sec=elsewhere)), GrantSealError, "does not open")


def test_tampered_box() -> None:
    payload = claims()
    text = str(payload["sec"])
    tampered = text[:60] + ("A" if text[60] != "A" else "B") + text[61:]
    # Without a new signature the signature catches it; re-signed, the box does.
    head, _p, signature = token(payload).split(".")
    moved = b64url_encode(json.dumps(claims(sec=tampered)).encode())
    refused(f"{head}.{moved}.{signature}", GrantBadSignature)
    refused(token(claims(sec=tampered)), GrantSealError)
    refused(token(claims(sec="not base64!")), GrantSealError)
    refused(token(claims(sec=12)), GrantSealError)


@pytest.mark.parametrize(
    "plaintext",
    [
        b"not json",
        b"[]",
        secrets_json(dek=b64url_encode(DEK[:31])),
        secrets_json(dek=12),
        secrets_json(exec_headers={"X-Bad": "a\r\nInjected: 1"}),
        secrets_json(exec_headers={"Bad Name": "v"}),
        secrets_json(exec_headers={"Host": "evil"}),
        secrets_json(exec_headers={"a": "1", "A": "2"}),
        secrets_json(exec_headers=["a"]),
        secrets_json(extra="x"),
        json.dumps({"dek": b64url_encode(DEK)}).encode(),
    ],
)
def test_box_with_wrong_plaintext_shape(plaintext: bytes) -> None:
    refused(token(claims(sec=sealed(plaintext=plaintext))), GrantSealError, "sealed secrets")


def test_verifier_copies_its_key_map() -> None:
    keys = {"k1": SIGNER.public_key()}
    verifier = GrantVerifier(keys, FLEET)
    keys.clear()
    assert verify_grant(verifier, token(), now=NOW).kid == "k1"
    with pytest.raises(ValueError):
        GrantVerifier({}, FLEET)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=400), st.binary(max_size=400)))
def test_arbitrary_input_only_raises_grant_errors(value: str | bytes) -> None:
    with pytest.raises(GrantError):
        verify_grant(VERIFIER, value, now=NOW)


VALID = token()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    position=st.integers(min_value=0, max_value=len(VALID) - 1),
    replacement=st.text(
        alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.=+/ ",
        max_size=3,
    ),
)
def test_mutated_grants_verify_identically_or_raise_grant_errors(
    position: int, replacement: str
) -> None:
    mutated = VALID[:position] + replacement + VALID[position + 1 :]
    try:
        grant = verify_grant(VERIFIER, mutated, now=NOW)
    except GrantError:
        return
    assert grant == verify_grant(VERIFIER, VALID, now=NOW)


@settings(max_examples=100, deadline=None)
@given(
    payload=st.dictionaries(
        st.sampled_from(["exp", "iat", "aud", "iss", "ten", "sid", "shard", "ws", "exec", "sec"]),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(),
            st.text(max_size=20),
            st.lists(st.text(max_size=3), max_size=3),
        ),
    )
)
def test_validly_signed_junk_claims_only_raise_grant_errors(payload: dict[str, object]) -> None:
    with pytest.raises(GrantError):
        verify_grant(VERIFIER, token(payload), now=NOW)
