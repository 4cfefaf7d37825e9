"""The agent's tools, run in the session's sandbox through its exec URL.

``bash`` runs a command in the foreground, or starts it as a background job that belongs to the
sandbox (it outlives this replica); ``job_output`` reads a job's output on from an offset; ``jobs``
lists the sandbox's jobs. Results go back to the model as text, bounded in size.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from replica.errors import ReplicaError
from replica.model_types import ToolCall, ToolSpec

MAX_RESULT_CHARS = 16 * 1024
DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 600.0
OUTPUT_READ_BYTES = 16 * 1024

TOOL_SPECS: tuple[ToolSpec, ...] = (
    ToolSpec(
        "bash",
        "Run a shell command in the workspace. With background=true it starts a job that keeps "
        "running; its end is reported to you later, and job_output reads what it printed.",
        {
            "type": "object",
            "properties": {
                "command": {"type": "string"},
                "background": {"type": "boolean"},
                "timeout_s": {"type": "number"},
            },
            "required": ["command"],
        },
    ),
    ToolSpec(
        "job_output",
        "Read a background job's output from a byte offset (default: where you left off).",
        {
            "type": "object",
            "properties": {"job_id": {"type": "string"}, "offset": {"type": "integer"}},
            "required": ["job_id"],
        },
    ),
    ToolSpec("jobs", "List the sandbox's background jobs.", {"type": "object", "properties": {}}),
)


class Sandbox(Protocol):
    """What the tools need of a sandbox; ``replica.sandbox_client.SandboxClient`` provides it."""

    async def exec(self, command: str, timeout_s: float) -> Any: ...

    async def start_job(
        self, command: str, notify_url: str | None, notify_token: str | None
    ) -> Any: ...

    async def jobs(self) -> Any: ...

    async def job_output(self, job_id: str, offset: int, limit: int) -> Any: ...

    async def kill(self, job_id: str) -> Any: ...


@dataclass(frozen=True, slots=True)
class ToolResult:
    content: str
    extra: Mapping[str, Any] = field(default_factory=dict)
    is_error: bool = False


@dataclass(frozen=True, slots=True)
class NotifyTarget:
    """Where the sandbox calls back when a background job ends; the token is secret."""

    url: str
    token: str = field(repr=False)


def _clip(text: str) -> str:
    if len(text) <= MAX_RESULT_CHARS:
        return text
    return text[:MAX_RESULT_CHARS] + f"\n[... {len(text) - MAX_RESULT_CHARS} more characters]"


def _arguments(call: ToolCall) -> dict[str, Any]:
    try:
        args = json.loads(call.arguments or "{}")
    except ValueError:
        raise ValueError("tool arguments are not valid JSON") from None
    if not isinstance(args, dict):
        raise ValueError("tool arguments must be a JSON object")
    return args


async def run_tool(
    sandbox: Sandbox,
    call: ToolCall,
    *,
    notify: Callable[[], NotifyTarget | None],
    read_offsets: dict[str, int],
) -> ToolResult:
    """Run one tool call. ``read_offsets`` holds, per job, how far the model has read, so
    ``job_output`` without an offset continues where it left off (kept in the transcript)."""
    try:
        args = _arguments(call)
        if call.name == "bash":
            return await _bash(sandbox, args, notify)
        if call.name == "job_output":
            return await _job_output(sandbox, args, read_offsets)
        if call.name == "jobs":
            listing = await sandbox.jobs()
            lines = [f"{j.job_id} {j.status} exit={j.exit_code} {j.command}" for j in listing]
            return ToolResult("\n".join(lines) or "no jobs")
        return ToolResult(f"unknown tool {call.name!r}", is_error=True)
    except (ValueError, ReplicaError) as exc:
        return ToolResult(f"tool failed: {exc}", is_error=True)


async def _bash(
    sandbox: Sandbox, args: dict[str, Any], notify_for: Callable[[], NotifyTarget | None]
) -> ToolResult:
    command = args.get("command")
    if not isinstance(command, str) or not command.strip():
        raise ValueError("bash needs a non-empty 'command'")
    if args.get("background") is True:
        notify = notify_for()
        job = await sandbox.start_job(
            command, notify.url if notify else None, notify.token if notify else None
        )
        return ToolResult(
            f"started background job {job.job_id}", {"job_id": job.job_id, "background": True}
        )
    timeout = args.get("timeout_s", DEFAULT_TIMEOUT_S)
    if (
        not isinstance(timeout, int | float)
        or isinstance(timeout, bool)
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise ValueError("'timeout_s' must be a positive number")
    result = await sandbox.exec(command, min(float(timeout), MAX_TIMEOUT_S))
    text = result.stdout + (("\n[stderr]\n" + result.stderr) if result.stderr else "")
    status = "timed out" if result.timed_out else f"exit status {result.exit_code}"
    return ToolResult(_clip(text) + f"\n[{status}]", {"exit_code": result.exit_code})


async def _job_output(
    sandbox: Sandbox, args: dict[str, Any], read_offsets: dict[str, int]
) -> ToolResult:
    job_id = args.get("job_id")
    if not isinstance(job_id, str) or not job_id:
        raise ValueError("job_output needs a 'job_id'")
    offset = args.get("offset", read_offsets.get(job_id, 0))
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise ValueError("'offset' must be a non-negative integer")
    output = await sandbox.job_output(job_id, offset, OUTPUT_READ_BYTES)
    read_offsets[job_id] = output.next_offset
    tail = " (job ended, end of output)" if output.eof else ""
    return ToolResult(
        _clip(output.data) + f"\n[read {offset}-{output.next_offset}{tail}]",
        {"job_id": job_id, "next_offset": output.next_offset},
    )
