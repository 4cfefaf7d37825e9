"""A mount's open state: its open files and the locks taken through them.

This is what an NFSv4 server keeps per client (open and lock stateids) and drops when the client's
lease expires. Locks are real kernel locks on the backing files, so they conflict across every
mount of the same backing directory exactly as on a shared server:

- a byte-range lock owner (the ``lock_owner`` the kernel sends with FUSE_SETLK) gets its own
  backing open file description, reopened from the handle's descriptor, and takes
  ``F_OFD_SETLK`` locks on it; owners therefore conflict with each other even inside one daemon;
- a ``flock`` lock gets its own backing open file description per open file and uses ``flock``;
- revocation closes all of them (releasing the locks on the backing files) and marks every open
  handle stale, so its later data calls fail with EIO.

Owners are keyed by (handle, owner) rather than by owner alone. For OFD locks the kernel derives
the owner from the address of the open file, which is reused as soon as the file is freed; the
release of the old file reaches the daemon asynchronously, possibly after the new file's first
lock, so keying by owner alone could hand the new file a lock that the old file's release then
drops. The cost: a process taking overlapping classic POSIX locks through two descriptors of one
file conflicts with itself here, where a local filesystem would merge them.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
from dataclasses import dataclass, field

from fleet_sim.leasefs.spans import LockType, Span, apply, span_end

# struct flock on Linux (x86_64 and aarch64): type, whence, start, len, pid, padding.
_FLOCK = struct.Struct("@hhqqi4x")


@dataclass(slots=True)
class Handle:
    """One FUSE open file: its backing descriptor and whether its lease state is gone."""

    fd: int
    ident: tuple[int, int]  # (st_dev, st_ino) of the backing file
    stale: bool = False
    owners: set[int] = field(default_factory=set)


@dataclass(slots=True)
class _Holder:
    fd: int
    spans: tuple[Span, ...] = ()


@dataclass(frozen=True, slots=True)
class Conflict:
    """What F_GETLK reports: the type and range of one conflicting lock."""

    kind: LockType
    start: int
    length: int


@dataclass(frozen=True, slots=True)
class StateCounts:
    handles: int
    stale_handles: int
    held_locks: int
    revoked_locks: int


def _reopen(fd: int) -> int:
    """A new open file description on the same backing inode (works for unlinked files too)."""
    path = f"/proc/self/fd/{fd}"
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EISDIR, errno.EROFS, errno.EPERM):
            raise
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def _type_code(kind: LockType | None) -> int:
    if kind is None:
        return fcntl.F_UNLCK
    return fcntl.F_RDLCK if kind is LockType.READ else fcntl.F_WRLCK


class OpenState:
    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._handles: dict[int, Handle] = {}
        self._next_fh = 1
        self._posix: dict[tuple[int, int], _Holder] = {}
        self._flock: dict[int, int] = {}
        self._revoked_locks = 0

    # -- handles -------------------------------------------------------------------------------

    def add(self, fd: int) -> int:
        st = os.fstat(fd)
        with self._mutex:
            fh = self._next_fh
            self._next_fh += 1
            self._handles[fh] = Handle(fd, (st.st_dev, st.st_ino))
            return fh

    def get(self, fh: int) -> Handle:
        with self._mutex:
            handle = self._handles.get(fh)
        if handle is None:
            raise OSError(errno.EBADF, "leasefs: unknown file handle")
        return handle

    def release(self, fh: int) -> None:
        """Drop a handle: close its backing descriptor and every lock taken through it."""
        with self._mutex:
            handle = self._handles.pop(fh, None)
            if handle is None:
                return
            for owner in handle.owners:
                holder = self._posix.pop((fh, owner), None)
                if holder is not None:
                    os.close(holder.fd)
            flock_fd = self._flock.pop(fh, None)
            if flock_fd is not None:
                os.close(flock_fd)
        os.close(handle.fd)

    def counts(self) -> StateCounts:
        with self._mutex:
            return StateCounts(
                handles=len(self._handles),
                stale_handles=sum(1 for h in self._handles.values() if h.stale),
                held_locks=len(self._posix) + len(self._flock),
                revoked_locks=self._revoked_locks,
            )

    def revoke(self) -> int:
        """Release every lock on the backing files and mark every open handle stale."""
        with self._mutex:
            fds = [h.fd for h in self._posix.values()] + list(self._flock.values())
            self._posix.clear()
            self._flock.clear()
            for handle in self._handles.values():
                handle.stale = True
                handle.owners.clear()
            self._revoked_locks += len(fds)
        for fd in fds:
            os.close(fd)
        return len(fds)

    def close_all(self) -> None:
        with self._mutex:
            fhs = list(self._handles)
        for fh in fhs:
            self.release(fh)

    # -- byte-range (POSIX and OFD) locks ------------------------------------------------------

    def setlk(self, fh: int, owner: int, kind: LockType | None, start: int, length: int) -> None:
        """Take or release ``[start, start+length)`` for ``owner``; EAGAIN when another holds it.

        An unlock applies to everything the owner holds on the file through any handle, which is
        the POSIX rule (and how the unlock the kernel sends when a descriptor is closed works).
        """
        end = span_end(start, length)
        request = _FLOCK.pack(_type_code(kind), os.SEEK_SET, start, length, 0)
        with self._mutex:
            handle = self._live(fh)
            if kind is None:
                for key in [k for k in self._posix if k[1] == owner]:
                    other = self._handles[key[0]]
                    if other.ident == handle.ident:
                        self._set(key, other, request, start, end, None)
                return
            key = (fh, owner)
            if key not in self._posix:
                self._posix[key] = _Holder(_reopen(handle.fd))
                handle.owners.add(owner)
            self._set(key, handle, request, start, end, kind)

    def holds(self, fh: int, owner: int) -> bool:
        """Whether ``owner`` holds any byte-range lock on the file behind ``fh``."""
        with self._mutex:
            handle = self._handles.get(fh)
            if handle is None:
                return False
            return any(
                key[1] == owner and self._handles[key[0]].ident == handle.ident
                for key in self._posix
            )

    def _set(
        self,
        key: tuple[int, int],
        handle: Handle,
        request: bytes,
        start: int,
        end: int | None,
        kind: LockType | None,
    ) -> None:
        holder = self._posix[key]
        try:
            fcntl.fcntl(holder.fd, fcntl.F_OFD_SETLK, request)
        except OSError as exc:
            if not holder.spans:
                self._drop(key, handle)
            if exc.errno == errno.EACCES:
                raise OSError(errno.EAGAIN, "leasefs: lock held elsewhere") from exc
            raise
        holder.spans = apply(holder.spans, start, end, kind)
        if not holder.spans:
            self._drop(key, handle)

    def _live(self, fh: int) -> Handle:
        handle = self._handles.get(fh)
        if handle is None:
            raise OSError(errno.EBADF, "leasefs: unknown file handle")
        if handle.stale:
            raise OSError(errno.EIO, "leasefs: lease lost")
        return handle

    def getlk(
        self, fh: int, owner: int, kind: LockType, start: int, length: int
    ) -> Conflict | None:
        request = _FLOCK.pack(_type_code(kind), os.SEEK_SET, start, length, 0)
        with self._mutex:
            handle = self._live(fh)
            holder = self._posix.get((fh, owner))
            # Probe from the owner's own description so its own locks do not count as conflicts.
            probe = holder.fd if holder is not None else _reopen(handle.fd)
            try:
                answer = fcntl.fcntl(probe, fcntl.F_OFD_GETLK, request)
            finally:
                if holder is None:
                    os.close(probe)
        l_type, _whence, l_start, l_len, _pid = _FLOCK.unpack(answer)
        if l_type == fcntl.F_UNLCK:
            return None
        found = LockType.READ if l_type == fcntl.F_RDLCK else LockType.WRITE
        return Conflict(found, l_start, l_len)

    def _drop(self, key: tuple[int, int], handle: Handle) -> None:
        holder = self._posix.pop(key)
        handle.owners.discard(key[1])
        os.close(holder.fd)

    # -- flock locks ---------------------------------------------------------------------------

    def flock(self, fh: int, operation: int) -> None:
        with self._mutex:
            handle = self._live(fh)
            fd = self._flock.get(fh)
            if operation & fcntl.LOCK_UN:
                if fd is not None:
                    del self._flock[fh]
                    os.close(fd)
                return
            created = fd is None
            if fd is None:
                fd = _reopen(handle.fd)
            try:
                # Never block with the mutex held: waiting callers poll (see fs.py).
                fcntl.flock(fd, operation | fcntl.LOCK_NB)
            except OSError:
                if created:
                    os.close(fd)
                raise
            self._flock[fh] = fd
