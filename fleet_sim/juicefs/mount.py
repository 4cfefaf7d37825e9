"""Formatting the volume, and one JuiceFS client mount: its flags, start-up, processes, stop.

A mount runs ``juicefs mount`` in the foreground (never ``-d``: the daemonised form detaches from
us and leaves nothing to wait on). That process is a *supervisor*: it checks the metadata engine,
then runs the *worker* (the same binary again) that serves FUSE and holds the session, and
restarts the worker if it dies, handing it the FUSE descriptor so the mount survives. Both are
the host's file-system client: :meth:`JuiceFsMount.pids` names both, a frozen host stops both,
and only the worker answers file-system calls.

The flags are the ones the storage design depends on (see :func:`mount_argv`): no metadata
caching on lookups, so a successor's new epoch segment is visible to a stale owner's next fence
check; a short heartbeat, because a client whose heartbeats stop keeps its session, and so its
locks, for 5 heartbeats before a live client cleans the session up; and never ``--writeback``,
because an fsync must mean the data is in the bucket, not in one host's staging directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from fleet_sim.juicefs import procs
from fleet_sim.juicefs.binaries import check_fuse, juicefs_binary
from fleet_sim.juicefs.errors import FormatFailed, MountFailed
from fleet_sim.leasefs.mount import mounted_fstype

FSTYPE = "fuse.juicefs"
ROOT_INODE = 1  # JuiceFS's root; the mount point reports it once the mount is live
MNT_DETACH = 2


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """How every JuiceFS client of the substrate runs."""

    heartbeat_s: float = 2.0  # a stopped client's locks are freed after 5 x this (and one sweep)
    cache_size_mib: int = 256  # read cache per host: blocks are immutable, so it is never stale
    format_budget_s: float = 30.0  # format retries an unreachable engine for minutes by itself
    start_budget_s: float = 20.0
    stop_budget_s: float = 10.0


def _seconds(value: float) -> str:
    return f"{value:g}s"


def format_argv(juicefs: Path, meta_url: str, bucket: Path, name: str) -> list[str]:
    return [
        str(juicefs),
        "format",
        "--no-agent",  # no pprof listener (it would take a port in 6060-6099)
        "--storage",
        "file",
        "--bucket",
        f"{bucket}/",  # a file bucket is a directory; JuiceFS wants the trailing slash
        "--trash-days",
        "0",  # a removed file is gone at once: no trash to sweep in the background
        meta_url,
        name,
    ]


def mount_argv(
    juicefs: Path, meta_url: str, mountpoint: Path, cache_dir: Path, options: ClientOptions
) -> list[str]:
    return [
        str(juicefs),
        "mount",
        "--no-agent",
        # Nothing leaves the machine: without this JuiceFS posts usage reports to its vendor.
        "--no-usage-report",
        # The engine is ours and throw-away; a backup would only add background writes to it.
        "--backup-meta",
        "0",
        "--heartbeat",
        _seconds(options.heartbeat_s),
        # The fence looks names up: no cached attributes, entries or (negative) lookups, and no
        # reuse of an open file's cached state. The last two are already off by default; they
        # are named so that a change of defaults cannot turn them on.
        "--attr-cache",
        "0",
        "--entry-cache",
        "0",
        "--dir-entry-cache",
        "0",
        "--negative-entry-cache",
        "0",
        "--open-cache",
        "0",
        "--cache-dir",
        str(cache_dir),
        "--cache-size",
        str(options.cache_size_mib),
        # JuiceFS's virtual files (.accesslog, .stats, .config, .trash) stay reachable by name
        # but leave the root's listing: whatever walks the tree (a grader scanning every file
        # for a leaked secret) would otherwise open .accesslog, a read that never ends.
        "--hide-internal",
        # Metrics cannot be switched off; port 0 makes the client bind a free loopback port.
        "--metrics",
        "127.0.0.1:0",
        meta_url,
        str(mountpoint),
    ]


def format_volume(
    meta_url: str, bucket: Path, name: str, log: Path, budget_s: float = 30.0
) -> None:
    """Format ``name`` on the engine at ``meta_url`` with a ``file`` bucket at ``bucket``."""
    bucket.mkdir(parents=True, exist_ok=True)
    argv = format_argv(juicefs_binary(), meta_url, bucket, name)
    with open(log, "ab") as out:
        try:
            done = subprocess.run(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, timeout=budget_s
            )
        except subprocess.TimeoutExpired:
            raise FormatFailed(
                f"juicefs format of {name} on {meta_url} did not finish within {budget_s:g}s", log
            ) from None
    if done.returncode != 0:
        raise FormatFailed(
            f"juicefs format of {name} on {meta_url} exited with {done.returncode}", log
        )


def detach(mountpoint: Path) -> None:
    """umount2(MNT_DETACH) straight to the kernel, as a last resort: unlike fusermount it looks
    nothing up through the mount, so a wedged client cannot block it."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.umount2(os.fsencode(mountpoint), MNT_DETACH)


class JuiceFsMount:
    """One host's JuiceFS client and its mount point."""

    def __init__(
        self,
        meta_url: str,
        mountpoint: Path,
        cache_dir: Path,
        log: Path,
        options: ClientOptions | None = None,
    ) -> None:
        self.meta_url = meta_url
        self.mountpoint = mountpoint
        self.cache_dir = cache_dir
        self.log = log
        self.options = options or ClientOptions()
        self._proc: subprocess.Popen[bytes] | None = None
        self._juicefs: Path | None = None
        self._seen: set[int] = set()  # every worker pid seen, so stop() can make sure of them

    @property
    def supervisor_pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def worker_pids(self) -> list[int]:
        """The supervisor's live workers (one, except for a moment while it restarts one)."""
        supervisor = self.supervisor_pid
        found = [] if supervisor is None else procs.children(supervisor)
        self._seen.update(found)
        return found

    def pids(self) -> list[int]:
        """Supervisor first, then worker: the host's whole file-system client."""
        supervisor = self.supervisor_pid
        return ([] if supervisor is None else [supervisor]) + self.worker_pids()

    def mounted(self) -> bool:
        return mounted_fstype(str(self.mountpoint)) == FSTYPE

    def start(self) -> None:
        check_fuse()
        self._juicefs = juicefs_binary()
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        argv = mount_argv(
            self._juicefs, self.meta_url, self.mountpoint, self.cache_dir, self.options
        )
        # In the foreground JuiceFS logs to stderr (--log is for -d only): the log is ours.
        with open(self.log, "ab") as out:
            self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        proc = self._proc
        assert proc is not None

        def ready() -> bool:
            if proc.poll() is not None:
                raise MountFailed(
                    f"juicefs mount of {self.mountpoint} exited with {proc.returncode}", self.log
                )
            # mountinfo first: stat() of a mount point that is not live yet would be answered
            # by the directory beneath it, and of a half-made mount could wait on the client.
            if not self.mounted() or not self.worker_pids():
                return False
            return os.stat(self.mountpoint).st_ino == ROOT_INODE

        if not procs.poll(ready, self.options.start_budget_s, 0.05):
            raise MountFailed(
                f"juicefs did not mount {self.mountpoint} within {self.options.start_budget_s:g}s",
                self.log,
            )

    def freeze(self) -> None:
        """The host stops: supervisor first, so it does not act on a stopped worker."""
        procs.send(self.pids(), signal.SIGSTOP)

    def thaw(self) -> None:
        procs.send(list(reversed(self.pids())), signal.SIGCONT)

    def hang(self) -> None:
        """The mount stops answering: the worker stops, the supervisor watches on.

        Its heartbeats stop too, so after 5 heartbeats the session and its locks go, as for a
        frozen host. The supervisor's watchdog kills and restarts a worker whose mount has not
        answered for about two minutes; a hang is meant to be shorter than that.
        """
        procs.send(self.worker_pids(), signal.SIGSTOP)

    def unhang(self) -> None:
        procs.send(self.worker_pids(), signal.SIGCONT)

    def stop(self) -> None:
        """Unmount and end both processes, whatever state they are in; never blocks for long."""
        proc = self._proc
        budget = self.options.stop_budget_s
        pids = self.pids()
        # A stopped client can neither answer the unmount's lookups nor exit.
        procs.send(pids, signal.SIGCONT)
        if self.mounted():
            self._umount(force=False, budget_s=budget / 4)
        if self.mounted():
            # Busy (a descriptor still open) or not answering: detach it now; the kernel frees
            # it when the last descriptor closes.
            self._umount(force=True, budget_s=budget / 4)
        if proc is not None:
            # Unmounted, the worker closes its session and exits, and the supervisor with it.
            try:
                proc.wait(timeout=budget / 4)
            except subprocess.TimeoutExpired:
                procs.stop_process(proc, budget / 4)
        program = self._juicefs or juicefs_binary()
        procs.kill_now([pid for pid in self._seen | set(pids) if procs.runs(pid, program)])
        if self.mounted():
            detach(self.mountpoint)  # a client that died leaves a dead mount behind
        self._proc = None

    def _umount(self, *, force: bool, budget_s: float) -> None:
        argv = [str(self._juicefs or juicefs_binary()), "umount", "--no-agent"]
        argv += ["--force"] if force else []
        with open(self.log, "ab") as out, contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(
                [*argv, str(self.mountpoint)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                timeout=budget_s,
                check=False,
            )
