"""One host's mode, shared by every filesystem thread of its daemon.

Filesystem calls pass through :meth:`Gate.enter`, which applies :func:`policy.admit`: a call that
must wait sleeps on a condition in short slices, so it wakes promptly when the mode changes and
notices when the kernel interrupts it (a caller killed while its mount hangs must still be able to
exit, as on an NFS ``hard`` mount). A watcher thread revokes the host's lease once a partition
outlives ``lease_s``.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from fleet_sim.leasefs.policy import Action, Mode, OpKind, admit, revocation_due

# How long one wait slice lasts: the bound on how late a blocked call notices an interrupt.
WAIT_SLICE_S = 0.05


@dataclass(frozen=True, slots=True)
class GateSnapshot:
    mode: Mode
    blocked: int
    revocations: int


class Gate:
    def __init__(
        self,
        lease_s: float,
        on_revoke: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        self._lease_s = lease_s
        self._on_revoke = on_revoke
        self._clock = clock
        self._cond = threading.Condition()
        self._mode = Mode.OK
        self._partitioned_since: float | None = None
        self._revoked_this_partition = False
        self._revocations = 0
        self._blocked = 0
        self._closed = False
        self._watcher = threading.Thread(target=self._watch, name="leasefs-lease", daemon=True)
        self._watcher.start()

    def set_mode(self, mode: Mode) -> None:
        with self._cond:
            if mode is Mode.PARTITION and self._mode is not Mode.PARTITION:
                self._partitioned_since = self._clock()
                self._revoked_this_partition = False
            elif mode is not Mode.PARTITION:
                self._partitioned_since = None
            self._mode = mode
            self._cond.notify_all()

    def snapshot(self) -> GateSnapshot:
        with self._cond:
            return GateSnapshot(self._mode, self._blocked, self._revocations)

    @property
    def mode(self) -> Mode:
        with self._cond:
            return self._mode

    def enter(
        self,
        kind: OpKind,
        *,
        on_handle: bool,
        is_root: bool = False,
        interrupted: Callable[[], bool] = lambda: False,
    ) -> None:
        """Return when the call may proceed; raise OSError with the errno it must fail with."""
        with self._cond:
            counted = False
            try:
                while True:
                    verdict = admit(self._mode, kind, on_handle=on_handle, is_root=is_root)
                    if verdict.action is Action.PROCEED:
                        return
                    if verdict.action is Action.FAIL:
                        raise OSError(verdict.errno, f"leasefs: mount is {self._mode}")
                    if interrupted():
                        raise OSError(errno.EINTR, "leasefs: interrupted while blocked")
                    if not counted:
                        counted = True
                        self._blocked += 1
                    self._cond.wait(WAIT_SLICE_S)
            finally:
                if counted:
                    self._blocked -= 1

    def pause(self, seconds: float) -> None:
        """Sleep up to ``seconds``, waking early on any mode change (for polling lock waits)."""
        with self._cond:
            self._cond.wait(seconds)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._watcher.join(timeout=5)

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                if revocation_due(
                    self._mode,
                    self._partitioned_since,
                    self._clock(),
                    self._lease_s,
                    self._revoked_this_partition,
                ):
                    self._revoked_this_partition = True
                    self._revocations += 1
                    # Called with the condition held so no call can pass the gate half-way
                    # through a revocation: every call is blocked by the partition anyway.
                    self._on_revoke()
                self._cond.wait(WAIT_SLICE_S)
