"""What one host's mount does with a filesystem call, given the host's mode.

Pure decisions only: the gate (``gate.py``) applies them with real waiting and real clocks.

The modes mirror what an NFSv4 client on a ``hard`` mount experiences:

- ``ok``: calls reach the server.
- ``partition``: the client cannot reach the server, so every call waits; once the partition has
  outlived the lease, the server forgets this client's locks and its open state, and after healing
  the old descriptors fail with EIO.
- ``hang``: the server stopped answering; calls wait until the mode returns to ``ok``; the lease
  is not revoked (nobody else is served either in the real failure, and the simulator wants a
  mount that is merely stuck).
- ``readonly``: the export went read-only; changes fail with EROFS.
- ``vanish``: the mount went away; names resolve to nothing (ENOENT) and open descriptors fail
  with EIO.
"""

from __future__ import annotations

import enum
import errno
from dataclasses import dataclass


class Mode(enum.StrEnum):
    OK = "ok"
    PARTITION = "partition"
    HANG = "hang"
    READONLY = "readonly"
    VANISH = "vanish"


class OpKind(enum.Enum):
    """The classes of filesystem call that modes treat differently."""

    META_READ = "meta_read"  # getattr, readdir, lookup, open for reading, statfs
    META_WRITE = "meta_write"  # create, mkdir, unlink, rename, link, chmod, open for writing
    DATA_READ = "data_read"  # read on an open descriptor
    DATA_WRITE = "data_write"  # write, ftruncate on an open descriptor
    SYNC = "sync"  # fsync
    LOCK = "lock"  # fcntl and flock locks
    RELEASE = "release"  # the last close of an open file description


class Action(enum.Enum):
    PROCEED = "proceed"
    WAIT = "wait"
    FAIL = "fail"


@dataclass(frozen=True, slots=True)
class Verdict:
    action: Action
    errno: int = 0


PROCEED = Verdict(Action.PROCEED)
WAIT = Verdict(Action.WAIT)

# Kinds that use server-side open or lock state: after the lease is lost they fail with EIO.
_STATEFUL = frozenset({OpKind.DATA_READ, OpKind.DATA_WRITE, OpKind.SYNC, OpKind.LOCK})
_CHANGES = frozenset({OpKind.META_WRITE, OpKind.DATA_WRITE})


def admit(mode: Mode, kind: OpKind, *, on_handle: bool, is_root: bool = False) -> Verdict:
    """Decide whether a call proceeds, waits for a mode change, or fails with an errno.

    ``on_handle`` says the call works on an open descriptor rather than a name; ``is_root`` says
    it reads the mount's root directory, which survives ``vanish`` as an empty directory (the
    mountpoint a vanished mount leaves behind).
    """
    if mode in (Mode.PARTITION, Mode.HANG):
        return WAIT
    if kind is OpKind.RELEASE:
        return PROCEED
    if mode is Mode.VANISH:
        if on_handle:
            return Verdict(Action.FAIL, errno.EIO)
        if is_root and kind is OpKind.META_READ:
            return PROCEED
        return Verdict(Action.FAIL, errno.ENOENT)
    if mode is Mode.READONLY and kind in _CHANGES:
        return Verdict(Action.FAIL, errno.EROFS)
    return PROCEED


def stale_verdict(kind: OpKind, *, stale: bool) -> Verdict:
    """A descriptor opened before its host's lease was revoked fails every stateful call."""
    if stale and kind in _STATEFUL:
        return Verdict(Action.FAIL, errno.EIO)
    return PROCEED


def revocation_due(
    mode: Mode, partitioned_since: float | None, now: float, lease_s: float, revoked: bool
) -> bool:
    """True once a partition has outlived the lease and its revocation has not happened yet."""
    if mode is not Mode.PARTITION or partitioned_since is None or revoked:
        return False
    return now - partitioned_since >= lease_s
