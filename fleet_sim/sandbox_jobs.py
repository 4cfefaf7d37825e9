"""One simulated sandbox: its workspace, its foreground commands and its background jobs.

A sandbox named ``N`` under a root ``R`` owns two directories, created on first use:
``R/N/workspace`` (where every command runs, and the only place a command is meant to write) and
``R/N/state`` (job output files, kept out of the workspace so a command listing or cleaning its
directory does not see or delete them).

Every command is ``bash -c COMMAND`` in its own session and process group, stdin from
``/dev/null``, with a small fixed environment (nothing of the server's, so no secret it was
started with can leak into a tool call). A command's process group never outlives it: when the
main process ends (or times out, or is killed) the whole group is sent SIGKILL, so a stray
``sleep 1000 &`` cannot pile up. Something meant to keep running is a background job.

Output is read from pipes by the event loop rather than redirected to files, so it is bounded
without stopping the command: a foreground stream keeps its first ``foreground_output_cap``
bytes, a job's file its first ``job_output_cap`` bytes, and the rest is read and dropped.

A job is ``exited`` (main process returned a code) or ``killed`` (main process ended by a signal,
normally a DELETE). It only leaves ``running`` once its output is complete, so a reader that sees
an ended job and reaches ``output_bytes`` has everything. Jobs live in this process's memory and
keep running whether or not anybody is connected; they do not survive the service itself, which
kills them when it stops.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import enum
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from fleet_sim.sandbox_notify import NotifyTarget

log = logging.getLogger(__name__)

NAME_RE: Final = re.compile(r"[A-Za-z0-9_.-]{1,128}")
JOB_ID_RE: Final = re.compile(r"j[0-9a-f]{16}")
_READ_CHUNK: Final = 64 * 1024
_BASE_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def valid_sandbox_name(name: str) -> bool:
    # "." and ".." match the alphabet but would name the root or its parent.
    return bool(NAME_RE.fullmatch(name)) and name not in (".", "..")


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """Bounds for what one sandbox may hold or produce."""

    foreground_output_cap: int = 256 * 1024
    job_output_cap: int = 16 * 1024 * 1024
    max_running_jobs: int = 32
    max_kept_jobs: int = 256
    """Ended jobs kept for reading back; the oldest ended one is forgotten first."""
    straggler_grace_s: float = 0.5
    """How long a pipe may stay open after the main process ended before the group is cut."""
    kill_wait_s: float = 5.0
    bash: str = field(default_factory=lambda: shutil.which("bash") or "/bin/bash")

    def __post_init__(self) -> None:
        if self.foreground_output_cap < 1 or self.job_output_cap < 1:
            raise ValueError("output caps must be positive")
        if self.max_running_jobs < 1 or self.max_kept_jobs < 1:
            raise ValueError("job limits must be positive")
        if self.straggler_grace_s < 0 or self.kill_wait_s <= 0:
            raise ValueError("grace periods must not be negative")


class SandboxRequestError(Exception):
    """A request this sandbox refuses; ``status`` is the HTTP status that says why."""

    status = 400


class JobNotFound(SandboxRequestError):
    status = 404


class TooManyJobs(SandboxRequestError):
    status = 429


class ServiceStopping(SandboxRequestError):
    """The service is stopping or full; another try later (or elsewhere) may succeed."""

    status = 503


class JobStatus(enum.StrEnum):
    RUNNING = "running"
    EXITED = "exited"
    KILLED = "killed"


@dataclass(frozen=True, slots=True)
class ExecOutcome:
    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    truncated: bool
    timed_out: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code,
            "signal": self.signal,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "truncated": self.truncated,
            "timed_out": self.timed_out,
        }


@dataclass(frozen=True, slots=True)
class OutputChunk:
    data: str
    offset: int
    next_offset: int
    eof: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "data": self.data,
            "offset": self.offset,
            "next_offset": self.next_offset,
            "eof": self.eof,
        }


@dataclass(slots=True)
class Job:
    """A background job. Mutated only by the sandbox that runs it, on the event loop."""

    job_id: str
    command: str
    pid: int
    started_at: float
    output_path: Path
    notify: NotifyTarget | None = field(repr=False)
    status: JobStatus = JobStatus.RUNNING
    exit_code: int | None = None
    signal: int | None = None
    ended_at: float | None = None
    output_bytes: int = 0
    output_truncated: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "command": self.command,
            "status": str(self.status),
            "exit_code": self.exit_code,
            "signal": self.signal,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "output_bytes": self.output_bytes,
            "output_truncated": self.output_truncated,
        }

    def finish(self, returncode: int) -> None:
        if returncode < 0:
            self.status, self.signal = JobStatus.KILLED, -returncode
        else:
            self.status, self.exit_code = JobStatus.EXITED, returncode
        self.ended_at = time.time()
        self.ended.set()


def decode_prefix(data: bytes, *, final: bool) -> tuple[str, int]:
    """Decode ``data`` as UTF-8 without splitting a character; returns text and bytes used.

    A character cut at the end of ``data`` is left for the next read, so offsets stay exact and
    a reader paging through the file never sees a replacement where the text is valid. Bytes
    that are invalid anyway are replaced.
    """
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    text = decoder.decode(data, final=final)
    used = len(data) - len(decoder.getstate()[0])
    return text, used


def _killpg(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class _PipeReader:
    """Reads a non-blocking pipe on the event loop and hands each chunk to ``sink``."""

    def __init__(self, fd: int, sink: Callable[[bytes], None]) -> None:
        self._fd = fd
        self._sink = sink
        self._loop = asyncio.get_running_loop()
        self.done: asyncio.Future[None] = self._loop.create_future()
        os.set_blocking(fd, False)
        self._loop.add_reader(fd, self._readable)

    def _readable(self) -> None:
        try:
            data = os.read(self._fd, _READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            self._sink(data)
        else:
            self.close()

    def close(self) -> None:
        if self._fd < 0:
            return
        self._loop.remove_reader(self._fd)
        os.close(self._fd)
        self._fd = -1
        if not self.done.done():
            self.done.set_result(None)


class _Capture:
    """Keeps the first ``cap`` bytes of a stream and counts the rest."""

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self.data = bytearray()
        self.truncated = False

    def feed(self, chunk: bytes) -> None:
        room = self._cap - len(self.data)
        if len(chunk) > room:
            self.truncated = True
            chunk = chunk[: max(room, 0)]
        self.data += chunk


class _JobOutput:
    """Appends a job's output to its file, up to the cap, and keeps the job's counters."""

    def __init__(self, fd: int, cap: int, job: Job) -> None:
        self._fd = fd
        self._cap = cap
        self._job = job

    def feed(self, chunk: bytes) -> None:
        room = self._cap - self._job.output_bytes
        if len(chunk) > room:
            self._job.output_truncated = True
            chunk = chunk[: max(room, 0)]
        view = memoryview(chunk)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
            self._job.output_bytes += written

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


async def _drain(readers: Iterable[_PipeReader], grace_s: float) -> None:
    readers = list(readers)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(grace_s):
            await asyncio.gather(*(reader.done for reader in readers))
    for reader in readers:
        reader.close()


class Sandbox:
    """The workspace, foreground commands and jobs of one sandbox name."""

    def __init__(
        self,
        name: str,
        root: Path,
        limits: SandboxLimits,
        on_job_end: Callable[[Sandbox, Job], None],
    ) -> None:
        if not valid_sandbox_name(name):
            raise ValueError("not a sandbox name")
        self.name = name
        self.workspace = root / name / "workspace"
        self.state_dir = root / name / "state"
        self._limits = limits
        self._on_job_end = on_job_end
        self._jobs: dict[str, Job] = {}
        self._watchers: set[asyncio.Task[None]] = set()
        self._foreground: set[int] = set()
        self._closing = False
        for directory in (self.workspace, self.state_dir / "jobs"):
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)

    # --- processes ---

    def _env(self) -> dict[str, str]:
        workspace = str(self.workspace)
        return {
            "PATH": _BASE_PATH,
            "HOME": workspace,
            "PWD": workspace,
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "SHELL": self._limits.bash,
            "SANDBOX_NAME": self.name,
        }

    async def _spawn(self, command: str, stdout: int, stderr: int) -> asyncio.subprocess.Process:
        if self._closing:
            raise ServiceStopping("the sandbox service is shutting down")
        return await asyncio.create_subprocess_exec(
            self._limits.bash,
            "-c",
            command,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            cwd=self.workspace,
            env=self._env(),
            start_new_session=True,
        )

    async def run(self, command: str, timeout_s: float) -> ExecOutcome:
        """Run ``command`` to completion or ``timeout_s``, whichever is first."""
        out, err = (
            _Capture(self._limits.foreground_output_cap),
            _Capture(self._limits.foreground_output_cap),
        )
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            process = await self._spawn(command, out_w, err_w)
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        readers = (_PipeReader(out_r, out.feed), _PipeReader(err_r, err.feed))
        self._foreground.add(process.pid)
        timed_out = False
        try:
            try:
                async with asyncio.timeout(timeout_s):
                    await process.wait()
            except TimeoutError:
                timed_out = True
            _killpg(process.pid)
            returncode = await process.wait()
            await _drain(readers, self._limits.straggler_grace_s)
        finally:
            # Reached early only on cancellation (the service stopping): nothing may be left.
            _killpg(process.pid)
            for reader in readers:
                reader.close()
            self._foreground.discard(process.pid)
        killed = timed_out or returncode < 0
        return ExecOutcome(
            exit_code=None if killed else returncode,
            signal=-returncode if returncode < 0 else None,
            stdout=out.data.decode("utf-8", "replace"),
            stderr=err.data.decode("utf-8", "replace"),
            truncated=out.truncated or err.truncated,
            timed_out=timed_out,
        )

    async def start_job(self, command: str, notify: NotifyTarget | None) -> Job:
        running = self.running_jobs
        if running >= self._limits.max_running_jobs:
            raise TooManyJobs(
                f"this sandbox already runs {running} jobs; end one before starting another"
            )
        job_id = "j" + secrets.token_hex(8)
        path = self.state_dir / "jobs" / f"{job_id}.out"
        out_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            read_fd, write_fd = os.pipe()
        except BaseException:
            os.close(out_fd)
            raise
        try:
            process = await self._spawn(command, write_fd, write_fd)
        except BaseException:
            os.close(read_fd)
            os.close(out_fd)
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(write_fd)
        job = Job(
            job_id=job_id,
            command=command,
            pid=process.pid,
            started_at=time.time(),
            output_path=path,
            notify=notify,
        )
        sink = _JobOutput(out_fd, self._limits.job_output_cap, job)
        reader = _PipeReader(read_fd, sink.feed)
        self._jobs[job_id] = job
        watcher = asyncio.get_running_loop().create_task(
            self._watch(job, process, reader, sink), name=f"job {self.name}/{job_id}"
        )
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watcher_done)
        log.info("sandbox %s started job %s (pid %d)", self.name, job_id, process.pid)
        return job

    async def _watch(
        self,
        job: Job,
        process: asyncio.subprocess.Process,
        reader: _PipeReader,
        sink: _JobOutput,
    ) -> None:
        try:
            returncode = await process.wait()
            _killpg(process.pid)
            await _drain((reader,), self._limits.straggler_grace_s)
        finally:
            _killpg(process.pid)
            reader.close()
            sink.close()
        job.finish(returncode)
        log.info("sandbox %s job %s ended: %s", self.name, job.job_id, job.status)
        self._forget_old_jobs()
        self._on_job_end(self, job)

    def _watcher_done(self, task: asyncio.Task[None]) -> None:
        self._watchers.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed", task.get_name(), exc_info=task.exception())

    def _forget_old_jobs(self) -> None:
        ended = [job for job in self._jobs.values() if job.status is not JobStatus.RUNNING]
        for job in ended[: max(0, len(ended) - self._limits.max_kept_jobs)]:
            del self._jobs[job.job_id]
            job.output_path.unlink(missing_ok=True)

    # --- queries ---

    def jobs(self) -> list[Job]:
        return list(self._jobs.values())

    @property
    def running_jobs(self) -> int:
        return sum(1 for job in self._jobs.values() if job.status is JobStatus.RUNNING)

    def job(self, job_id: str) -> Job:
        job = self._jobs.get(job_id) if JOB_ID_RE.fullmatch(job_id) else None
        if job is None:
            raise JobNotFound(f"no job {job_id!r} in this sandbox")
        return job

    def read_output(self, job_id: str, offset: int, limit: int) -> OutputChunk:
        job = self.job(job_id)
        # Both read before touching the file: a job is marked ended only once its output is final.
        ended = job.status is not JobStatus.RUNNING
        size = job.output_bytes
        data = b""
        if offset < size:
            with job.output_path.open("rb") as handle:
                handle.seek(offset)
                data = handle.read(min(limit, size - offset))
        at_end = offset + len(data) >= size
        text, used = decode_prefix(data, final=ended and at_end)
        if used == 0 and data and len(data) >= limit:
            # The limit is smaller than one character: give the bytes up rather than stall.
            text, used = data.decode("utf-8", "replace"), len(data)
        next_offset = offset + used
        return OutputChunk(
            data=text, offset=offset, next_offset=next_offset, eof=ended and next_offset >= size
        )

    # --- ending ---

    async def kill(self, job_id: str) -> Job:
        """Kill a job's process group and wait (bounded) until it is recorded as ended."""
        job = self.job(job_id)
        if job.status is JobStatus.RUNNING:
            _killpg(job.pid)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._limits.kill_wait_s):
                    await job.ended.wait()
        return job

    async def close(self) -> None:
        """Kill every process this sandbox started and wait for the watchers to record it."""
        self._closing = True
        for job in self._jobs.values():
            if job.status is JobStatus.RUNNING:
                _killpg(job.pid)
        for pid in list(self._foreground):
            _killpg(pid)
        watchers = list(self._watchers)
        if watchers:
            _, pending = await asyncio.wait(watchers, timeout=self._limits.kill_wait_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
