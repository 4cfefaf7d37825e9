from __future__ import annotations

import hashlib
import hmac
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.errors import ReplicaError
from replica.keyfiles import b64url_decode, b64url_encode
from replica.notify import MAX_TOKEN_CHARS, NotifyClaims, NotifyKey, NotifyTokenError
from replica.tools import NotifyTarget
from wire.auth import NOTIFY_TOKEN_PREFIX as PREFIX

KEY = NotifyKey(bytes(range(32)))
OTHER = NotifyKey(bytes(range(1, 33)))
SID = "a07-s1.sess1"


def signed(payload: object, key: bytes = KEY.key) -> str:
    """A token with a genuine mac over any payload, as only a key holder could make one."""
    body = PREFIX + b64url_encode(json.dumps(payload).encode())
    mac = hmac.new(key, body.encode(), hashlib.sha256).digest()
    return body + "." + b64url_encode(mac)


def refused(token: object, match: str | None = None) -> str:
    with pytest.raises(NotifyTokenError, match=match) as info:
        KEY.verify(token)  # type: ignore[arg-type]
    return str(info.value)


def test_mint_verify_round_trip() -> None:
    token = KEY.mint("acme", SID)
    assert token.startswith(PREFIX) and token.count(".") == 2
    assert len(token) <= MAX_TOKEN_CHARS
    assert KEY.verify(token) == NotifyClaims("acme", SID)
    # Each mint carries a fresh nonce; both verify.
    again = KEY.mint("acme", SID)
    assert again != token and KEY.verify(again) == NotifyClaims("acme", SID)
    assert issubclass(NotifyTokenError, ReplicaError)


def test_forged_altered_truncated_and_wrong_key() -> None:
    token = KEY.mint("acme", SID)
    body, mac = token.rsplit(".", 1)
    refused(OTHER.mint("acme", SID), "does not verify")
    refused(signed({"t": "acme", "s": SID, "n": "x"}, key=OTHER.key), "does not verify")
    # The payload swapped for another session's: the mac no longer covers it.
    other_body = PREFIX + b64url_encode(json.dumps({"t": "evil", "s": SID, "n": "x"}).encode())
    refused(other_body + "." + mac, "does not verify")
    flipped = b64url_decode(mac)
    flipped = bytes([flipped[0] ^ 1]) + flipped[1:]
    refused(body + "." + b64url_encode(flipped), "does not verify")
    for cut in (1, 2, 5, len(mac)):
        message = refused(token[:-cut])
        assert token[:-cut] not in message
    refused(body)  # no mac at all
    refused(token + ".x", "malformed")
    refused("bjn_v2." + token[len(PREFIX) :], "malformed")
    refused(token.replace(PREFIX, PREFIX.upper()), "malformed")
    refused(token + "A" * MAX_TOKEN_CHARS, "malformed")
    refused(body + "." + mac + "=", "malformed")  # padded, not the one canonical encoding
    refused(PREFIX + "!!!." + mac, "malformed")
    for not_text in (None, 5, b"bjn_v1.a.b", ["bjn_v1.a.b"]):
        refused(not_text, "malformed")


def test_genuine_mac_over_bad_claims_is_refused() -> None:
    refused(signed(["acme", SID]), "malformed")
    refused(signed("acme"), "malformed")
    for claims in (
        {"t": "../etc", "s": SID},
        {"t": "acme", "s": "a07-s1/../x"},
        {"t": "acme", "s": "no-dot"},
        {"t": "acme"},
        {"s": SID},
        {"t": 5, "s": SID},
        {"t": "acme", "s": ["a07-s1.x"]},
    ):
        refused(signed(claims), "no valid session")
    # A token minted for names that do not parse can never be used.
    refused(KEY.mint("acme", "../../x"), "no valid session")
    refused(KEY.mint("", SID), "no valid session")


def test_token_and_key_never_shown() -> None:
    token = KEY.mint("acme", SID)
    for text in (repr(KEY), str(KEY)):
        assert KEY.key.hex() not in text and str(KEY.key) not in text
        assert b64url_encode(KEY.key) not in text
    target = NotifyTarget("http://127.0.0.1:9/notify", token)
    assert token not in repr(target) and token not in str(target)
    try:
        KEY.verify(token[:-3] + "AAA")
    except NotifyTokenError as exc:
        assert token[len(PREFIX) : len(PREFIX) + 10] not in str(exc)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=300), st.text(max_size=300).map(lambda t: PREFIX + t)))
def test_arbitrary_strings_raise_only_the_typed_error(text: str) -> None:
    with pytest.raises(NotifyTokenError):
        KEY.verify(text)


B64 = st.text(
    alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_", max_size=80
)


@settings(max_examples=300, deadline=None)
@given(B64, B64)
def test_well_shaped_forgeries_raise_only_the_typed_error(payload: str, mac: str) -> None:
    with pytest.raises(NotifyTokenError):
        KEY.verify(f"{PREFIX}{payload}.{mac}")
