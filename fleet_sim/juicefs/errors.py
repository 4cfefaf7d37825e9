"""The juicefs substrate's error tree.

Every error the package raises on purpose derives from :class:`JuiceFsError` and, where a process
of ours failed, names the log that process wrote, with the last error line found in it, so a
failed simulator run says where to look without anyone having to guess::

    JuiceFsError
    ├── BinaryMissing     juicefs, redis-server, fusermount3 or /dev/fuse is not on this machine
    ├── MetadataFailed    the Redis server did not start, answer or restart within its budget
    ├── FormatFailed      ``juicefs format`` exited with an error or outlived its budget
    ├── MountFailed       a mount's client exited, or the mount was not ready within its budget
    └── RelayFailed       a host's relay did not start or did not acknowledge a command

Faults are not errors: a frozen, partitioned or hung mount is a state the substrate was asked
for, and whatever it does to file-system calls is an ``OSError`` (or a wait) in the caller.
"""

from __future__ import annotations

from pathlib import Path

# Log lines worth quoting in a message: JuiceFS marks its levels in angle brackets, Redis with
# '#' (warning) before the text; a Python traceback (the relay's) ends with the exception line.
_MARKS = ("<FATAL>", "<ERROR>", "# ", "Error", "error", "refused")
_TAIL_BYTES = 16_384


def last_error_line(log: Path) -> str:
    """The last line of ``log`` that looks like an error ('' when none, or no log)."""
    try:
        with open(log, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - _TAIL_BYTES))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    for line in reversed(lines):
        if any(mark in line for mark in _MARKS):
            return line[:300]
    return lines[-1][:300] if lines else ""


class JuiceFsError(Exception):
    """Base of every deliberate error of the juicefs substrate.

    ``log`` is the file the failed process wrote (None when no process of ours was involved);
    the message always names it.
    """

    def __init__(self, what: str, log: Path | None = None) -> None:
        self.log = log
        if log is not None:
            said = last_error_line(log)
            what = f"{what}; see {log}" + (f" (last error: {said})" if said else "")
        super().__init__(what)


class BinaryMissing(JuiceFsError):
    """A program or device the substrate needs is not installed."""


class MetadataFailed(JuiceFsError):
    """The metadata engine (the fleet's Redis server) did not come up or came up wrong."""


class FormatFailed(JuiceFsError):
    """The volume could not be formatted on the metadata engine."""


class MountFailed(JuiceFsError):
    """A JuiceFS client did not mount, or exited while mounting."""


class RelayFailed(JuiceFsError):
    """A host's relay in front of the metadata engine did not start or answer."""
