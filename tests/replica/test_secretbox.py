from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.errors import GrantSealError
from replica.secretbox import HEADER_LEN, OVERHEAD, VERSION, open_sealed, seal

FLEET = X25519PrivateKey.generate()
CONTEXT = b"ctx/v1\0tenant\0a07-s3.abc"


def test_round_trip_and_layout() -> None:
    box = seal(FLEET.public_key(), b"secret data", context=CONTEXT)
    assert box[0] == VERSION
    assert len(box) == OVERHEAD + len(b"secret data")
    assert b"secret data" not in box
    assert open_sealed(FLEET, box, context=CONTEXT) == b"secret data"


def test_each_seal_uses_a_fresh_ephemeral_key() -> None:
    first = seal(FLEET.public_key(), b"same", context=CONTEXT)
    second = seal(FLEET.public_key(), b"same", context=CONTEXT)
    assert first[1:HEADER_LEN] != second[1:HEADER_LEN]
    assert first[HEADER_LEN:] != second[HEADER_LEN:]


def test_other_context_does_not_open() -> None:
    box = seal(FLEET.public_key(), b"secret data", context=CONTEXT)
    with pytest.raises(GrantSealError, match="does not open"):
        open_sealed(FLEET, box, context=CONTEXT + b"x")


def test_other_fleet_key_does_not_open() -> None:
    box = seal(X25519PrivateKey.generate().public_key(), b"secret data", context=CONTEXT)
    with pytest.raises(GrantSealError, match="does not open"):
        open_sealed(FLEET, box, context=CONTEXT)


@pytest.mark.parametrize("index", [1, HEADER_LEN - 1, HEADER_LEN, -1])
def test_any_flipped_byte_is_refused(index: int) -> None:
    box = bytearray(seal(FLEET.public_key(), b"secret data", context=CONTEXT))
    box[index] ^= 0x01
    with pytest.raises(GrantSealError):
        open_sealed(FLEET, bytes(box), context=CONTEXT)


def test_bad_version_and_lengths() -> None:
    box = seal(FLEET.public_key(), b"x", context=CONTEXT)
    with pytest.raises(GrantSealError, match="version"):
        open_sealed(FLEET, bytes([VERSION + 1]) + box[1:], context=CONTEXT)
    with pytest.raises(GrantSealError, match="too short"):
        open_sealed(FLEET, box[: OVERHEAD - 1], context=CONTEXT)


def test_low_order_ephemeral_point_is_a_seal_error() -> None:
    # The all-zero point gives an all-zero shared secret, which must be refused, not used.
    box = bytes([VERSION]) + bytes(32) + bytes(20)
    with pytest.raises(GrantSealError, match="key agreement"):
        open_sealed(FLEET, box, context=CONTEXT)
    with pytest.raises(GrantSealError, match="key agreement"):
        seal(X25519PublicKey.from_public_bytes(bytes(32)), b"x", context=CONTEXT)


def test_error_messages_never_carry_the_plaintext() -> None:
    secret = b"hunter2-hunter2"
    box = seal(FLEET.public_key(), secret, context=CONTEXT)
    with pytest.raises(GrantSealError) as info:
        open_sealed(FLEET, box, context=b"other")
    assert secret.decode() not in str(info.value)
    assert info.value.__suppress_context__


@settings(max_examples=60, deadline=None)
@given(plaintext=st.binary(max_size=4096), context=st.binary(max_size=128))
def test_round_trips_arbitrary_plaintexts(plaintext: bytes, context: bytes) -> None:
    box = seal(FLEET.public_key(), plaintext, context=context)
    assert len(box) == OVERHEAD + len(plaintext)
    assert open_sealed(FLEET, box, context=context) == plaintext


@settings(max_examples=100, deadline=None)
@given(garbage=st.binary(max_size=200))
def test_arbitrary_bytes_only_ever_raise_seal_errors(garbage: bytes) -> None:
    with pytest.raises(GrantSealError):
        open_sealed(FLEET, garbage, context=CONTEXT)
