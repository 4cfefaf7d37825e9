from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replica.errors import CorruptHistory
from replica.sealing import RecordSealer, derive_session_key

DEK = bytes(range(32))


def test_round_trip_and_no_plaintext() -> None:
    sealer = RecordSealer.for_session(DEK, "acme", "a07-s3.x")
    sealed = sealer.seal(3, 7, b"secret message text")
    assert b"secret" not in sealed
    assert sealer.open(3, 7, sealed) == b"secret message text"


@pytest.mark.parametrize(
    ("tenant", "session", "epoch", "index"),
    [
        ("acme", "a07-s3.x", 3, 8),
        ("acme", "a07-s3.x", 4, 7),
        ("acme", "a07-s3.y", 3, 7),
        ("other", "a07-s3.x", 3, 7),
    ],
)
def test_moved_record_does_not_open(tenant: str, session: str, epoch: int, index: int) -> None:
    sealed = RecordSealer.for_session(DEK, "acme", "a07-s3.x").seal(3, 7, b"payload")
    with pytest.raises(CorruptHistory):
        RecordSealer.for_session(DEK, tenant, session).open(epoch, index, sealed)


def test_wrong_key_does_not_open() -> None:
    sealed = RecordSealer.for_session(DEK, "acme", "a07-s3.x").seal(1, 1, b"payload")
    with pytest.raises(CorruptHistory):
        RecordSealer.for_session(os.urandom(32), "acme", "a07-s3.x").open(1, 1, sealed)


@given(st.binary(max_size=200), st.data())
def test_any_flipped_bit_is_caught(plain: bytes, data: st.DataObject) -> None:
    sealer = RecordSealer.for_session(DEK, "acme", "a07-s3.x")
    sealed = bytearray(sealer.seal(1, 1, plain))
    bit = data.draw(st.integers(0, len(sealed) * 8 - 1))
    sealed[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CorruptHistory):
        sealer.open(1, 1, bytes(sealed))


def test_keys_differ_per_session_and_tenant() -> None:
    keys = {derive_session_key(DEK, t, s) for t in ("a", "b") for s in ("x.1", "x.2")}
    assert len(keys) == 4
    with pytest.raises(ValueError, match="32 bytes"):
        derive_session_key(b"short", "a", "x.1")


def test_repr_holds_no_key() -> None:
    sealer = RecordSealer.for_session(DEK, "acme", "a07-s3.x")
    key = derive_session_key(DEK, "acme", "a07-s3.x")
    assert key.hex() not in repr(sealer) and "AESGCMSIV" not in repr(sealer)
