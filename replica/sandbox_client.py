"""The replica's client for a session's sandbox exec endpoint.

A session's grant names an exec URL and carries sealed exec headers; every tool call of a turn
goes through them. The protocol (relative to the exec URL) is ``POST /exec`` for a foreground
command or a background job, ``GET /jobs``, ``GET /jobs/{id}``, ``GET /jobs/{id}/output`` and
``DELETE /jobs/{id}``; :mod:`fleet_sim.sandbox` is a complete implementation of the other side.

One ``httpx.AsyncClient`` is meant to be shared by every session of a replica (pass it in; see
:func:`new_http_client`), so connections to a sandbox service are pooled across sessions. Every
request has bounded timeouts; a foreground command's read timeout is its own timeout plus a
margin, since the answer only comes when the command ends.

Errors (all :class:`SandboxError`, itself a :class:`~replica.errors.ReplicaError`)::

    SandboxError
    ├── SandboxUnauthorized   401/403: the exec headers are not this sandbox's
    ├── SandboxNotFound       404: no such sandbox or job
    ├── SandboxBadRequest     400, 413 and other 4xx: the request itself is wrong
    ├── SandboxUnavailable    503, 429, other 5xx, connection failures: try again later
    │   └── SandboxTimeout    no answer within the request's timeout
    └── SandboxProtocolError  an answer that is not the protocol's shape

Messages name the operation and the status and quote at most a short, sanitised part of the
service's own error text, with the exec header values removed; they never carry the headers,
so they are safe to log.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote

import httpx

from replica.errors import ReplicaError

DEFAULT_EXEC_TIMEOUT_S: Final = 60.0
MAX_EXEC_TIMEOUT_S: Final = 600.0
_JOB_ID: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")
_MAX_QUOTED: Final = 200
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]+")


class SandboxError(ReplicaError):
    """Base of every sandbox exec failure. ``status`` is the HTTP status when there was one."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class SandboxUnauthorized(SandboxError):
    pass


class SandboxNotFound(SandboxError):
    pass


class SandboxBadRequest(SandboxError):
    pass


class SandboxUnavailable(SandboxError):
    pass


class SandboxTimeout(SandboxUnavailable):
    pass


class SandboxProtocolError(SandboxError):
    pass


@dataclass(frozen=True, slots=True)
class SandboxTimeouts:
    """Bounds on every request; a foreground command adds its own timeout to ``read_s``."""

    connect_s: float = 5.0
    read_s: float = 15.0
    write_s: float = 10.0
    pool_s: float = 5.0

    def __post_init__(self) -> None:
        if min(self.connect_s, self.read_s, self.write_s, self.pool_s) <= 0:
            raise ValueError("sandbox timeouts must be positive")

    def httpx(self, extra_read_s: float = 0.0) -> httpx.Timeout:
        return httpx.Timeout(
            connect=self.connect_s,
            read=self.read_s + extra_read_s,
            write=self.write_s,
            pool=self.pool_s,
        )


class JobStatus(enum.StrEnum):
    RUNNING = "running"
    EXITED = "exited"
    KILLED = "killed"


@dataclass(frozen=True, slots=True)
class ExecResult:
    exit_code: int | None
    stdout: str
    stderr: str
    truncated: bool
    timed_out: bool


@dataclass(frozen=True, slots=True)
class JobInfo:
    job_id: str
    command: str
    status: JobStatus
    exit_code: int | None
    started_at: float
    ended_at: float | None
    output_bytes: int

    @property
    def running(self) -> bool:
        return self.status is JobStatus.RUNNING


@dataclass(frozen=True, slots=True)
class JobOutput:
    data: str
    offset: int
    next_offset: int
    eof: bool


def new_http_client(*, max_connections: int = 256) -> httpx.AsyncClient:
    """The pooled client a replica shares across its sessions' sandbox clients."""
    return httpx.AsyncClient(
        timeout=SandboxTimeouts().httpx(),
        limits=httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections // 4
        ),
        # Exec headers must never follow a redirect to another origin, nor go through a proxy
        # picked up from the environment.
        follow_redirects=False,
        trust_env=False,
    )


def _error_for(status: int, message: str) -> SandboxError:
    if status in (401, 403):
        return SandboxUnauthorized(message, status=status)
    if status == 404:
        return SandboxNotFound(message, status=status)
    if status in (408, 425, 429) or status >= 500:
        return SandboxUnavailable(message, status=status)
    if 400 <= status < 500:
        return SandboxBadRequest(message, status=status)
    return SandboxProtocolError(message, status=status)


class _Shape:
    """Field readers for a decoded answer; any mismatch is a :class:`SandboxProtocolError`."""

    def __init__(self, what: str, value: object) -> None:
        if not isinstance(value, dict):
            raise SandboxProtocolError(f"sandbox {what}: the answer is not a JSON object")
        self._what = what
        self._value: dict[str, Any] = value

    def _bad(self, key: str, expected: str) -> SandboxProtocolError:
        return SandboxProtocolError(f"sandbox {self._what}: '{key}' is not {expected}")

    def str_(self, key: str) -> str:
        value = self._value.get(key)
        if not isinstance(value, str):
            raise self._bad(key, "a string")
        return value

    def bool_(self, key: str) -> bool:
        value = self._value.get(key)
        if not isinstance(value, bool):
            raise self._bad(key, "a boolean")
        return value

    def int_(self, key: str) -> int:
        value = self._value.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(key, "an integer")
        return value

    def opt_int(self, key: str) -> int | None:
        return None if self._value.get(key) is None else self.int_(key)

    def count(self, key: str) -> int:
        value = self.int_(key)
        if value < 0:
            raise self._bad(key, "a non-negative integer")
        return value

    def time(self, key: str) -> float:
        value = self._value.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._bad(key, "a number")
        if not math.isfinite(value):
            raise self._bad(key, "a finite number")
        return float(value)

    def opt_time(self, key: str) -> float | None:
        return None if self._value.get(key) is None else self.time(key)

    def list_(self, key: str) -> list[Any]:
        value = self._value.get(key)
        if not isinstance(value, list):
            raise self._bad(key, "a list")
        return value


def _job_info(what: str, value: object) -> JobInfo:
    shape = _Shape(what, value)
    status_text = shape.str_("status")
    try:
        status = JobStatus(status_text)
    except ValueError:
        raise SandboxProtocolError(f"sandbox {what}: unknown job status") from None
    return JobInfo(
        job_id=shape.str_("job_id"),
        command=shape.str_("command"),
        status=status,
        exit_code=shape.opt_int("exit_code"),
        started_at=shape.time("started_at"),
        ended_at=shape.opt_time("ended_at"),
        output_bytes=shape.count("output_bytes"),
    )


class SandboxClient:
    """Talks to one sandbox through its exec URL and exec headers.

    ``http`` is normally the replica's shared client; without one, this object creates its own
    and closes it in :meth:`aclose`.
    """

    def __init__(
        self,
        exec_url: str,
        headers: Mapping[str, str] | Iterable[tuple[str, str]],
        *,
        http: httpx.AsyncClient | None = None,
        timeouts: SandboxTimeouts | None = None,
    ) -> None:
        self._base = exec_url.rstrip("/")
        pairs = headers.items() if isinstance(headers, Mapping) else headers
        self._headers: dict[str, str] = dict(pairs)
        # Longest first, so a value that contains another is removed whole.
        self._secrets = sorted(
            (value for value in self._headers.values() if value), key=len, reverse=True
        )
        self._timeouts = timeouts or SandboxTimeouts()
        self._own_http = http is None
        self._http = http if http is not None else new_http_client(max_connections=16)

    def __repr__(self) -> str:
        return f"SandboxClient({self._base!r}, headers=<{len(self._headers)} hidden>)"

    async def aclose(self) -> None:
        if self._own_http:
            await self._http.aclose()

    async def __aenter__(self) -> SandboxClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()

    # --- operations ---

    async def exec(self, command: str, timeout_s: float = DEFAULT_EXEC_TIMEOUT_S) -> ExecResult:
        """Run ``command`` in the foreground; a timed-out command is a result, not an error."""
        if not 0 < timeout_s <= MAX_EXEC_TIMEOUT_S:
            raise SandboxBadRequest(f"timeout_s must be in (0, {MAX_EXEC_TIMEOUT_S:g}]")
        # The answer comes only when the command has ended (or been killed at its timeout).
        limits = self._timeouts.httpx(extra_read_s=timeout_s)
        body = {"command": command, "timeout_s": timeout_s, "background": False}
        shape = _Shape("exec", await self._call("exec", "POST", "/exec", body, limits))
        return ExecResult(
            exit_code=shape.opt_int("exit_code"),
            stdout=shape.str_("stdout"),
            stderr=shape.str_("stderr"),
            truncated=shape.bool_("truncated"),
            timed_out=shape.bool_("timed_out"),
        )

    async def start_job(
        self, command: str, notify_url: str | None = None, notify_token: str | None = None
    ) -> JobInfo:
        """Start ``command`` as a background job; its end is POSTed to ``notify_url`` if given."""
        if (notify_url is None) != (notify_token is None):
            raise SandboxBadRequest("notify_url and notify_token go together")
        notify = None if notify_url is None else {"url": notify_url, "token": notify_token}
        body = {"command": command, "background": True, "notify": notify}
        return _job_info("start job", await self._call("start job", "POST", "/exec", body))

    async def jobs(self) -> list[JobInfo]:
        shape = _Shape("jobs", await self._call("jobs", "GET", "/jobs"))
        return [_job_info("jobs", item) for item in shape.list_("jobs")]

    async def job(self, job_id: str) -> JobInfo:
        return _job_info("job", await self._call("job", "GET", self._job_path(job_id)))

    async def job_output(self, job_id: str, offset: int = 0, limit: int = 64 * 1024) -> JobOutput:
        if offset < 0 or limit < 1:
            raise SandboxBadRequest("offset must be >= 0 and limit >= 1")
        path = f"{self._job_path(job_id)}/output?offset={offset}&limit={limit}"
        shape = _Shape("job output", await self._call("job output", "GET", path))
        answer = JobOutput(
            data=shape.str_("data"),
            offset=shape.count("offset"),
            next_offset=shape.count("next_offset"),
            eof=shape.bool_("eof"),
        )
        if answer.offset != offset or answer.next_offset < offset:
            raise SandboxProtocolError("sandbox job output: offsets do not match the request")
        return answer

    async def kill(self, job_id: str) -> JobInfo:
        return _job_info("kill", await self._call("kill", "DELETE", self._job_path(job_id)))

    # --- plumbing ---

    @staticmethod
    def _job_path(job_id: str) -> str:
        if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id):
            raise SandboxBadRequest("not a job id")
        return f"/jobs/{quote(job_id, safe='')}"

    def _redact(self, text: str) -> str:
        for value in self._secrets:
            text = text.replace(value, "[redacted]")
        text = _CONTROL.sub(" ", text).strip()
        return text[:_MAX_QUOTED] + ("..." if len(text) > _MAX_QUOTED else "")

    async def _call(
        self,
        what: str,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        limits: httpx.Timeout | None = None,
    ) -> object:
        try:
            response = await self._http.request(
                method,
                self._base + path,
                json=body,
                headers=self._headers,
                timeout=limits or self._timeouts.httpx(),
            )
        except httpx.TimeoutException as exc:
            raise SandboxTimeout(
                f"sandbox {what}: no answer in time ({type(exc).__name__})"
            ) from None
        except httpx.HTTPError as exc:
            raise SandboxUnavailable(
                f"sandbox {what}: request failed ({type(exc).__name__})"
            ) from None
        if response.status_code in (200, 201):
            try:
                return response.json()
            except ValueError:
                raise SandboxProtocolError(f"sandbox {what}: the answer is not JSON") from None
        raise _error_for(response.status_code, self._refusal(what, response))

    def _refusal(self, what: str, response: httpx.Response) -> str:
        detail = ""
        try:
            document = response.json()
        except ValueError:
            document = None
        if isinstance(document, dict) and isinstance(document.get("error"), str):
            detail = self._redact(document["error"])
        message = f"sandbox {what}: answered {response.status_code}"
        return f"{message}: {detail}" if detail else message


__all__ = [
    "ExecResult",
    "JobInfo",
    "JobOutput",
    "JobStatus",
    "SandboxBadRequest",
    "SandboxClient",
    "SandboxError",
    "SandboxNotFound",
    "SandboxProtocolError",
    "SandboxTimeout",
    "SandboxTimeouts",
    "SandboxUnauthorized",
    "SandboxUnavailable",
    "new_http_client",
]
