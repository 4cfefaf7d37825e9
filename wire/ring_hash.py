"""The ring's position function: 64-bit FNV-1a, then the splitmix64 finalizer.

It matches the reference implementation bit for bit, so every implementation of the contract
puts every session id and every replica's virtual nodes at the same points. Public vectors:
``ring_hash(b"") == 0xF52A15E9A9B5E89B``, ``ring_hash(b"a") == 0x02C0BDBF481420F8``.

The finalizer matters. FNV-1a ends on a multiply, which only carries a change in the last byte
upwards, so inputs that differ only in their last bytes (the virtual nodes ``r#0``, ``r#1``, ...
of one replica) land in a tight cluster and a ring's load split stops tracking its replica
count. How positions make a ring is the edge's (``edge.core.ring``).
"""

from __future__ import annotations

MASK64 = (1 << 64) - 1
FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3


def fnv1a64(data: bytes) -> int:
    """64-bit FNV-1a of ``data``."""
    h = FNV_OFFSET
    prime, mask = FNV_PRIME, MASK64  # locals: this loop is the whole cost of a lookup
    for byte in data:
        h = ((h ^ byte) * prime) & mask
    return h


def mix64(h: int) -> int:
    """The splitmix64 finalizer: spreads every input bit over the whole word."""
    h ^= h >> 30
    h = (h * 0xBF58476D1CE4E5B9) & MASK64
    h ^= h >> 27
    h = (h * 0x94D049BB133111EB) & MASK64
    h ^= h >> 31
    return h


def ring_hash(data: bytes) -> int:
    """The ring's position function: ``mix64(fnv1a64(data))``."""
    return mix64(fnv1a64(data))
