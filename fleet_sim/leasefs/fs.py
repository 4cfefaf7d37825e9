"""The passthrough filesystem one host's daemon serves over its backing directory.

Every call first passes the host's :class:`~fleet_sim.leasefs.gate.Gate`, then runs on the
backing directory. Files are opened with ``direct_io`` so no mount caches file data: a segment
appended through one mount is read back through another exactly as written, and ``O_APPEND`` lands
at the backing file's real end (the kernel's cached size could be stale). Name and attribute
caching stay configurable because NFS clients do cache them, and code that must survive NFS has to
survive that too.

Locks are not kept in the kernel of the mount: the daemon asks for ``FUSE_CAP_POSIX_LOCKS`` and
``FUSE_CAP_FLOCK_LOCKS`` (libfuse does when ``lock`` and ``flock`` are implemented) and
implements them on the backing files through :class:`~fleet_sim.leasefs.openstate.OpenState`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mfusepy

from fleet_sim.leasefs.gate import Gate
from fleet_sim.leasefs.openstate import OpenState
from fleet_sim.leasefs.policy import Mode, OpKind, stale_verdict
from fleet_sim.leasefs.spans import LockType

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.renameat2.argtypes = [
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_uint,
]
_libc.utimensat.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int]
_libc.futimens.argtypes = [ctypes.c_int, ctypes.c_void_p]
_AT_FDCWD = -100
_AT_SYMLINK_NOFOLLOW = 0x100

# Flags the daemon must not pass to the backing open: creation is create()'s business, and
# O_DIRECT would impose the backing device's alignment on callers who never asked for it.
_OPEN_STRIP = os.O_CREAT | os.O_EXCL | os.O_NOCTTY | getattr(os, "O_DIRECT", 0)

# Polling interval for blocking lock requests (F_SETLKW, flock without LOCK_NB).
LOCK_POLL_S = 0.02


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Kernel cache lifetimes for names and attributes, in seconds (0 = always ask)."""

    entry_timeout: float = 0.0
    negative_timeout: float = 0.0
    attr_timeout: float = 0.0


_libfuse = mfusepy._libfuse
_libfuse.fuse_get_session.argtypes = [ctypes.c_void_p]
_libfuse.fuse_get_session.restype = ctypes.c_void_p
_libfuse.fuse_session_exited.argtypes = [ctypes.c_void_p]
_libfuse.fuse_session_exited.restype = ctypes.c_int


def _interrupted() -> bool:
    """Whether the current call should give up waiting.

    True when the kernel sent FUSE_INTERRUPT for it (its caller got a signal, for instance was
    killed) or when the session is shutting down: libfuse joins its workers before unmounting,
    so a worker still waiting for a mode change would keep the daemon from ever exiting.
    """
    if _libfuse.fuse_interrupted():
        return True
    session = _libfuse.fuse_get_session(_libfuse.fuse_get_context().contents.fuse)
    return bool(session) and bool(_libfuse.fuse_session_exited(session))


def _check(result: int) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _stat_dict(st: os.stat_result) -> dict[str, int]:
    return {
        "st_mode": st.st_mode,
        "st_ino": st.st_ino,
        "st_nlink": st.st_nlink,
        "st_uid": st.st_uid,
        "st_gid": st.st_gid,
        "st_size": st.st_size,
        "st_blocks": st.st_blocks,
        "st_blksize": st.st_blksize,
        "st_rdev": st.st_rdev,
        "st_atime": st.st_atime_ns,
        "st_mtime": st.st_mtime_ns,
        "st_ctime": st.st_ctime_ns,
    }


def _dirent_mode(entry: os.DirEntry[str]) -> int:
    if entry.is_symlink():
        return stat.S_IFLNK
    if entry.is_dir(follow_symlinks=False):
        return stat.S_IFDIR
    if entry.is_file(follow_symlinks=False):
        return stat.S_IFREG
    return 0


class LeaseFsOperations:
    """mfusepy operations (``raw_fi`` style: file calls get the ``fuse_file_info`` itself)."""

    use_ns = True

    def __init__(self, backing: str, gate: Gate, state: OpenState, cache: CacheConfig) -> None:
        self._backing = os.path.realpath(backing)
        self._gate = gate
        self._state = state
        self._cache = cache
        self._dirs: dict[int, tuple[int, bool]] = {}
        self._dirs_mutex = threading.Lock()
        self._next_dir = 1

    # -- plumbing ------------------------------------------------------------------------------

    def _real(self, path: str | None) -> str:
        if path is None:
            raise OSError(errno.EBADF, "leasefs: no path for a name operation")
        return os.path.join(self._backing, path.lstrip("/"))

    def _by_name(self, kind: OpKind, path: str | None) -> str:
        self._gate.enter(kind, on_handle=False, is_root=path == "/", interrupted=_interrupted)
        return self._real(path)

    def _by_handle(self, kind: OpKind, fh: int) -> int:
        self._gate.enter(kind, on_handle=True, interrupted=_interrupted)
        handle = self._state.get(fh)
        verdict = stale_verdict(kind, stale=handle.stale)
        if verdict.errno:
            raise OSError(verdict.errno, "leasefs: lease lost")
        return handle.fd

    # -- lifecycle -----------------------------------------------------------------------------

    def init_with_config(self, conn: Any, config: Any) -> None:
        if config is not None:
            config.entry_timeout = self._cache.entry_timeout
            config.negative_timeout = self._cache.negative_timeout
            config.attr_timeout = self._cache.attr_timeout
            config.use_ino = 1
            # Unlinking an open file renames it to .fuse_hidden* until its last close, as an NFS
            # client renames it to .nfs*: other mounts see that name in listings, and fstat on
            # the open file keeps working (with hard_remove libfuse answers ESTALE).
            config.hard_remove = 0
            # Calls on open files come without a path; they only use the file handle.
            config.nullpath_ok = 1
            config.direct_io = 1
        if conn is not None:
            log.info("fuse init: capable=%#x want=%#x", conn.capable, conn.want)

    def destroy(self, path: str) -> None:
        self._state.close_all()

    # -- names ---------------------------------------------------------------------------------

    def getattr(self, path: str | None, fi: Any = None) -> dict[str, int]:
        if fi is not None:
            return _stat_dict(os.fstat(self._by_handle(OpKind.META_READ, fi.fh)))
        return _stat_dict(os.lstat(self._by_name(OpKind.META_READ, path)))

    def access(self, path: str, amode: int) -> int:
        if not os.access(self._by_name(OpKind.META_READ, path), amode):
            raise OSError(errno.EACCES, "leasefs: access denied")
        return 0

    def readlink(self, path: str) -> str:
        return os.readlink(self._by_name(OpKind.META_READ, path))

    def statfs(self, path: str) -> dict[str, int]:
        sv = os.statvfs(self._by_name(OpKind.META_READ, path))
        keys = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree")
        out = {key: getattr(sv, key) for key in keys}
        out |= {"f_favail": sv.f_favail, "f_flag": sv.f_flag, "f_namemax": sv.f_namemax}
        return out

    def mknod(self, path: str, mode: int, dev: int) -> int:
        os.mknod(self._by_name(OpKind.META_WRITE, path), mode, dev)
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        os.mkdir(self._by_name(OpKind.META_WRITE, path), mode)
        return 0

    def rmdir(self, path: str) -> int:
        os.rmdir(self._by_name(OpKind.META_WRITE, path))
        return 0

    def unlink(self, path: str) -> int:
        os.unlink(self._by_name(OpKind.META_WRITE, path))
        return 0

    def symlink(self, target: str, source: str) -> int:
        os.symlink(source, self._by_name(OpKind.META_WRITE, target))
        return 0

    def link(self, target: str, source: str) -> int:
        new = self._by_name(OpKind.META_WRITE, target)
        os.link(self._real(source), new, follow_symlinks=False)
        return 0

    def rename(self, old: str, new: str, flags: int = 0) -> int:
        src = self._by_name(OpKind.META_WRITE, old)
        dst = self._real(new)
        if flags == 0:
            os.rename(src, dst)
        else:
            # RENAME_NOREPLACE and friends: an atomic "create this name only if it is free".
            _check(_libc.renameat2(_AT_FDCWD, src.encode(), _AT_FDCWD, dst.encode(), flags))
        return 0

    def chmod(self, path: str | None, mode: int, fh: int | None = None) -> int:
        if fh is not None:
            os.fchmod(self._by_handle(OpKind.META_WRITE, fh), mode)
        else:
            os.chmod(self._by_name(OpKind.META_WRITE, path), mode, follow_symlinks=False)
        return 0

    def chown(self, path: str | None, uid: int, gid: int, fh: int | None = None) -> int:
        if fh is not None:
            os.fchown(self._by_handle(OpKind.META_WRITE, fh), uid, gid)
        else:
            os.chown(self._by_name(OpKind.META_WRITE, path), uid, gid, follow_symlinks=False)
        return 0

    def truncate(self, path: str | None, length: int, fh: int | None = None) -> int:
        if fh is not None:
            os.ftruncate(self._by_handle(OpKind.DATA_WRITE, fh), length)
        else:
            os.truncate(self._by_name(OpKind.META_WRITE, path), length)
        return 0

    def utimens(self, path: str | None, times: Any, fh: int | None = None) -> int:
        # ``times`` is the kernel's timespec[2] (or NULL): pass it through untouched so
        # UTIME_NOW and UTIME_OMIT keep their meaning.
        if fh is not None:
            _check(_libc.futimens(self._by_handle(OpKind.META_WRITE, fh), times))
        else:
            real = self._by_name(OpKind.META_WRITE, path).encode()
            _check(_libc.utimensat(_AT_FDCWD, real, times, _AT_SYMLINK_NOFOLLOW))
        return 0

    # -- directories ---------------------------------------------------------------------------

    def opendir(self, path: str) -> int:
        fd = os.open(self._by_name(OpKind.META_READ, path), os.O_RDONLY | os.O_DIRECTORY)
        with self._dirs_mutex:
            dh = self._next_dir
            self._next_dir += 1
            self._dirs[dh] = (fd, path == "/")
        return dh

    def readdir(self, path: str | None, dh: int) -> list[Any]:
        with self._dirs_mutex:
            fd, is_root = self._dirs[dh]
        self._gate.enter(
            OpKind.META_READ, on_handle=False, is_root=is_root, interrupted=_interrupted
        )
        out: list[Any] = [".", ".."]
        if self._gate.mode is Mode.VANISH:
            return out  # the bare mountpoint a vanished mount leaves behind
        with os.scandir(fd) as entries:
            for e in entries:
                out.append((e.name, {"st_mode": _dirent_mode(e), "st_ino": e.inode()}, 0))
        return out

    def releasedir(self, path: str | None, dh: int) -> int:
        with self._dirs_mutex:
            fd, _ = self._dirs.pop(dh)
        os.close(fd)
        return 0

    def fsyncdir(self, path: str | None, datasync: int, dh: int) -> int:
        self._gate.enter(OpKind.SYNC, on_handle=True, interrupted=_interrupted)
        with self._dirs_mutex:
            fd, _ = self._dirs[dh]
        os.fsync(fd)
        return 0

    # -- files ---------------------------------------------------------------------------------

    def open(self, path: str | None, fi: Any) -> int:
        flags = fi.flags
        writes = (flags & os.O_ACCMODE) != os.O_RDONLY or bool(flags & os.O_TRUNC)
        real = self._by_name(OpKind.META_WRITE if writes else OpKind.META_READ, path)
        fd = os.open(real, (flags & ~_OPEN_STRIP) | os.O_CLOEXEC)
        self._attach(fi, fd)
        return 0

    def create(self, path: str | None, mode: int, fi: Any) -> int:
        real = self._by_name(OpKind.META_WRITE, path)
        # The kernel passes O_EXCL through; the backing open makes it atomic across mounts.
        flags = (fi.flags & ~(os.O_NOCTTY | getattr(os, "O_DIRECT", 0))) | os.O_CREAT
        fd = os.open(real, flags | os.O_CLOEXEC, mode)
        self._attach(fi, fd)
        return 0

    def _attach(self, fi: Any, fd: int) -> None:
        try:
            fi.fh = self._state.add(fd)
        except BaseException:
            os.close(fd)
            raise
        fi.direct_io = 1
        fi.keep_cache = 0

    def read(self, path: str | None, size: int, offset: int, fi: Any) -> bytes:
        return os.pread(self._by_handle(OpKind.DATA_READ, fi.fh), size, offset)

    def write(self, path: str | None, data: bytes, offset: int, fi: Any) -> int:
        return os.pwrite(self._by_handle(OpKind.DATA_WRITE, fi.fh), data, offset)

    def fallocate(self, path: str | None, mode: int, offset: int, size: int, fi: Any) -> int:
        fd = self._by_handle(OpKind.DATA_WRITE, fi.fh)
        if mode != 0:
            raise OSError(errno.EOPNOTSUPP, "leasefs: only plain fallocate is supported")
        os.posix_fallocate(fd, offset, size)
        return 0

    def fsync(self, path: str | None, datasync: int, fi: Any) -> int:
        fd = self._by_handle(OpKind.SYNC, fi.fh)
        if datasync:
            os.fdatasync(fd)
        else:
            os.fsync(fd)
        return 0

    def flush(self, path: str | None, fi: Any) -> int:
        # The kernel sends FLUSH on every close(), including the closes a forked child makes
        # before exec. Writes already reached the backing file, so like an NFS client closing a
        # clean file there is nothing to send: close() neither blocks on a partitioned or hung
        # mount nor fails on a revoked handle. (Unlocking a lock owner's locks does go through
        # the gate: see lock().)
        return 0

    def release(self, path: str | None, fi: Any) -> int:
        self._gate.enter(OpKind.RELEASE, on_handle=True, interrupted=_interrupted)
        self._state.release(fi.fh)
        return 0

    # -- locks ---------------------------------------------------------------------------------

    def lock(self, path: str | None, fi: Any, cmd: int, lockp: Any) -> int:
        fl = lockp.contents
        kinds = {fcntl.F_RDLCK: LockType.READ, fcntl.F_WRLCK: LockType.WRITE, fcntl.F_UNLCK: None}
        if fl.l_type not in kinds:
            raise OSError(errno.EINVAL, "leasefs: unknown lock type")
        kind = kinds[fl.l_type]
        fh, owner = fi.fh, fi.lock_owner
        if cmd == fcntl.F_GETLK:
            self._by_handle(OpKind.LOCK, fh)
            if kind is None:
                raise OSError(errno.EINVAL, "leasefs: F_GETLK with F_UNLCK")
            conflict = self._state.getlk(fh, owner, kind, fl.l_start, fl.l_len)
            if conflict is None:
                fl.l_type = fcntl.F_UNLCK
            else:
                fl.l_type = fcntl.F_RDLCK if conflict.kind is LockType.READ else fcntl.F_WRLCK
                fl.l_start, fl.l_len, fl.l_pid = conflict.start, conflict.length, 0
            return 0
        if cmd not in (fcntl.F_SETLK, fcntl.F_SETLKW):
            raise OSError(errno.EINVAL, "leasefs: unknown lock command")
        if kind is None and not self._state.holds(fh, owner):
            # The unlock libfuse sends after every flush: an owner that holds nothing has
            # nothing to tell the server, so it must not wait on the gate.
            return 0
        self._wait_for_lock(
            lambda: self._state.setlk(fh, owner, kind, fl.l_start, fl.l_len),
            fh,
            cmd == fcntl.F_SETLKW,
        )
        return 0

    def flock(self, path: str | None, fi: Any, operation: int) -> int:
        fh = fi.fh
        self._wait_for_lock(
            lambda: self._state.flock(fh, operation),
            fh,
            not operation & (fcntl.LOCK_NB | fcntl.LOCK_UN),
        )
        return 0

    def _wait_for_lock(self, attempt: Callable[[], None], fh: int, wait: bool) -> None:
        # The backing lock is only ever tried without blocking, so a waiter holds no mutex and no
        # backing call; it polls, passing the gate each time (a partition blocks it there).
        while True:
            self._by_handle(OpKind.LOCK, fh)
            try:
                attempt()
                return
            except OSError as exc:
                if not wait or exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                    raise
            if _interrupted():
                raise OSError(errno.EINTR, "leasefs: lock wait interrupted")
            self._gate.pause(LOCK_POLL_S)


class LeaseFuse(mfusepy.FUSE):  # type: ignore[misc]
    """mfusepy's FUSE, passing the file handle where mfusepy would drop it.

    With ``nullpath_ok`` the kernel-side path of a call on an open file is NULL; mfusepy's
    truncate, chmod, chown and utimens wrappers then lose the file handle, its flock wrapper
    cannot take a NULL path, and its rename wrapper drops the RENAME_* flags.
    """

    def _decode(self, path: bytes | None) -> str | None:
        return None if path is None else path.decode(self.encoding, self.errors)

    @staticmethod
    def _fh(fip: Any) -> int | None:
        return int(fip.contents.fh) if fip else None

    def truncate_fuse_3(self, path: bytes | None, length: int, fip: Any) -> int:
        return int(self.operations.truncate(self._decode(path), length, self._fh(fip)))

    def chmod_fuse_3(self, path: bytes | None, mode: int, fip: Any) -> int:
        return int(self.operations.chmod(self._decode(path), mode, self._fh(fip)))

    def chown_fuse_3(self, path: bytes | None, uid: int, gid: int, fip: Any) -> int:
        # -1 ("leave unchanged") arrives as an unsigned all-ones value.
        uid = -1 if uid == 0xFFFFFFFF else uid
        gid = -1 if gid == 0xFFFFFFFF else gid
        return int(self.operations.chown(self._decode(path), uid, gid, self._fh(fip)))

    def utimens_fuse_3(self, path: bytes | None, buf: Any, fip: Any) -> int:
        times = ctypes.cast(buf, ctypes.c_void_p) if buf else None
        return int(self.operations.utimens(self._decode(path), times, self._fh(fip)))

    def rename_fuse_3(self, old: bytes, new: bytes, flags: int) -> int:
        return int(self.operations.rename(self._decode(old), self._decode(new), flags))

    def flock(self, path: bytes | None, fip: Any, op: int) -> int:
        return int(self.operations.flock(self._decode(path), fip.contents, op))
