"""Process helpers the substrate's parts share: finding a process's children, signalling without
racing its exit, and stopping a process within a bound.

Everything here reads ``/proc`` or sends signals; nothing waits without a deadline, because
``close()`` of a substrate must return even when a client is stopped or a mount is wedged.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
POLL_S = 0.02


def poll(
    predicate: Callable[[], T | None], budget_s: float, interval_s: float = POLL_S
) -> T | None:
    """``predicate()``'s first truthy value within ``budget_s`` (checked at least once), else
    None."""
    deadline = time.monotonic() + budget_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval_s)


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (the first is field 3, the
    state), None if the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name sits in parentheses and may itself contain ") ".
    return stat.rpartition(")")[2].split()


def state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (R, S, D, T, Z...), None if it is gone."""
    fields = stat_fields(pid)
    return fields[0] if fields else None


def started(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (field 22), None if it is gone: with the pid, it names
    one process, where a pid alone may since have been given to another."""
    fields = stat_fields(pid)
    return fields[19] if fields and len(fields) > 19 else None


def alive(pid: int) -> bool:
    """Running, sleeping or stopped: anything but gone or a zombie."""
    return state(pid) not in (None, "Z", "X")


def runs(pid: int, program: Path) -> bool:
    """Whether ``pid`` is (still) an instance of ``program``: a pid remembered from earlier may
    since have been given to some other process."""
    try:
        return Path(os.readlink(f"/proc/{pid}/exe")) == program.resolve() and alive(pid)
    except OSError:
        return False


def children(pid: int) -> list[int]:
    """The live children of ``pid``, read from every process's parent field."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = stat_fields(int(entry.name))
        if fields and len(fields) > 1 and fields[1] == str(pid) and fields[0] not in ("Z", "X"):
            found.append(int(entry.name))
    return sorted(found)


def send(pids: list[int], sig: signal.Signals) -> None:
    """Signal each of ``pids`` that is still there; one already gone is not an error."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def stop_process(proc: subprocess.Popen[bytes], budget_s: float) -> None:
    """SIGTERM, then SIGKILL after half the budget; reaped either way."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            proc.terminate()
        try:
            proc.wait(timeout=budget_s / 2)
        except subprocess.TimeoutExpired:
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=budget_s / 2)


def kill_now(pids: list[int]) -> None:
    """SIGKILL each of ``pids`` (the kernel closes their descriptors at once)."""
    send(pids, signal.SIGKILL)
