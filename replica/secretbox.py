"""Sealing small secrets to the fleet's X25519 key, so only replicas can read them.

The control plane puts a tenant's data key and sandbox exec headers inside every grant. A client
carries the grant but must not be able to read those secrets, so they are sealed to a key that
only replicas hold. The construction is an ECIES-style box::

    ephemeral = fresh X25519 key pair, one per seal
    shared    = X25519(ephemeral private, recipient public)
    key       = HKDF-SHA256(shared, salt = ephemeral public || recipient public, info = _INFO)
    box       = VERSION || ephemeral public (32) || ChaCha20-Poly1305(key, nonce = 0, ad = context)

The nonce can be all zero because every seal derives a new key from a new ephemeral key pair, so a
key never encrypts twice. Putting both public keys in the salt ties the key to this exact pair,
and the caller's ``context`` (associated data) ties the box to where it is used: a box opened
under any other context fails, which is what stops a box being moved from one grant into another.

Every failure is :class:`~replica.errors.GrantSealError` with a fixed message: nothing about the
key, the plaintext or the reason the tag did not match leaks out.
"""

from __future__ import annotations

from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from replica.errors import GrantSealError

VERSION: Final = 1
_INFO: Final = b"beyond-fleet secretbox v1: x25519-hkdf-sha256-chacha20poly1305"
_NONCE: Final = bytes(12)
_PUBLIC_LEN: Final = 32
_TAG_LEN: Final = 16
HEADER_LEN: Final = 1 + _PUBLIC_LEN
OVERHEAD: Final = HEADER_LEN + _TAG_LEN
# Far above anything a grant carries; keeps one seal from being asked to handle gigabytes.
MAX_PLAINTEXT: Final = 1 << 20


def _raw_public(key: X25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def _box_key(shared: bytes, ephemeral_public: bytes, recipient_public: bytes) -> ChaCha20Poly1305:
    hkdf = HKDF(
        algorithm=hashes.SHA256(),
        length=32,
        salt=ephemeral_public + recipient_public,
        info=_INFO,
    )
    return ChaCha20Poly1305(hkdf.derive(shared))


def _exchange(private: X25519PrivateKey, public: X25519PublicKey) -> bytes:
    try:
        return private.exchange(public)
    except ValueError:
        # A low-order peer point gives an all-zero secret, which cryptography refuses.
        raise GrantSealError("sealed box: key agreement failed") from None


def _check_context(context: object) -> bytes:
    if not isinstance(context, bytes):
        raise TypeError("context must be bytes")
    return context


def seal(recipient: X25519PublicKey, plaintext: bytes, *, context: bytes) -> bytes:
    """Seal ``plaintext`` so that only the holder of ``recipient``'s private key can open it."""
    context = _check_context(context)
    if not isinstance(plaintext, bytes):
        raise TypeError("plaintext must be bytes")
    if len(plaintext) > MAX_PLAINTEXT:
        raise GrantSealError(f"sealed box: plaintext larger than {MAX_PLAINTEXT} bytes")
    ephemeral = X25519PrivateKey.generate()
    ephemeral_public = _raw_public(ephemeral.public_key())
    shared = _exchange(ephemeral, recipient)
    aead = _box_key(shared, ephemeral_public, _raw_public(recipient))
    return bytes([VERSION]) + ephemeral_public + aead.encrypt(_NONCE, plaintext, context)


def open_sealed(private: X25519PrivateKey, sealed: bytes, *, context: bytes) -> bytes:
    """Open a box made by :func:`seal` for ``private``'s public key under the same ``context``."""
    context = _check_context(context)
    if not isinstance(sealed, bytes):
        raise GrantSealError("sealed box: not bytes")
    if len(sealed) < OVERHEAD:
        raise GrantSealError("sealed box: too short")
    if len(sealed) > OVERHEAD + MAX_PLAINTEXT:
        raise GrantSealError("sealed box: too long")
    if sealed[0] != VERSION:
        raise GrantSealError("sealed box: unknown version")
    ephemeral_public = sealed[1:HEADER_LEN]
    ephemeral = X25519PublicKey.from_public_bytes(ephemeral_public)
    shared = _exchange(private, ephemeral)
    aead = _box_key(shared, ephemeral_public, _raw_public(private.public_key()))
    try:
        return aead.decrypt(_NONCE, sealed[HEADER_LEN:], context)
    except InvalidTag:
        raise GrantSealError(
            "sealed box: does not open (wrong fleet key, other context, or altered)"
        ) from None
