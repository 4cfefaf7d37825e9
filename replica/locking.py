"""The per-session lock: an open-file-description lock held by an open descriptor.

``F_OFD_SETLK`` locks belong to the open file description, not to the process. That is what lets
one replica own thousands of sessions in one process without them interfering, and it is why we do
not use ``lockf``/``F_SETLK``: a process-wide POSIX lock is dropped the moment *any* descriptor on
the file is closed, for instance by a reader of the same directory. On NFSv4 the kernel turns the
lock into a lease-backed server lock, renewed by its state manager; nothing here heartbeats.

The lock is the availability half of ownership; the fence in the data (see ``segments``) is the
correctness half, so losing a lock (a lapsed lease) can delay a session but never corrupt it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from replica.errors import LockHeld, LockLost, StorageUnavailable

# struct flock on Linux: short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid.
# l_pid must be 0 for OFD locks. Padded to the kernel's 32-byte size.
_FLOCK = struct.Struct("@hhqqi")
_FLOCK_SIZE = 32
_CONTENDED = {errno.EAGAIN, errno.EACCES}


def _flock(kind: int) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, 0, 0, 0).ljust(_FLOCK_SIZE, b"\0")


class HeldLock(Protocol):
    def release(self) -> None: ...

    @property
    def held(self) -> bool: ...


class Locker(Protocol):
    """Takes the session lock at ``path`` or raises :class:`LockHeld` after ``wait_s``."""

    def acquire(self, path: Path, wait_s: float) -> HeldLock: ...


@dataclass(slots=True)
class OfdLock:
    """A held OFD write lock; the descriptor stays open for exactly as long as we own it."""

    fd: int
    path: Path

    @property
    def held(self) -> bool:
        return self.fd >= 0

    def release(self) -> None:
        if self.fd < 0:
            return
        fd, self.fd = self.fd, -1
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK))
        except OSError:
            pass  # closing the description below drops the lock regardless
        finally:
            os.close(fd)


@dataclass(frozen=True, slots=True)
class OfdLocker:
    """Polls ``F_OFD_SETLK`` with backoff so a wait is bounded (``F_OFD_SETLKW`` is not)."""

    poll_s: float = 0.01
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic

    def acquire(self, path: Path, wait_s: float) -> OfdLock:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise StorageUnavailable(f"cannot open session lock file: {exc.strerror}") from None
        deadline = self.clock() + max(0.0, wait_s)
        delay = self.poll_s
        try:
            while True:
                try:
                    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK))
                    return OfdLock(fd, path)
                except OSError as exc:
                    if exc.errno not in _CONTENDED:
                        raise LockLost(f"cannot take session lock: {exc.strerror}") from None
                remaining = deadline - self.clock()
                if remaining <= 0:
                    raise LockHeld("the session is open on another replica")
                self.sleep(min(delay, remaining))
                delay = min(delay * 2, 0.1)
        except BaseException:
            os.close(fd)
            raise


@dataclass(slots=True)
class _NullLock:
    held: bool = True

    def release(self) -> None:
        self.held = False


@dataclass(frozen=True, slots=True)
class NoLocking:
    """A locker that always succeeds: for tests that prove the fence holds without the lock
    (the situation after a storage lease lapses under a live but cut-off owner)."""

    def acquire(self, path: Path, wait_s: float) -> HeldLock:
        return _NullLock()


def lock_is_free(path: Path) -> bool:
    """True when no description holds a lock on ``path`` (``F_OFD_GETLK``); for probes and tests."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        out = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK))
        return bool(_FLOCK.unpack(out[: _FLOCK.size])[0] == fcntl.F_UNLCK)
    finally:
        os.close(fd)
