"""Sealing stored records with the tenant's key.

Every record the store writes is sealed with AES-GCM-SIV under a key derived per session from the
tenant's 32-byte data key (HKDF-SHA256, info naming tenant and session). The nonce is the record's
position, ``epoch || index``; the associated data binds tenant, session, epoch and index. So a
record copied to another session, another tenant, another segment or another position fails to
open, and a single flipped bit fails the tag.

Why GCM-SIV rather than plain GCM: the position-derived nonce is unique as long as one writer owns
an epoch, which the fence guarantees, but GCM-SIV keeps even an impossible reuse from leaking the
key stream; it costs no stored bytes, as the nonce is never written.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCMSIV
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from replica.errors import CorruptHistory

DEK_BYTES = 32
TAG_BYTES = 16
_KEY_INFO = b"beyond-fleet/session-record-key/v1\0"
_AD_LABEL = b"beyond-fleet/record/v1\0"
_POSITION = struct.Struct(">IQ")


def derive_session_key(dek: bytes, tenant: str, session_id: str) -> bytes:
    """The per-session record key; tenant and session are bound into the derivation."""
    if len(dek) != DEK_BYTES:
        raise ValueError("a tenant data key is exactly 32 bytes")
    info = _KEY_INFO + tenant.encode() + b"\0" + session_id.encode()
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(dek)


@dataclass(frozen=True, slots=True)
class RecordSealer:
    """Seals and opens the records of one session. Holds key material: never log or repr it."""

    tenant: str
    session_id: str
    _aead: AESGCMSIV = field(repr=False)
    _ad_prefix: bytes = field(repr=False)

    @classmethod
    def for_session(cls, dek: bytes, tenant: str, session_id: str) -> RecordSealer:
        key = derive_session_key(dek, tenant, session_id)
        prefix = _AD_LABEL + tenant.encode() + b"\0" + session_id.encode() + b"\0"
        return cls(tenant, session_id, AESGCMSIV(key), prefix)

    def seal(self, epoch: int, index: int, plaintext: bytes) -> bytes:
        position = _POSITION.pack(epoch, index)
        return self._aead.encrypt(position, plaintext, self._ad_prefix + position)

    def open(self, epoch: int, index: int, sealed: bytes) -> bytes:
        position = _POSITION.pack(epoch, index)
        try:
            return self._aead.decrypt(position, sealed, self._ad_prefix + position)
        except InvalidTag:
            raise CorruptHistory(
                f"segment {epoch} record {index} does not open: wrong key, "
                "moved or reordered record, or altered bytes"
            ) from None
