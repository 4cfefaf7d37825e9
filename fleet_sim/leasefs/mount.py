"""Start, watch and tear down one leasefs daemon from another process (tests, the simulator).

:func:`mount_leasefs` returns a context manager: entering starts the daemon and waits until the
mount is live and the control socket answers; leaving returns the mount to ``ok`` (so no caller
stays blocked), unmounts with ``fusermount3 -u`` (lazily if the mount is busy or its daemon is
dead), and stops the daemon. The daemon watches its stdin, so even a parent killed outright does
not leave a mount behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from types import TracebackType

from fleet_sim.leasefs.control import LeaseFsControl
from fleet_sim.leasefs.errors import ControlError, FuseUnavailable, MountFailed

START_BUDGET_S = 15.0
STOP_BUDGET_S = 10.0
_POLL_S = 0.02


def check_fuse_available() -> str:
    """Return the fusermount3 path, or raise if this machine cannot mount FUSE filesystems."""
    if not os.path.exists("/dev/fuse"):
        raise FuseUnavailable("/dev/fuse is missing")
    helper = shutil.which("fusermount3")
    if helper is None:
        raise FuseUnavailable("fusermount3 is not on PATH")
    return helper


def _unescape(field: str) -> str:
    # /proc/self/mountinfo escapes space, tab, newline and backslash as octal.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def mounted_fstype(mountpoint: str) -> str | None:
    """The filesystem type mounted exactly at ``mountpoint`` (topmost), read without touching it."""
    target = os.path.abspath(mountpoint)
    found: str | None = None
    with open("/proc/self/mountinfo", encoding="utf-8") as info:
        for line in info:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if len(fields) >= 5 and _unescape(fields[4]) == target:
                found = right.split()[0]
    return found


@dataclass(frozen=True, slots=True)
class MountSpec:
    backing: str
    mountpoint: str
    host: str
    lease_s: float
    control: str
    extra_args: tuple[str, ...] = ()


class LeaseFsMount:
    """A running daemon and its mount; use as a context manager."""

    def __init__(
        self, spec: MountSpec, log_path: str | None = None, scratch_dir: str | None = None
    ) -> None:
        self.spec = spec
        self.control = LeaseFsControl(spec.control)
        self.log_path = log_path
        self._scratch_dir = scratch_dir  # made for the control socket; removed by stop()
        self._proc: subprocess.Popen[bytes] | None = None
        self._fusermount = ""

    @property
    def mountpoint(self) -> str:
        return self.spec.mountpoint

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def path(self, *parts: str) -> str:
        return os.path.join(self.spec.mountpoint, *parts)

    def __enter__(self) -> LeaseFsMount:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        self._fusermount = check_fuse_available()
        spec = self.spec
        os.makedirs(spec.mountpoint, exist_ok=True)
        argv = [
            sys.executable,
            "-m",
            "fleet_sim.leasefs",
            "mount",
            "--backing",
            spec.backing,
            "--mountpoint",
            spec.mountpoint,
            "--host",
            spec.host,
            "--control",
            spec.control,
            "--lease-s",
            str(spec.lease_s),
            "--watch-stdin",
            *spec.extra_args,
        ]
        with contextlib.ExitStack() as stack:
            log = (
                stack.enter_context(open(self.log_path, "ab"))
                if self.log_path
                else subprocess.DEVNULL
            )
            self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log, stderr=log)
        try:
            self._wait_live()
        except BaseException:
            self.stop()
            raise

    def _wait_live(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + START_BUDGET_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise MountFailed(f"leasefs daemon exited with {self._proc.returncode}")
            if mounted_fstype(self.spec.mountpoint) == "fuse.leasefs":
                with contextlib.suppress(ControlError):
                    self.control.status()
                    return
            time.sleep(_POLL_S)
        raise MountFailed(f"leasefs did not mount {self.spec.mountpoint} in {START_BUDGET_S}s")

    def stop(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ControlError):
                self.control.ok()
        self._unmount()
        if proc is not None:
            self._stop_process(proc)
        # A daemon that died leaves a dead mount ("transport endpoint is not connected").
        self._unmount()
        self._proc = None
        if self._scratch_dir is not None:
            shutil.rmtree(self._scratch_dir, ignore_errors=True)

    def _unmount(self) -> None:
        for lazy in (False, False, True):
            if mounted_fstype(self.spec.mountpoint) is None:
                return
            flags = ["-u", "-z"] if lazy else ["-u"]
            subprocess.run(
                [self._fusermount or "fusermount3", *flags, self.spec.mountpoint],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=STOP_BUDGET_S,
                check=False,
            )
            if mounted_fstype(self.spec.mountpoint) is None:
                return
            time.sleep(0.1)

    @staticmethod
    def _stop_process(proc: subprocess.Popen[bytes]) -> None:
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        try:
            proc.wait(timeout=STOP_BUDGET_S / 2)
            return
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_BUDGET_S / 2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_BUDGET_S)


def mount_leasefs(
    backing: str,
    mountpoint: str,
    host: str,
    lease_s: float = 10.0,
    *,
    control: str | None = None,
    log_path: str | None = None,
    extra_args: tuple[str, ...] = (),
) -> LeaseFsMount:
    """Describe a mount; the daemon starts when the returned object is entered (or started).

    Without ``control`` the socket goes in a fresh short directory under the system temp dir,
    because unix socket paths are limited to 107 bytes.
    """
    scratch_dir = None
    if control is None:
        scratch_dir = tempfile.mkdtemp(prefix="leasefs-")
        control = os.path.join(scratch_dir, f"{host}.sock")
    spec = MountSpec(
        backing=os.path.abspath(backing),
        mountpoint=os.path.abspath(mountpoint),
        host=host,
        lease_s=lease_s,
        control=os.path.abspath(control),
        extra_args=extra_args,
    )
    return LeaseFsMount(spec, log_path, scratch_dir)
