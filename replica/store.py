"""Owning a session on shared storage: lock, replay, open a new epoch, commit fenced batches.

Opening a session takes its lock (availability), replays every segment, then creates the next
epoch's segment with ``O_EXCL`` whose header seals the previous segment at the end of what was
replayed (correctness). A commit appends one sealed batch, fsyncs it, and only then checks that
no successor segment exists: if one does, the batch is not acknowledged and the owner is fenced
for good. Everything here is blocking file I/O; the service runs it off the event loop.

On NFS the successor check is a lookup, so mounts must not cache negative lookups for long
(``lookupcache=positive`` or ``none``); see FLEET.md.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from replica.errors import CorruptHistory, LockLost, StorageUnavailable
from replica.history import History, read_history
from replica.layout import session_dir
from replica.locking import HeldLock, Locker, OfdLocker
from replica.sealing import RecordSealer
from replica.segments import (
    KIND_BATCH,
    KIND_RESET,
    MAX_EPOCH,
    PREFIX,
    SegmentHeader,
    encode_record,
    encode_segment_start,
    parse_segment,
    segment_name,
)
from replica.transcript import Message, Transcript
from wire.names import SessionId

LOCK_FILE = "lock"
_CREATE_ATTEMPTS = 8


@dataclass(frozen=True, slots=True)
class Committed:
    """The batch is durable and no successor existed after it was written: acknowledge it."""

    epoch: int
    leaf_id: str | None
    end: int


@dataclass(frozen=True, slots=True)
class Superseded:
    """A successor epoch exists. ``batch_included`` says whether the successor's seal covers the
    batch just written (True), excludes it (False) or cannot be read yet (None); either way the
    batch was not acknowledged as committed by this owner, and this owner never writes again."""

    epoch: int
    successor: int
    batch_included: bool | None


CommitOutcome = Committed | Superseded


@dataclass(frozen=True, slots=True)
class StoreConfig:
    owner: str = "replica"
    lock_wait_s: float = 0.25


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


@dataclass(slots=True)
class OwnedSession:
    """A session this process owns: the only writer of ``epoch``."""

    tenant: str
    session: SessionId
    directory: Path
    epoch: int
    transcript: Transcript
    history: History
    _sealer: RecordSealer = field(repr=False)
    _lock: HeldLock = field(repr=False)
    _fd: int = field(repr=False)
    _size: int = field(repr=False)
    _next_index: int = field(default=1, repr=False)
    _superseded: Superseded | None = field(default=None, repr=False)
    _broken: str | None = field(default=None, repr=False)
    _released: bool = field(default=False, repr=False)
    _mutex: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def fenced(self) -> bool:
        return self._superseded is not None

    @property
    def open(self) -> bool:
        return not self._released

    @property
    def parked(self) -> bool:
        return self._fd < 0 and not self._released

    def park(self) -> None:
        """Close the segment's descriptor while the session is idle; the lock's stays open.
        The next commit reopens it, so an idle live session costs one descriptor, not two."""
        with self._mutex:
            if self._fd >= 0 and not self._released:
                fd, self._fd = self._fd, -1
                os.close(fd)

    def commit(self, messages: Sequence[Message]) -> CommitOutcome:
        """Append one turn's messages, chained onto the current leaf."""
        with self._mutex:
            chained = self.transcript.chain(messages)
            payload = {"k": KIND_BATCH, "m": [m.to_wire() for m in chained]}
            outcome = self._append(payload)
            if isinstance(outcome, Committed):
                self.transcript.apply_batch(chained)
                outcome = Committed(outcome.epoch, self.transcript.leaf_id, outcome.end)
            return outcome

    def reset(self, archived_to: str | None, closed_jobs: Sequence[str] = ()) -> CommitOutcome:
        """Start a new conversation under the same id (the old one was archived elsewhere);
        ``closed_jobs`` ended with the old conversation and are never told to the new one."""
        with self._mutex:
            payload = {
                "k": KIND_RESET,
                "to": archived_to,
                "ts": time.time(),
                "jobs": list(closed_jobs),
            }
            outcome = self._append(payload)
            if isinstance(outcome, Committed):
                self.transcript.reset(closed_jobs)
            return outcome

    def _append(self, payload: Mapping[str, object]) -> CommitOutcome:
        if self._superseded is not None:
            return self._superseded
        if self._broken is not None or self._released:
            raise LockLost(self._broken or "the session was released")
        if self._fd < 0:
            path = self.directory / segment_name(self.epoch)
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            except OSError as exc:
                self._broken = f"the session's segment cannot be reopened: {exc.strerror}"
                raise LockLost(self._broken) from None
        record = encode_record(self._sealer, self.epoch, self._next_index, payload)
        # Spent once sealed, even if the write fails: a position is never sealed twice.
        self._next_index += 1
        try:
            _write_all(self._fd, record, self._size)
            os.fsync(self._fd)
        except OSError as exc:
            # After a lapsed lease the old descriptor fails (EIO): we may no longer be the owner.
            self._broken = f"the session's storage failed: {exc.strerror}"
            raise LockLost(self._broken) from None
        self._size += len(record)
        successor = self._successor()
        if successor is not None:
            self._superseded = successor
            return successor
        return Committed(self.epoch, self.transcript.leaf_id, self._size)

    def _successor(self) -> Superseded | None:
        successor = self.epoch + 1
        path = self.directory / segment_name(successor)
        try:
            with open(path, "rb") as handle:
                head = handle.read(PREFIX.size + 4096)
        except FileNotFoundError:
            return None
        except OSError:
            return Superseded(self.epoch, successor, None)
        try:
            header = parse_segment(head, successor, self._sealer, header_only=True).header
        except CorruptHistory:
            header = None
        if header is None or header.seal is None:
            return Superseded(self.epoch, successor, None)
        return Superseded(self.epoch, successor, header.seal >= self._size)

    def release(self) -> None:
        """Close the segment and drop the lock; safe to call more than once."""
        with self._mutex:
            self._released = True
            fd, self._fd = self._fd, -1
            try:
                if fd >= 0:
                    os.close(fd)  # may report a failed flush (EIO); the descriptor is gone anyway
            finally:
                # Whatever the segment's close said, the lock goes: a lock kept past its
                # session's close is a session nobody can open until this process dies.
                self._lock.release()


@dataclass(frozen=True, slots=True)
class SessionStore:
    """Sessions of one shard mounted at ``root``."""

    root: Path
    config: StoreConfig = StoreConfig()
    locker: Locker = field(default_factory=OfdLocker)

    def directory(self, tenant: str, session: SessionId) -> Path:
        return session_dir(self.root, tenant, session)

    def read(self, tenant: str, session: SessionId, dek: bytes) -> History:
        """A read-only replay with no lock: what is committed now, as any reader sees it."""
        sealer = RecordSealer.for_session(dek, tenant, str(session))
        return read_history(self.directory(tenant, session), sealer)

    def open(self, tenant: str, session: SessionId, dek: bytes) -> OwnedSession:
        directory = self.directory(tenant, session)
        if not self.root.is_dir():
            raise StorageUnavailable("the shard root is not mounted")
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageUnavailable(f"cannot create session directory: {exc.strerror}") from None
        lock = self.locker.acquire(directory / LOCK_FILE, self.config.lock_wait_s)
        try:
            return self._open_locked(tenant, session, dek, directory, lock)
        except BaseException:
            lock.release()
            raise

    def _open_locked(
        self, tenant: str, session: SessionId, dek: bytes, directory: Path, lock: HeldLock
    ) -> OwnedSession:
        sealer = RecordSealer.for_session(dek, tenant, str(session))
        for _ in range(_CREATE_ATTEMPTS):
            history = read_history(directory, sealer)
            epoch = history.last_epoch + 1
            if epoch > MAX_EPOCH:
                raise CorruptHistory("the session has run out of epochs")
            previous = history.open_segment
            header = SegmentHeader(
                epoch=epoch,
                prev_epoch=previous.epoch if previous else None,
                seal=previous.valid_end if previous else None,
                owner=self.config.owner,
                ts=time.time(),
            )
            start = encode_segment_start(sealer, header)
            path = directory / segment_name(epoch)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                continue  # another owner claimed this epoch first: replay again and go past it
            except OSError as exc:
                raise StorageUnavailable(f"cannot create segment: {exc.strerror}") from None
            try:
                _write_all(fd, start, 0)
                os.fsync(fd)
                _fsync_dir(directory)
            except OSError as exc:
                os.close(fd)
                raise StorageUnavailable(f"cannot write segment header: {exc.strerror}") from None
            return OwnedSession(
                tenant=tenant,
                session=session,
                directory=directory,
                epoch=epoch,
                transcript=history.transcript,
                history=history,
                _sealer=sealer,
                _lock=lock,
                _fd=fd,
                _size=len(start),
            )
        raise StorageUnavailable("could not claim a new epoch: too many concurrent owners")
