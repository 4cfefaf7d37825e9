from __future__ import annotations

import base64
import hashlib
import hmac
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleet_sim.sandbox import (
    DEFAULT_SECRET_NAME,
    HOST,
    TOKEN_HEADER,
    BadRequest,
    SandboxConfig,
    SandboxHost,
    parse_exec_request,
    sandbox_exec,
    sandbox_token,
    start_sandbox_server,
)
from fleet_sim.sandbox_jobs import SandboxLimits
from replica.keyfiles import read_key_file
from tests.harness import eventually, eventually_async

SECRET = b"k" * 32


@asynccontextmanager
async def serving(
    root: Path, config: SandboxConfig | None = None
) -> AsyncIterator[tuple[SandboxHost, str]]:
    runner, base = await start_sandbox_server(root, secret=SECRET, config=config)
    try:
        yield runner.app[HOST], base
    finally:
        await runner.cleanup()


def client_for(base: str, name: str) -> tuple[str, httpx.AsyncClient]:
    url, headers = sandbox_exec(base, SECRET, name)
    return url, httpx.AsyncClient(headers=headers, timeout=30.0, trust_env=False)


def workspace(root: Path, name: str) -> str:
    return str(root.resolve() / name / "workspace")


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def wait_dead(pid: int, timeout_s: float = 5.0) -> None:
    async def dead() -> bool:
        return not alive(pid)

    await eventually_async(dead, timeout=timeout_s)


async def ended(client: httpx.AsyncClient, url: str, job_id: str) -> dict[str, Any]:
    info: dict[str, Any] = {}

    async def check() -> bool:
        nonlocal info
        info = (await client.get(f"{url}/jobs/{job_id}")).json()
        return bool(info["status"] != "running")

    await eventually_async(check)
    return info


# --- pure parts ---


def test_token_is_base64url_hmac_of_the_name() -> None:
    digest = hmac.new(SECRET, b"sb-1", hashlib.sha256).digest()
    expected = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    assert sandbox_token(SECRET, "sb-1") == expected
    assert sandbox_token(SECRET, "sb-2") != expected
    assert sandbox_exec("http://h:1/", SECRET, "sb-1") == (
        "http://h:1/s/sb-1",
        {TOKEN_HEADER: expected},
    )
    for bad in ("", "..", "a/b", "x" * 129, "é"):
        with pytest.raises(ValueError):
            sandbox_token(SECRET, bad)


def test_exec_body_defaults_and_refusals() -> None:
    parsed = parse_exec_request({"command": "ls"})
    assert (parsed.timeout_s, parsed.background, parsed.notify) == (60.0, False, None)
    job = parse_exec_request(
        {"command": "ls", "background": True, "notify": {"url": "http://h/x", "token": "t"}}
    )
    assert job.notify is not None and job.notify.token == "t"
    bodies: list[object] = [
        [],
        {},
        {"command": ""},
        {"command": "ls", "timeout_s": 0},
        {"command": "ls", "timeout_s": 601},
        {"command": "ls", "timeout_s": True},
        {"command": "ls", "background": "yes"},
        {"command": "ls", "extra": 1},
        {"command": "a\0b"},
        {"command": "ls", "notify": {"url": "http://h/", "token": "t"}},
        {"command": "ls", "background": True, "timeout_s": 5},
        {"command": "ls", "background": True, "notify": {"url": "ftp://h/", "token": "t"}},
        {"command": "ls", "background": True, "notify": {"url": "http://h/", "token": "a b"}},
        {"command": "ls", "background": True, "notify": {"url": "http://h/"}},
    ]
    for body in bodies:
        with pytest.raises(BadRequest):
            parse_exec_request(body)


# --- foreground ---


@pytest.mark.anyio
async def test_foreground_exec_runs_in_the_workspace_with_a_clean_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SERVER_ONLY_SECRET", "do-not-leak")
    async with serving(tmp_path) as (_, base):
        url, client = client_for(base, "box")
        async with client:
            answer = await client.post(
                f"{url}/exec", json={"command": "pwd; env; echo oops >&2; exit 3"}
            )
    assert answer.status_code == 200
    result = answer.json()
    assert result["exit_code"] == 3
    assert result["timed_out"] is False and result["truncated"] is False
    assert result["stdout"].splitlines()[0] == workspace(tmp_path, "box")
    assert "SERVER_ONLY_SECRET" not in result["stdout"]
    assert result["stderr"] == "oops\n"


@pytest.mark.anyio
async def test_foreground_timeout_kills_the_whole_group(tmp_path: Path) -> None:
    async with serving(tmp_path) as (_, base):
        url, client = client_for(base, "box")
        async with client:
            started = time.monotonic()
            answer = await client.post(
                f"{url}/exec",
                json={"command": "sleep 30 & echo $!; wait", "timeout_s": 0.5},
            )
            took = time.monotonic() - started
    result = answer.json()
    assert result["timed_out"] is True and result["exit_code"] is None
    assert 0.5 <= took < 5
    await wait_dead(int(result["stdout"]))


@pytest.mark.anyio
async def test_foreground_output_is_capped_without_blocking_the_command(tmp_path: Path) -> None:
    config = SandboxConfig(limits=SandboxLimits(foreground_output_cap=1000))
    async with serving(tmp_path, config) as (_, base):
        url, client = client_for(base, "box")
        async with client:
            answer = await client.post(
                f"{url}/exec",
                json={"command": "head -c 3000000 /dev/zero | tr '\\0' a; echo tail >&2"},
            )
    result = answer.json()
    assert result["exit_code"] == 0 and result["truncated"] is True
    assert result["stdout"] == "a" * 1000
    assert result["stderr"] == "tail\n"


# --- authentication and refusals ---


@pytest.mark.anyio
async def test_wrong_missing_or_foreign_token_is_401(tmp_path: Path) -> None:
    async with serving(tmp_path) as (_, base), httpx.AsyncClient(trust_env=False) as client:
        url = f"{base}/s/alpha/exec"
        body = {"command": "touch ran"}
        cases: list[list[tuple[str, str]]] = [
            [],
            [(TOKEN_HEADER, "not-the-token")],
            [(TOKEN_HEADER, sandbox_token(SECRET, "beta"))],
            [(TOKEN_HEADER, sandbox_token(b"other" * 8, "alpha"))],
            [(TOKEN_HEADER, sandbox_token(SECRET, "alpha"))] * 2,
        ]
        for headers in cases:
            answer = await client.post(url, json=body, headers=headers)
            assert answer.status_code == 401
            assert "x-sandbox-token" in answer.json()["error"]
        for bad_name in ("x" * 129, "a%20b", "%2E%2E"):
            unknown = await client.get(f"{base}/s/{bad_name}/jobs")
            assert unknown.status_code == 404, bad_name
    assert not (tmp_path / "alpha" / "workspace" / "ran").exists()


@pytest.mark.anyio
async def test_bad_requests_are_clear_json_errors(tmp_path: Path) -> None:
    async with serving(tmp_path) as (_, base):
        url, client = client_for(base, "box")
        async with client:
            not_json = await client.post(f"{url}/exec", content=b"{nope")
            assert not_json.status_code == 400 and "not JSON" in not_json.json()["error"]
            bad = await client.post(f"{url}/exec", json={"command": "ls", "timeout_s": 9999})
            assert bad.status_code == 400 and "timeout_s" in bad.json()["error"]
            huge = await client.post(f"{url}/exec", json={"command": "x" * 200_000})
            assert huge.status_code == 413 and "error" in huge.json()
            missing = await client.get(f"{url}/jobs/j0000000000000000")
            assert missing.status_code == 404 and "error" in missing.json()
            job = await client.post(f"{url}/exec", json={"command": "true", "background": True})
            job_id = job.json()["job_id"]
            for query in ("offset=-1", "limit=0", "offset=1&offset=2", "limit=x"):
                answer = await client.get(f"{url}/jobs/{job_id}/output?{query}")
                assert answer.status_code == 400, query


# --- background jobs ---


@pytest.mark.anyio
async def test_background_job_lifecycle(tmp_path: Path) -> None:
    async with serving(tmp_path) as (_, base):
        url, client = client_for(base, "box")
        async with client:
            started = await client.post(
                f"{url}/exec",
                json={"command": "echo start; sleep 0.4; echo done; exit 7", "background": True},
            )
            assert started.status_code == 201
            job = started.json()
            assert job["status"] == "running" and job["exit_code"] is None
            assert job["ended_at"] is None
            listed = (await client.get(f"{url}/jobs")).json()["jobs"]
            assert [item["job_id"] for item in listed] == [job["job_id"]]
            final = await ended(client, url, job["job_id"])
    assert final["status"] == "exited" and final["exit_code"] == 7
    assert final["ended_at"] >= final["started_at"]
    assert final["output_bytes"] == len("start\ndone\n")


@pytest.mark.anyio
async def test_output_reads_from_any_offset_while_running_and_after_exit(tmp_path: Path) -> None:
    async with serving(tmp_path) as (_, base):
        url, client = client_for(base, "box")
        async with client:
            job_id = (
                await client.post(
                    f"{url}/exec",
                    json={
                        "command": "printf abc; while [ ! -e go ]; do sleep 0.02; done; printf déf",
                        "background": True,
                    },
                )
            ).json()["job_id"]
            output = f"{url}/jobs/{job_id}/output"
            first: dict[str, Any] = {}

            async def has_abc() -> bool:
                nonlocal first
                first = (await client.get(output)).json()
                return bool(first["data"] == "abc")

            await eventually_async(has_abc)
            assert (first["next_offset"], first["eof"]) == (3, False)
            middle = (await client.get(output, params={"offset": 1, "limit": 1})).json()
            assert (middle["data"], middle["next_offset"], middle["eof"]) == ("b", 2, False)
            (tmp_path / "box" / "workspace" / "go").touch()
            await ended(client, url, job_id)
            rest = (await client.get(output, params={"offset": 3})).json()
            assert (rest["data"], rest["next_offset"], rest["eof"]) == ("déf", 7, True)
            # A limit that ends inside "é" returns only whole characters.
            cut = (await client.get(output, params={"offset": 3, "limit": 2})).json()
            assert (cut["data"], cut["next_offset"], cut["eof"]) == ("d", 4, False)
            past = (await client.get(output, params={"offset": 7})).json()
            assert (past["data"], past["eof"]) == ("", True)


@pytest.mark.anyio
async def test_kill_ends_the_job_and_its_process_group(tmp_path: Path) -> None:
    async with serving(tmp_path) as (_, base):
        url, client = client_for(base, "box")
        async with client:
            job_id = (
                await client.post(
                    f"{url}/exec",
                    json={"command": "sleep 60 & echo $! > child; wait", "background": True},
                )
            ).json()["job_id"]
            child = tmp_path / "box" / "workspace" / "child"

            async def child_written() -> bool:
                return child.exists() and child.read_text().strip().isdigit()

            await eventually_async(child_written)
            child_pid = int(child.read_text())
            assert alive(child_pid)
            killed = await client.delete(f"{url}/jobs/{job_id}")
            assert killed.status_code == 200
            assert killed.json()["status"] == "killed"
            assert killed.json()["exit_code"] is None
            again = (await client.get(f"{url}/jobs/{job_id}")).json()
            assert again["status"] == "killed"
    await wait_dead(child_pid)


@pytest.mark.anyio
async def test_jobs_outlive_the_client_that_started_them(tmp_path: Path) -> None:
    async with serving(tmp_path) as (_, base):
        url, first = client_for(base, "box")
        async with first:
            job_id = (
                await first.post(
                    f"{url}/exec",
                    json={
                        "command": "for i in $(seq 1 10); do echo $i; sleep 0.05; done",
                        "background": True,
                    },
                )
            ).json()["job_id"]
        # The first client is closed; a different one finds the job and its whole output.
        _, second = client_for(base, "box")
        async with second:
            final = await ended(second, url, job_id)
            output = (await second.get(f"{url}/jobs/{job_id}/output")).json()
    assert final["status"] == "exited" and final["exit_code"] == 0
    assert output["data"] == "".join(f"{i}\n" for i in range(1, 11))
    assert output["eof"] is True


@pytest.mark.anyio
async def test_sandboxes_have_separate_workspaces_and_jobs(tmp_path: Path) -> None:
    async with serving(tmp_path) as (_, base):
        url_a, a = client_for(base, "a")
        url_b, b = client_for(base, "b")
        async with a, b:
            await a.post(f"{url_a}/exec", json={"command": "echo secret > note"})
            job = await a.post(f"{url_a}/exec", json={"command": "echo hi", "background": True})
            job_id = job.json()["job_id"]
            await ended(a, url_a, job_id)
            listing_a = (await a.post(f"{url_a}/exec", json={"command": "ls -A"})).json()
            listing_b = (await b.post(f"{url_b}/exec", json={"command": "ls -A; pwd"})).json()
            assert (await b.get(f"{url_b}/jobs")).json() == {"jobs": []}
            assert (await b.get(f"{url_b}/jobs/{job_id}")).status_code == 404
            # a's exec headers do not open b.
            cross = await a.get(f"{url_b}/jobs")
            assert cross.status_code == 401
    # Job output lives in the state directory, never in the workspace.
    assert listing_a["stdout"] == "note\n"
    assert listing_b["stdout"] == workspace(tmp_path, "b") + "\n"


@pytest.mark.anyio
async def test_running_jobs_are_bounded(tmp_path: Path) -> None:
    config = SandboxConfig(limits=SandboxLimits(max_running_jobs=2))
    async with serving(tmp_path, config) as (host, base):
        url, client = client_for(base, "box")
        async with client:
            body = {"command": "sleep 30", "background": True}
            assert (await client.post(f"{url}/exec", json=body)).status_code == 201
            assert (await client.post(f"{url}/exec", json=body)).status_code == 201
            third = await client.post(f"{url}/exec", json=body)
            assert third.status_code == 429 and "jobs" in third.json()["error"]
            health = (await client.get(f"{base}/_sim/health")).json()
            assert health["running_jobs"] == 2 and health["sandboxes"] == 1
            assert host.health() == health


@pytest.mark.anyio
async def test_stopping_the_service_kills_running_jobs(tmp_path: Path) -> None:
    runner, base = await start_sandbox_server(tmp_path, secret=SECRET)
    try:
        url, client = client_for(base, "box")
        async with client:
            job_id = (
                await client.post(
                    f"{url}/exec", json={"command": "echo $$; exec sleep 60", "background": True}
                )
            ).json()["job_id"]
            pid_text = ""

            async def has_pid() -> bool:
                nonlocal pid_text
                pid_text = str((await client.get(f"{url}/jobs/{job_id}/output")).json()["data"])
                return pid_text.endswith("\n")

            await eventually_async(has_pid)
    finally:
        await runner.cleanup()
    await wait_dead(int(pid_text))


def test_command_line_serves_with_a_created_secret_and_stops_on_sigterm(tmp_path: Path) -> None:
    root = tmp_path / "root"
    process = subprocess.Popen(
        [sys.executable, "-m", "fleet_sim.sandbox", "--listen", "127.0.0.1:0", "--root", str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        base = process.stdout.readline().strip()
        assert base.startswith("http://127.0.0.1:")
        secret = read_key_file(root / DEFAULT_SECRET_NAME, what="test")
        url, headers = sandbox_exec(base, secret, "box")
        with httpx.Client(headers=headers, timeout=10.0, trust_env=False) as client:
            job = client.post(
                f"{url}/exec", json={"command": "echo $$; exec sleep 60", "background": True}
            ).json()

            def first_line() -> str | None:
                out: str = client.get(f"{url}/jobs/{job['job_id']}/output").json()["data"]
                return out if out.endswith("\n") else None

            data: str = eventually(first_line, timeout=10)
            assert client.get(f"{base}/_sim/health").json()["running_jobs"] == 1
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
        eventually(lambda: not alive(int(data)), timeout=5)
        assert not alive(int(data))
        assert os.stat(root / DEFAULT_SECRET_NAME).st_mode & 0o077 == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=5)
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()
