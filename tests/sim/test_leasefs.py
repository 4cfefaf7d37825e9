"""leasefs: pure policy and bookkeeping, then real mounts of one backing directory.

The ``fuse`` tests mount for real and must fail (never skip) where /dev/fuse or fusermount3 is
missing: CI installs both.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fleet_sim.leasefs import (
    FuseUnavailable,
    LeaseFsMount,
    Mode,
    check_fuse_available,
    mount_leasefs,
)
from fleet_sim.leasefs.control import LeaseFsStatus, handle_request
from fleet_sim.leasefs.gate import Gate
from fleet_sim.leasefs.mount import mounted_fstype
from fleet_sim.leasefs.policy import Action, OpKind, admit, revocation_due, stale_verdict
from fleet_sim.leasefs.spans import LockType, Span, apply, span_end
from tests.harness import eventually

LEASE_S = 1.0
_FLOCK = struct.Struct("@hhqqi4x")


# -- pure decisions -----------------------------------------------------------------------------


def test_partition_and_hang_make_every_call_wait() -> None:
    for mode in (Mode.PARTITION, Mode.HANG):
        for kind in OpKind:
            assert admit(mode, kind, on_handle=True).action is Action.WAIT
            assert admit(mode, kind, on_handle=False).action is Action.WAIT


def test_readonly_refuses_only_changes() -> None:
    assert admit(Mode.READONLY, OpKind.META_WRITE, on_handle=False).errno == errno.EROFS
    assert admit(Mode.READONLY, OpKind.DATA_WRITE, on_handle=True).errno == errno.EROFS
    for kind in (OpKind.META_READ, OpKind.DATA_READ, OpKind.SYNC, OpKind.LOCK):
        assert admit(Mode.READONLY, kind, on_handle=True).action is Action.PROCEED


def test_vanish_hides_names_and_breaks_handles_but_keeps_the_mountpoint() -> None:
    assert admit(Mode.VANISH, OpKind.META_READ, on_handle=False).errno == errno.ENOENT
    assert admit(Mode.VANISH, OpKind.META_WRITE, on_handle=False).errno == errno.ENOENT
    assert admit(Mode.VANISH, OpKind.DATA_READ, on_handle=True).errno == errno.EIO
    root = admit(Mode.VANISH, OpKind.META_READ, on_handle=False, is_root=True)
    assert root.action is Action.PROCEED
    assert admit(Mode.VANISH, OpKind.RELEASE, on_handle=True).action is Action.PROCEED


def test_stale_handles_fail_stateful_calls_only() -> None:
    for kind in (OpKind.DATA_READ, OpKind.DATA_WRITE, OpKind.SYNC, OpKind.LOCK):
        assert stale_verdict(kind, stale=True).errno == errno.EIO
        assert stale_verdict(kind, stale=False).action is Action.PROCEED
    assert stale_verdict(OpKind.META_READ, stale=True).action is Action.PROCEED


def test_revocation_is_due_once_the_partition_outlives_the_lease() -> None:
    assert not revocation_due(Mode.PARTITION, 100.0, 100.9, 1.0, revoked=False)
    assert revocation_due(Mode.PARTITION, 100.0, 101.0, 1.0, revoked=False)
    assert not revocation_due(Mode.PARTITION, 100.0, 105.0, 1.0, revoked=True)
    assert not revocation_due(Mode.HANG, 100.0, 105.0, 1.0, revoked=False)


def test_spans_follow_posix_replacement_rules() -> None:
    held = apply((), 0, span_end(0, 0), LockType.WRITE)
    assert held == (Span(0, None, LockType.WRITE),)
    held = apply(held, 10, span_end(10, 5), None)
    assert held == (Span(0, 10, LockType.WRITE), Span(15, None, LockType.WRITE))
    held = apply(held, 12, 20, LockType.READ)
    assert held == (
        Span(0, 10, LockType.WRITE),
        Span(12, 20, LockType.READ),
        Span(20, None, LockType.WRITE),
    )
    assert apply(held, 0, None, None) == ()
    with pytest.raises(ValueError):
        apply((), 5, 5, LockType.READ)


def test_control_requests() -> None:
    modes: list[Mode] = []
    status = LeaseFsStatus("h", Mode.OK, 0, 0, 0, 0, 0, 0)
    assert handle_request(b'{"op": "heal"}', modes.append, lambda: status)["ok"] is True
    assert handle_request(b'{"op": "vanish"}', modes.append, lambda: status)["ok"] is True
    assert modes == [Mode.OK, Mode.VANISH]
    assert handle_request(b'{"op": "explode"}', modes.append, lambda: status)["ok"] is False
    assert handle_request(b"not json", modes.append, lambda: status)["ok"] is False
    assert modes == [Mode.OK, Mode.VANISH]


def test_gate_revokes_once_per_partition_and_wakes_waiters() -> None:
    now = [0.0]
    reads = [0]  # of the clock: after set_mode, only the lease watcher reads it

    def clock() -> float:
        reads[0] += 1
        return now[0]

    def watcher_looked_twice() -> None:
        """Wait until the watcher has read the clock twice from now, so one whole look at the
        time as it is now (and any revocation it led to) is over."""
        seen = reads[0]
        eventually(
            lambda: reads[0] >= seen + 2,
            timeout=5.0,
            interval=0.01,
            message="the lease watcher did not look at the clock",
        )

    revoked: list[float] = []
    gate = Gate(LEASE_S, lambda: revoked.append(now[0]), clock=clock)
    try:
        gate.set_mode(Mode.PARTITION)
        outcome: list[str] = []

        def wait_for_gate() -> None:
            gate.enter(OpKind.DATA_READ, on_handle=True)
            outcome.append("in")

        waiter = threading.Thread(target=wait_for_gate)
        waiter.start()
        now[0] = 0.5
        eventually(
            lambda: gate.snapshot().blocked == 1,
            timeout=5.0,
            interval=0.01,
            message="the call never blocked at the gate",
        )
        watcher_looked_twice()
        assert revoked == [] and outcome == [] and gate.snapshot().blocked == 1
        now[0] = 1.5
        eventually(lambda: revoked == [1.5], timeout=5.0, interval=0.01)
        watcher_looked_twice()
        assert revoked == [1.5]
        gate.set_mode(Mode.OK)
        waiter.join(timeout=2)
        assert outcome == ["in"] and gate.snapshot().revocations == 1
    finally:
        gate.close()


def test_missing_fusermount_is_an_error_not_a_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(FuseUnavailable):
        check_fuse_available()


# -- helpers for real mounts --------------------------------------------------------------------


def _ofd(fd: int, kind: int = fcntl.F_WRLCK) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, 0, 0, 0))


def _ofd_busy(fd: int) -> bool:
    """Try an exclusive OFD lock; True when someone else holds it."""
    try:
        _ofd(fd)
    except BlockingIOError:
        return True
    return False


def _errno_of(call: Callable[[], object]) -> int | None:
    """The errno the call failed with, or None when it succeeded."""
    try:
        call()
    except OSError as exc:
        return exc.errno
    return None


class _Background:
    """Run a call in a thread; remember its result or its errno."""

    def __init__(self, call: Callable[[], object]) -> None:
        self.result: object = None
        self.errno: int | None = None
        self._call = call
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = self._call()
        except OSError as exc:
            self.errno = exc.errno

    def finished_within(self, seconds: float) -> bool:
        self.thread.join(timeout=seconds)
        return not self.thread.is_alive()


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[tuple[LeaseFsMount, LeaseFsMount]]:
    backing = tmp_path / "backing"
    backing.mkdir()
    a = mount_leasefs(
        str(backing), str(tmp_path / "a"), "a", LEASE_S, log_path=str(tmp_path / "a.log")
    )
    b = mount_leasefs(
        str(backing), str(tmp_path / "b"), "b", LEASE_S, log_path=str(tmp_path / "b.log")
    )
    with a, b:
        yield a, b
    assert mounted_fstype(a.mountpoint) is None
    assert mounted_fstype(b.mountpoint) is None


# -- real mounts ----------------------------------------------------------------------------


@pytest.mark.fuse
@pytest.mark.timeout(60)
def test_file_operations_round_trip_between_mounts(
    hosts: tuple[LeaseFsMount, LeaseFsMount],
) -> None:
    a, b = hosts
    os.makedirs(a.path("t", "s"))
    with open(a.path("t", "s", "seg"), "xb") as f:
        f.write(b"one\n")
        f.flush()
        os.fsync(f.fileno())
    with open(b.path("t", "s", "seg"), "ab") as f:
        f.write(b"two\n")
    assert Path(a.path("t", "s", "seg")).read_bytes() == b"one\ntwo\n"
    os.rename(a.path("t", "s", "seg"), a.path("t", "s", "seg2"))
    os.link(b.path("t", "s", "seg2"), b.path("t", "s", "seg3"))
    assert _errno_of(lambda: os.link(a.path("t", "s", "seg2"), a.path("t", "s", "seg3"))) == (
        errno.EEXIST
    )
    assert sorted(os.listdir(a.path("t", "s"))) == ["seg2", "seg3"]
    assert os.stat(a.path("t", "s", "seg3")).st_nlink == 2
    os.truncate(b.path("t", "s", "seg3"), 3)
    os.chmod(b.path("t", "s", "seg3"), 0o600)
    os.utime(b.path("t", "s", "seg3"), ns=(1_000_000_000, 2_000_000_000))
    st = os.stat(a.path("t", "s", "seg2"))
    assert (st.st_size, st.st_mode & 0o777, st.st_mtime_ns) == (3, 0o600, 2_000_000_000)
    os.unlink(a.path("t", "s", "seg2"))
    os.unlink(a.path("t", "s", "seg3"))
    os.rmdir(b.path("t", "s"))
    assert os.listdir(a.path("t")) == []
    assert os.statvfs(a.mountpoint).f_bsize > 0


@pytest.mark.fuse
@pytest.mark.timeout(60)
def test_o_excl_create_race_across_mounts_has_one_winner(
    hosts: tuple[LeaseFsMount, LeaseFsMount],
) -> None:
    a, b = hosts

    def create(mount: LeaseFsMount, name: str, start: threading.Barrier, won: list[str]) -> None:
        start.wait(timeout=5)
        try:
            fd = os.open(mount.path(name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return
        os.write(fd, mount.spec.host.encode())
        os.close(fd)
        won.append(mount.spec.host)

    for round_no in range(20):
        winners: list[str] = []
        barrier = threading.Barrier(2)
        threads = [
            threading.Thread(target=create, args=(m, f"seg-{round_no}", barrier, winners))
            for m in (a, b)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        assert len(winners) == 1
        assert Path(a.path(f"seg-{round_no}")).read_text() == winners[0]


@pytest.mark.fuse
@pytest.mark.timeout(60)
def test_ofd_locks_conflict_across_and_within_mounts(
    hosts: tuple[LeaseFsMount, LeaseFsMount],
) -> None:
    a, b = hosts
    a1 = os.open(a.path("lock"), os.O_RDWR | os.O_CREAT, 0o644)
    a2 = os.open(a.path("lock"), os.O_RDWR)
    b1 = os.open(b.path("lock"), os.O_RDWR)
    try:
        _ofd(a1)
        assert _ofd_busy(b1)  # another mount
        assert _ofd_busy(a2)  # another open file description, same mount and process
        _ofd(a1)  # the holder itself may re-lock
        dup = os.dup(a1)
        os.close(dup)
        os.close(a2)  # a POSIX lock would be dropped here; an OFD lock must not be
        assert _ofd_busy(b1)
        assert a.control.status().held_locks == 1

        _ofd(a1, fcntl.F_UNLCK)
        _ofd(b1)
        assert _ofd_busy(a1)
        assert a.control.status().held_locks == 0
        os.close(b1)
        b1 = -1
        # The kernel sends RELEASE after close() returns, so the lock goes just after.
        eventually(lambda: not _ofd_busy(a1), timeout=5.0, interval=0.01)
        assert b.control.status().held_locks == 0
    finally:
        for fd in (a1, b1):
            if fd >= 0:
                os.close(fd)


@pytest.mark.fuse
@pytest.mark.timeout(60)
def test_flock_and_process_locks_conflict_across_mounts(
    hosts: tuple[LeaseFsMount, LeaseFsMount],
) -> None:
    a, b = hosts
    fa = os.open(a.path("lock"), os.O_RDWR | os.O_CREAT, 0o644)
    fb = os.open(b.path("lock"), os.O_RDWR)
    try:
        fcntl.flock(fa, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fb, fcntl.LOCK_EX | fcntl.LOCK_NB)
        waiter = _Background(lambda: fcntl.flock(fb, fcntl.LOCK_EX))
        assert not waiter.finished_within(0.2)
        fcntl.flock(fa, fcntl.LOCK_UN)
        assert waiter.finished_within(5) and waiter.errno is None
        fcntl.flock(fb, fcntl.LOCK_UN)

        fcntl.lockf(fa, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(BlockingIOError):
            fcntl.lockf(fb, fcntl.LOCK_EX | fcntl.LOCK_NB)
        extra = os.open(a.path("lock"), os.O_RDONLY)
        os.close(extra)  # closing any descriptor drops the process's POSIX locks
        fcntl.lockf(fb, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fa)
        os.close(fb)


@pytest.mark.fuse
@pytest.mark.timeout(60)
def test_partition_revokes_the_lease_and_old_descriptors_fail_after_heal(
    hosts: tuple[LeaseFsMount, LeaseFsMount],
) -> None:
    a, b = hosts
    lock = os.open(a.path("lock"), os.O_RDWR | os.O_CREAT, 0o644)
    seg = os.open(a.path("seg"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    other = os.open(b.path("lock"), os.O_RDWR)
    try:
        _ofd(lock)
        os.write(seg, b"before\n")
        a.control.partition()
        blocked = _Background(lambda: os.write(seg, b"during\n"))
        assert not blocked.finished_within(0.3)
        assert _ofd_busy(other)  # the lease still stands
        started = time.monotonic()
        eventually(lambda: not _ofd_busy(other), timeout=LEASE_S + 4, interval=0.01)
        assert time.monotonic() - started < LEASE_S + 4
        status = a.control.status()
        assert (status.mode, status.held_locks, status.revoked_locks) == (Mode.PARTITION, 0, 1)
        assert blocked.thread.is_alive()  # still partitioned: the write waits on

        a.control.heal()
        assert blocked.finished_within(5)
        assert blocked.errno == errno.EIO
        assert _errno_of(lambda: os.write(seg, b"after\n")) == errno.EIO
        assert _errno_of(lambda: os.fsync(seg)) == errno.EIO
        assert _errno_of(lambda: _ofd(lock)) == errno.EIO
        assert Path(b.path("seg")).read_bytes() == b"before\n"
        fresh = os.open(a.path("seg"), os.O_WRONLY | os.O_APPEND)
        os.write(fresh, b"fresh\n")
        os.close(fresh)
        assert Path(b.path("seg")).read_bytes() == b"before\nfresh\n"
    finally:
        a.control.ok()
        for fd in (lock, seg, other):
            os.close(fd)


@pytest.mark.fuse
@pytest.mark.timeout(60)
def test_heal_inside_the_lease_keeps_locks_and_descriptors(
    hosts: tuple[LeaseFsMount, LeaseFsMount],
) -> None:
    a, b = hosts
    lock = os.open(a.path("lock"), os.O_RDWR | os.O_CREAT, 0o644)
    other = os.open(b.path("lock"), os.O_RDWR)
    try:
        _ofd(lock)
        a.control.partition()
        time.sleep(LEASE_S / 4)  # a partition that ends inside the lease: what is under test
        a.control.heal()
        assert _ofd_busy(other)
        _ofd(lock)
        assert a.control.status().revoked_locks == 0
    finally:
        os.close(lock)
        os.close(other)


@pytest.mark.fuse
@pytest.mark.timeout(60)
def test_hang_blocks_calls_until_ok_without_revoking(
    hosts: tuple[LeaseFsMount, LeaseFsMount],
) -> None:
    a, b = hosts
    Path(a.path("f")).write_bytes(b"x")
    lock = os.open(a.path("lock"), os.O_RDWR | os.O_CREAT, 0o644)
    other = os.open(b.path("lock"), os.O_RDWR)
    try:
        _ofd(lock)
        a.control.hang()
        stat_call = _Background(lambda: os.stat(a.path("f")))
        assert not stat_call.finished_within(LEASE_S * 1.5)
        assert a.control.status().blocked_calls >= 1
        assert _ofd_busy(other)  # a hung mount keeps its locks
        a.control.ok()
        assert stat_call.finished_within(5)
        assert stat_call.errno is None
        assert a.control.status().blocked_calls == 0
    finally:
        a.control.ok()
        os.close(lock)
        os.close(other)


@pytest.mark.fuse
@pytest.mark.timeout(60)
def test_a_caller_killed_while_the_mount_hangs_exits(
    hosts: tuple[LeaseFsMount, LeaseFsMount],
) -> None:
    a, _ = hosts
    a.control.hang()
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", "import os, sys; os.stat(sys.argv[1])", a.path("x")]
        )
        try:
            with pytest.raises(subprocess.TimeoutExpired):
                child.wait(timeout=1.0)  # blocked in the mount
            child.kill()
            assert child.wait(timeout=5) == -signal.SIGKILL
        finally:
            if child.poll() is None:
                child.kill()
    finally:
        a.control.ok()


@pytest.mark.fuse
@pytest.mark.timeout(60)
def test_readonly_refuses_writes_and_allows_reads(
    hosts: tuple[LeaseFsMount, LeaseFsMount],
) -> None:
    a, _ = hosts
    Path(a.path("f")).write_bytes(b"data")
    fd = os.open(a.path("f"), os.O_RDWR)
    try:
        a.control.readonly()
        assert _errno_of(lambda: os.write(fd, b"x")) == errno.EROFS
        assert _errno_of(lambda: os.open(a.path("g"), os.O_CREAT | os.O_WRONLY)) == errno.EROFS
        assert _errno_of(lambda: os.open(a.path("f"), os.O_WRONLY)) == errno.EROFS
        assert _errno_of(lambda: os.unlink(a.path("f"))) == errno.EROFS
        assert _errno_of(lambda: os.mkdir(a.path("d"))) == errno.EROFS
        assert os.pread(fd, 4, 0) == b"data"
        assert Path(a.path("f")).read_bytes() == b"data"
        a.control.ok()
        assert os.write(fd, b"D") == 1
    finally:
        a.control.ok()
        os.close(fd)


@pytest.mark.fuse
@pytest.mark.timeout(60)
def test_vanish_fails_names_and_descriptors_until_ok(
    hosts: tuple[LeaseFsMount, LeaseFsMount],
) -> None:
    a, _ = hosts
    Path(a.path("f")).write_bytes(b"data")
    fd = os.open(a.path("f"), os.O_RDWR)
    try:
        a.control.vanish()
        assert _errno_of(lambda: os.stat(a.path("f"))) == errno.ENOENT
        assert _errno_of(lambda: os.open(a.path("g"), os.O_CREAT | os.O_WRONLY)) == errno.ENOENT
        assert _errno_of(lambda: os.pread(fd, 4, 0)) == errno.EIO
        assert _errno_of(lambda: os.write(fd, b"x")) == errno.EIO
        assert os.listdir(a.mountpoint) == []
        a.control.ok()
        assert os.pread(fd, 4, 0) == b"data"
        assert os.listdir(a.mountpoint) == ["f"]
    finally:
        a.control.ok()
        os.close(fd)


@pytest.mark.fuse
@pytest.mark.timeout(60)
def test_a_killed_daemon_leaves_no_mount_behind(tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    backing.mkdir()
    mount = mount_leasefs(str(backing), str(tmp_path / "m"), "k", LEASE_S)
    with mount:
        assert mount.pid is not None
        os.kill(mount.pid, signal.SIGKILL)
        eventually(
            lambda: _errno_of(lambda: os.stat(mount.mountpoint)) == errno.ENOTCONN,
            timeout=5.0,
            interval=0.01,
        )
    assert mounted_fstype(mount.mountpoint) is None
