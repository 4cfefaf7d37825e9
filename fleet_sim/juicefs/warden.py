"""The substrate's warden: ends what a simulator killed outright leaves behind.

JuiceFS clients and Redis do not watch their parent: a simulator that is SIGKILLed (or a test
run timed out with ``os._exit``) would leave mounts, clients and a Redis server running for
good. The warden is a small process that the substrate tells about every process and mount it
makes, one line on the warden's stdin each; the substrate's ``close()`` ends them itself and then
says ``release``. If stdin ends without a release, the simulator is gone: the warden stops every
process it was told about (with their children: a JuiceFS supervisor's worker) and detaches every
mount, then exits.

A process is remembered with its start time, so a pid that has since been given to some other
process is never signalled.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from pathlib import Path

from fleet_sim.juicefs import procs
from fleet_sim.juicefs.errors import JuiceFsError

_STOP_S = 5.0


def _descendants(roots: set[int]) -> set[int]:
    found = set(roots)
    while True:
        more = {child for pid in found for child in procs.children(pid)} - found
        if not more:
            return found
        found |= more


def _sweep(pids: dict[int, str], mounts: list[str]) -> None:
    still = {pid for pid, started in pids.items() if procs.started(pid) == started}
    doomed = sorted(_descendants(still))
    procs.send(doomed, signal.SIGCONT)  # a stopped process cannot die of SIGKILL until then
    procs.kill_now(doomed)
    from fleet_sim.juicefs.mount import detach  # here: the warden needs it only at the end

    for mount in mounts:
        with contextlib.suppress(OSError):
            detach(Path(mount))


def main(argv: list[str]) -> int:
    """``python -m fleet_sim.juicefs warden``: reads ``pid N``, ``mount PATH``, ``release``."""
    del argv
    pids: dict[int, str] = {}
    mounts: list[str] = []
    for line in sys.stdin:
        verb, _, arg = line.rstrip("\n").partition(" ")
        if verb == "pid":
            started = procs.started(int(arg))
            if started is not None:
                pids[int(arg)] = started
        elif verb == "mount":
            mounts.append(arg)
        elif verb == "release":
            return 0
    _sweep(pids, mounts)
    return 0


class Warden:
    """The substrate's handle on its warden process."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> None:
        with open(self.log, "ab") as err:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "fleet_sim.juicefs", "warden"],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=err,
                # Its own session: a signal to the simulator's process group (Ctrl-C, a job
                # control kill) must not take the warden down with it.
                start_new_session=True,
            )

    def watch(self, *, pid: int | None = None, mount: Path | None = None) -> None:
        if pid is not None:
            self._say(f"pid {pid}")
        if mount is not None:
            self._say(f"mount {mount}")

    def _say(self, line: str) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None:
            raise JuiceFsError("the warden is not running", self.log)
        try:
            proc.stdin.write(f"{line}\n".encode())
            proc.stdin.flush()
        except OSError as exc:
            raise JuiceFsError(f"the warden is gone ({exc})", self.log) from None

    def release(self) -> None:
        """Everything was ended by its owner: the warden exits touching nothing."""
        proc = self._proc
        if proc is None:
            return
        with contextlib.suppress(JuiceFsError):
            self._say("release")
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        try:
            proc.wait(timeout=_STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=_STOP_S)
        self._proc = None
