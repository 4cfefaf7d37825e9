from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from fleet_sim.sandbox_jobs import (
    Job,
    JobStatus,
    Sandbox,
    SandboxLimits,
    ServiceStopping,
    decode_prefix,
    valid_sandbox_name,
)


async def finished(job: Job, timeout_s: float = 10.0) -> Job:
    async with asyncio.timeout(timeout_s):
        await job.ended.wait()
    return job


def sandbox(
    root: Path, ended: list[str] | None = None, limits: SandboxLimits | None = None
) -> Sandbox:
    def on_end(_: Sandbox, job: Job) -> None:
        if ended is not None:
            ended.append(job.job_id)

    return Sandbox("box", root, limits or SandboxLimits(), on_end)


def test_decode_prefix_never_splits_a_character() -> None:
    data = "aé".encode()
    assert decode_prefix(data[:2], final=False) == ("a", 1)
    assert decode_prefix(data, final=False) == ("aé", 3)
    assert decode_prefix(data[:2], final=True) == ("a\ufffd", 2)


def test_sandbox_names() -> None:
    assert all(valid_sandbox_name(n) for n in ("a", "A-b_c.d", "x" * 128, ".hidden"))
    assert not any(valid_sandbox_name(n) for n in ("", ".", "..", "a/b", "x" * 129, "@k"))


@pytest.mark.anyio
async def test_job_output_is_capped_but_the_job_runs_to_its_end(tmp_path: Path) -> None:
    ended: list[str] = []
    box = sandbox(tmp_path, ended, SandboxLimits(job_output_cap=100))
    try:
        job = await finished(await box.start_job("head -c 5000 /dev/zero; echo end >&2", None))
    finally:
        await box.close()
    assert (job.status, job.exit_code) == (JobStatus.EXITED, 0)
    assert (job.output_bytes, job.output_truncated) == (100, True)
    assert job.output_path.stat().st_size == 100
    assert job.output_path.parent.parent == tmp_path / "box" / "state"
    assert ended == [job.job_id]


@pytest.mark.anyio
async def test_oldest_ended_jobs_are_forgotten_with_their_output(tmp_path: Path) -> None:
    box = sandbox(tmp_path, limits=SandboxLimits(max_kept_jobs=2))
    try:
        jobs = [await finished(await box.start_job(f"echo {i}", None)) for i in range(3)]
    finally:
        await box.close()
    assert [job.job_id for job in box.jobs()] == [jobs[1].job_id, jobs[2].job_id]
    assert not jobs[0].output_path.exists() and jobs[2].output_path.exists()


@pytest.mark.anyio
async def test_close_kills_jobs_and_refuses_new_commands(tmp_path: Path) -> None:
    box = sandbox(tmp_path)
    job = await box.start_job("sleep 60", None)
    started = time.monotonic()
    await box.close()
    assert job.status is JobStatus.KILLED and job.signal == 9
    assert time.monotonic() - started < 5
    with pytest.raises(ServiceStopping):
        await box.run("true", 5)
