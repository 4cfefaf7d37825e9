"""Strict parsing of the names the contract carries: tenants, slices, shards, session ids and
replica names.

A session id is ``<shard>.<opaque>``; a shard is slice-qualified, ``<slice>-<name>`` (``a07-s3``
is shard ``s3`` of slice ``a07``). Every name is checked against an ASCII whitelist with a length
bound, so a parsed tenant, shard or session id is safe to join onto a path: no ``/``, no ``..``,
no NUL, no empty part, no look-alike non-ASCII characters.

This is the only parser of these names in the project; the edge and the replica both use it, so
they can never disagree about which slice an id belongs to. Where a session lives on a shard is
the replica's business (``replica.layout``).

Replica names are the exception to "names that become paths": the ring hashes a replica's name
as bytes, so a deployment may name replicas by address (``10.0.4.17:9000``) and the rule is only
what keeps a name one token in a log line or a ``fleet-edge ring`` output: printable ASCII
without whitespace. A name may therefore hold ``/`` or ``..``; whatever puts one in a file name
must encode it there (see ``replica.probes``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from wire.errors import InvalidName

MAX_SHARD = 64
MAX_SLICE = 32
MAX_OPAQUE = 96
MAX_TENANT = 128
MAX_REPLICA_NAME = 255
MAX_SESSION_ID = MAX_SHARD + 1 + MAX_OPAQUE

_SLICE = re.compile(r"[A-Za-z0-9_]+")
_SHARD_NAME = re.compile(r"[A-Za-z0-9_-]+")
_OPAQUE = re.compile(r"[A-Za-z0-9_-]+")
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
REPLICA_NAME_RULE = (
    f"a replica name is 1-{MAX_REPLICA_NAME} bytes of printable ASCII without whitespace "
    "(0x21-0x7e), e.g. r1 or 10.0.4.17:9000"
)


def _require_str(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise InvalidName(f"{what} must be a string")
    return value


@dataclass(frozen=True, slots=True)
class Shard:
    """A slice-qualified shard name such as ``a07-s3``."""

    slice: str
    name: str

    def __str__(self) -> str:
        return f"{self.slice}-{self.name}"


@dataclass(frozen=True, slots=True)
class SessionId:
    """A parsed session id: the shard it lives on and the opaque part minted with it."""

    shard: Shard
    opaque: str

    def __str__(self) -> str:
        return f"{self.shard}.{self.opaque}"

    @property
    def slice(self) -> str:
        return self.shard.slice


def parse_slice(value: object) -> str:
    text = _require_str(value, "slice")
    if not 0 < len(text) <= MAX_SLICE or not _SLICE.fullmatch(text):
        raise InvalidName(f"slice must be 1-{MAX_SLICE} characters of [A-Za-z0-9_]")
    return text


def parse_shard(value: object) -> Shard:
    text = _require_str(value, "shard")
    if not 0 < len(text) <= MAX_SHARD:
        raise InvalidName(f"shard must be 1-{MAX_SHARD} characters")
    slice_part, sep, name = text.partition("-")
    if not sep or not slice_part or not name:
        raise InvalidName("shard must be slice-qualified: <slice>-<name>, e.g. a07-s3")
    if len(slice_part) > MAX_SLICE or not _SLICE.fullmatch(slice_part):
        raise InvalidName(f"shard's slice must be 1-{MAX_SLICE} characters of [A-Za-z0-9_]")
    if not _SHARD_NAME.fullmatch(name):
        raise InvalidName("shard name may hold only [A-Za-z0-9_-]")
    return Shard(slice_part, name)


def parse_session_id(value: object) -> SessionId:
    text = _require_str(value, "session id")
    if not 0 < len(text) <= MAX_SESSION_ID:
        raise InvalidName(f"session id must be 1-{MAX_SESSION_ID} characters")
    shard_part, sep, opaque = text.partition(".")
    if not sep:
        raise InvalidName("session id must be <shard>.<opaque>")
    shard = parse_shard(shard_part)
    if not 0 < len(opaque) <= MAX_OPAQUE or not _OPAQUE.fullmatch(opaque):
        raise InvalidName(f"session id's opaque part must be 1-{MAX_OPAQUE} of [A-Za-z0-9_-]")
    return SessionId(shard, opaque)


def parse_tenant(value: object) -> str:
    text = _require_str(value, "tenant")
    if not 0 < len(text) <= MAX_TENANT or not _TENANT.fullmatch(text) or ".." in text:
        raise InvalidName(
            f"tenant must be 1-{MAX_TENANT} characters of [A-Za-z0-9_.-], "
            "starting with a letter or digit, without '..'"
        )
    return text


def parse_replica_name(value: object) -> str:
    """A replica's (ring) name, returned unchanged: the ring hashes exactly these bytes."""
    text = _require_str(value, "replica name")
    if not text:
        raise InvalidName(f"replica name is empty; {REPLICA_NAME_RULE}")
    # ASCII only, so characters and bytes are the same count.
    bad = next((i for i, c in enumerate(text) if not "\x21" <= c <= "\x7e"), None)
    if bad is not None:
        shown = text if len(text) <= 80 else text[:77] + "..."
        raise InvalidName(
            f"replica name {shown!a} has {text[bad]!a} at position {bad}; {REPLICA_NAME_RULE}"
        )
    if len(text) > MAX_REPLICA_NAME:
        raise InvalidName(
            f"replica name {text[:40]!a}... is {len(text)} bytes long; {REPLICA_NAME_RULE}"
        )
    return text
