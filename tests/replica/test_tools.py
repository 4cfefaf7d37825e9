from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from replica.errors import ReplicaError
from replica.model_types import ToolCall
from replica.tools import (
    DEFAULT_TIMEOUT_S,
    MAX_RESULT_CHARS,
    MAX_TIMEOUT_S,
    OUTPUT_READ_BYTES,
    TOOL_SPECS,
    NotifyTarget,
    ToolResult,
    run_tool,
)

pytestmark = pytest.mark.anyio
NOTIFY = NotifyTarget("http://127.0.0.1:9/_beyond/agent", "bjn_v1.secret.mac")


@dataclass
class Exec:
    stdout: str
    stderr: str = ""
    exit_code: int | None = 0
    timed_out: bool = False


@dataclass
class Job:
    job_id: str
    command: str = ""
    status: str = "running"
    exit_code: int | None = None


@dataclass
class Output:
    data: str
    next_offset: int
    eof: bool = False


@dataclass
class FakeSandbox:
    """The ``Sandbox`` protocol over an in-memory job table; records every call it gets."""

    result: Exec = field(default_factory=lambda: Exec("hello\n"))
    outputs: dict[str, str] = field(default_factory=dict)
    listing: list[Job] = field(default_factory=list)
    failure: ReplicaError | None = None
    calls: list[tuple[Any, ...]] = field(default_factory=list)

    async def exec(self, command: str, timeout_s: float) -> Exec:
        self.calls.append(("exec", command, timeout_s))
        if self.failure is not None:
            raise self.failure
        return self.result

    async def start_job(
        self, command: str, notify_url: str | None, notify_token: str | None
    ) -> Job:
        self.calls.append(("start_job", command, notify_url, notify_token))
        return Job("j7", command)

    async def jobs(self) -> list[Job]:
        self.calls.append(("jobs",))
        return self.listing

    async def job_output(self, job_id: str, offset: int, limit: int) -> Output:
        self.calls.append(("job_output", job_id, offset, limit))
        data = self.outputs[job_id]
        chunk = data[offset : offset + limit]
        end = offset + len(chunk)
        return Output(chunk, end, eof=end >= len(data))

    async def kill(self, job_id: str) -> Any:
        raise AssertionError("a turn never kills a job")


async def call(
    sandbox: FakeSandbox,
    name: str,
    arguments: Any,
    offsets: dict[str, int] | None = None,
    notify: NotifyTarget | None = NOTIFY,
) -> ToolResult:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)

    def mint() -> NotifyTarget | None:
        sandbox.calls.append(("mint",))
        return notify

    return await run_tool(
        sandbox,
        ToolCall("c1", name, text),
        notify=mint,
        read_offsets={} if offsets is None else offsets,
    )


def test_specs_name_the_three_tools() -> None:
    assert [s.name for s in TOOL_SPECS] == ["bash", "job_output", "jobs"]
    assert TOOL_SPECS[0].parameters["required"] == ["command"]


async def test_bash_foreground() -> None:
    sandbox = FakeSandbox()
    result = await call(sandbox, "bash", {"command": "echo hello"})
    assert result == ToolResult("hello\n\n[exit status 0]", {"exit_code": 0})
    assert sandbox.calls == [("exec", "echo hello", DEFAULT_TIMEOUT_S)]
    sandbox.result = Exec("partial", "boom", exit_code=None, timed_out=True)
    result = await call(sandbox, "bash", {"command": "sleep 9", "timeout_s": 2})
    assert result.content == "partial\n[stderr]\nboom\n[timed out]" and not result.is_error
    assert result.extra == {"exit_code": None}
    await call(sandbox, "bash", {"command": "x", "timeout_s": 10_000})
    await call(sandbox, "bash", {"command": "x", "timeout_s": 0.5})
    assert [c[2] for c in sandbox.calls[1:]] == [2.0, MAX_TIMEOUT_S, 0.5]
    sandbox.result = Exec("", exit_code=3)
    assert (await call(sandbox, "bash", {"command": "false"})).content == "\n[exit status 3]"


async def test_bash_background_passes_the_notify_target() -> None:
    sandbox = FakeSandbox()
    result = await call(sandbox, "bash", {"command": "./serve", "background": True})
    assert result == ToolResult("started background job j7", {"job_id": "j7", "background": True})
    # A notify token is minted for a job that is started, and only then.
    assert sandbox.calls == [("mint",), ("start_job", "./serve", NOTIFY.url, NOTIFY.token)]
    assert NOTIFY.token not in result.content
    await call(sandbox, "bash", {"command": "./serve", "background": True}, notify=None)
    # Only a literal true starts a job: anything else runs in the foreground.
    await call(sandbox, "bash", {"command": "ls", "background": "yes"})
    assert sandbox.calls[2:] == [
        ("mint",),
        ("start_job", "./serve", None, None),
        ("exec", "ls", 60.0),
    ]


async def test_job_output_continues_from_the_remembered_offset() -> None:
    sandbox = FakeSandbox(outputs={"j1": "a" * OUTPUT_READ_BYTES + "tail", "j2": "other"})
    offsets: dict[str, int] = {}
    first = await call(sandbox, "job_output", {"job_id": "j1"}, offsets)
    assert first.content.endswith(f"\n[read 0-{OUTPUT_READ_BYTES}]")
    assert first.extra == {"job_id": "j1", "next_offset": OUTPUT_READ_BYTES}
    assert offsets == {"j1": OUTPUT_READ_BYTES}
    second = await call(sandbox, "job_output", {"job_id": "j1"}, offsets)
    end = OUTPUT_READ_BYTES + 4
    assert second.content == f"tail\n[read {OUTPUT_READ_BYTES}-{end} (job ended, end of output)]"
    assert offsets == {"j1": end}
    await call(sandbox, "job_output", {"job_id": "j2"}, offsets)  # each job has its own place
    assert offsets == {"j1": end, "j2": 5}
    again = await call(sandbox, "job_output", {"job_id": "j1", "offset": 2}, offsets)
    assert again.extra["next_offset"] == OUTPUT_READ_BYTES + 2
    reads = [c[1:] for c in sandbox.calls]
    assert reads == [
        ("j1", 0, OUTPUT_READ_BYTES),
        ("j1", OUTPUT_READ_BYTES, OUTPUT_READ_BYTES),
        ("j2", 0, OUTPUT_READ_BYTES),
        ("j1", 2, OUTPUT_READ_BYTES),
    ]


async def test_jobs_listing() -> None:
    sandbox = FakeSandbox()
    assert (await call(sandbox, "jobs", {})).content == "no jobs"
    sandbox.listing = [Job("j1", "make", "exited", 0), Job("j2", "serve", "running", None)]
    listed = await call(sandbox, "jobs", "")
    assert listed.content == "j1 exited exit=0 make\nj2 running exit=None serve"


@pytest.mark.parametrize(
    ("name", "arguments", "complaint"),
    [
        ("bash", "{not json", "not valid JSON"),
        ("bash", "[]", "must be a JSON object"),
        ("bash", '"ls"', "must be a JSON object"),
        ("bash", "", "non-empty 'command'"),
        ("bash", {"command": "   "}, "non-empty 'command'"),
        ("bash", {"command": ["ls"]}, "non-empty 'command'"),
        ("bash", {"command": "ls", "timeout_s": 0}, "'timeout_s'"),
        ("bash", {"command": "ls", "timeout_s": -1}, "'timeout_s'"),
        ("bash", {"command": "ls", "timeout_s": True}, "'timeout_s'"),
        ("bash", {"command": "ls", "timeout_s": "5"}, "'timeout_s'"),
        ("job_output", {}, "'job_id'"),
        ("job_output", {"job_id": ""}, "'job_id'"),
        ("job_output", {"job_id": 3}, "'job_id'"),
        ("job_output", {"job_id": "j1", "offset": -1}, "'offset'"),
        ("job_output", {"job_id": "j1", "offset": True}, "'offset'"),
        ("job_output", {"job_id": "j1", "offset": 1.5}, "'offset'"),
        ("rm_rf", {}, "unknown tool 'rm_rf'"),
    ],
)
async def test_bad_arguments_are_error_results(name: str, arguments: Any, complaint: str) -> None:
    sandbox = FakeSandbox(outputs={"j1": "x"})
    result = await call(sandbox, name, arguments)
    assert result.is_error and complaint in result.content
    assert sandbox.calls == []  # nothing reached the sandbox


async def test_nan_timeout_is_an_error_result() -> None:
    sandbox = FakeSandbox()
    result = await call(sandbox, "bash", '{"command": "ls", "timeout_s": NaN}')
    assert result.is_error and sandbox.calls == []


async def test_sandbox_refusals_become_error_results() -> None:
    sandbox = FakeSandbox(failure=ReplicaError("sandbox answered 503"))
    result = await call(sandbox, "bash", {"command": "ls"})
    assert result == ToolResult("tool failed: sandbox answered 503", is_error=True)


async def test_output_is_clipped() -> None:
    sandbox = FakeSandbox(result=Exec("x" * (MAX_RESULT_CHARS + 100)))
    result = await call(sandbox, "bash", {"command": "yes"})
    assert result.content == "x" * MAX_RESULT_CHARS + "\n[... 100 more characters]\n[exit status 0]"
    exact = FakeSandbox(result=Exec("y" * MAX_RESULT_CHARS))
    assert "more characters" not in (await call(exact, "bash", {"command": "yes"})).content
    big = FakeSandbox(outputs={"j1": "z" * (MAX_RESULT_CHARS + 7)})
    read = await call(big, "job_output", {"job_id": "j1"})
    assert read.content.startswith("z" * MAX_RESULT_CHARS + "\n[read 0-")
    assert len(read.content) < MAX_RESULT_CHARS + 100


def test_notify_target_hides_its_token() -> None:
    assert NOTIFY.token not in repr(NOTIFY)
