"""Agent turns in a real replica process: the OpenAI-compatible provider against the simulator's
model server with a tool run in the real sandbox service, the stub's declared latency, background
jobs that outlive their session, a second prompt refused while a turn runs, abort over POST, and
the step and wall-time budgets."""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleet_sim.local import Proc
from tests.harness import Fleet, Replica, eventually, eventually_async, post
from tests.replica.support import (
    WsSession,
    events,
    kind,
    new_sid,
    outcomes_since,
    settled_messages,
    state,
    streamed_text,
    turn_outcomes,
    ws_session,
)

pytestmark = pytest.mark.slow
FLEET_DIR = "turns"  # the conftest fleet's directory


@pytest.fixture(scope="module")
def model_server(fleet: Fleet) -> Iterator[str]:
    """The OpenAI-compatible scripted server, 150 ms to the first token; yields its /v1 URL."""
    argv = [sys.executable, "-m", "fleet_sim.model_server", "--listen", "127.0.0.1:0"]
    proc = Proc([*argv, "--ttft-ms", "150", "--per-token-ms", "5"], fleet.root / "model.log")
    proc.start()
    try:
        yield proc.readline().strip()
    finally:
        proc.stop()


def shard(fleet: Fleet, name: str) -> dict[str, Path]:
    return {"a07-s1": fleet.root / f"shard-{name}"}


# -- providers -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def openai_replica(fleet: Fleet, model_server: str) -> Replica:
    return fleet.replica("oa", shard(fleet, "oa"), "--model", f"openai:{model_server}")


def test_openai_provider_streams_and_runs_bash_in_the_sandbox(
    fleet: Fleet, openai_replica: Replica
) -> None:
    replica = openai_replica
    sid = new_sid()
    grant = fleet.grant("acme", sid)
    nonce = secrets.token_hex(4)
    command = f"echo sandbox-{nonce}; pwd"

    async def run() -> tuple[float, list[dict[str, Any]], list[dict[str, Any]], WsSession]:
        async with ws_session(replica, sid, grant) as (ws, _):
            sent = await ws.send({"type": "prompt", "message": "hello openai"})
            plain = await ws.until(lambda f: kind(f) == "turn_ended")
            first_delta = next(t for t, f in ws.arrivals if kind(f) == "text_delta")
            tooled = await ws.turn(f"look around\nrun: {command}")
            return first_delta - sent, plain, tooled, ws

    ttft, plain, tooled, _ = asyncio.run(run())
    assert streamed_text(plain) == "ok: hello openai"
    assert ttft >= 0.15  # the server's declared time to first token, over a real socket
    [call] = events(tooled, "tool_call")
    assert call["name"] == "bash" and json.loads(call["arguments"]) == {"command": command}
    [result] = events(tooled, "tool_result")
    workspace = fleet.root / "sandboxes" / sid.replace(".", "_") / "workspace"
    assert result["id"] == call["id"] and result["is_error"] is False
    assert result["content"] == f"sandbox-{nonce}\n{workspace}\n\n[exit status 0]"
    assert streamed_text(tooled) == f"result: sandbox-{nonce}"
    assert events(tooled, "turn_ended")[0]["outcome"] == "succeeded"
    with replica.client() as client:
        messages = settled_messages(client, sid, grant)
    assert [m["role"] for m in messages] == [
        "user",
        "assistant",
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
    assert messages[3]["tool_calls"][0]["id"] == call["id"]
    assert messages[4]["tool_call_id"] == call["id"]
    assert messages[5]["content"] == f"result: sandbox-{nonce}"
    assert messages[5]["stop"] == "stop"


def test_openai_provider_failures_end_the_run_not_the_session(
    fleet: Fleet, openai_replica: Replica
) -> None:
    sid = new_sid()
    grant = fleet.grant("acme", sid, sandbox=False)

    async def run() -> list[list[dict[str, Any]]]:
        async with ws_session(openai_replica, sid, grant) as (ws, _):
            return [
                await ws.turn(prompt)
                for prompt in ("cut me off\nhangup: 2", "refuse me\nerror: 503", "still here")
            ]

    cut, refused, fine = asyncio.run(run())
    assert [events(t, "turn_ended")[0]["outcome"] for t in (cut, refused, fine)] == [
        "failed",
        "failed",
        "succeeded",
    ]
    assert streamed_text(cut) == "ok: cut " and "broke off" in events(cut, "error")[0]["error"]
    assert "answered 503" in events(refused, "error")[0]["error"]
    assert streamed_text(fine) == "ok: still here"
    with openai_replica.client() as client:
        messages = settled_messages(client, sid, grant)
    assert [(m["role"], m["content"], m.get("stop")) for m in messages] == [
        ("user", "cut me off\nhangup: 2", None),
        ("assistant", "ok: cut ", "error"),
        ("user", "refuse me\nerror: 503", None),
        ("user", "still here", None),
        ("assistant", "ok: still here", "stop"),
    ]


def test_stub_provider_keeps_its_declared_latency(fleet: Fleet) -> None:
    replica = fleet.replica(
        "stub", shard(fleet, "stub"), "--model", "stub:ttft=400ms,per_token=25ms,tokens=12"
    )
    sid = new_sid()
    grant = fleet.grant("acme", sid, sandbox=False)

    async def run() -> tuple[float, list[dict[str, Any]], WsSession]:
        async with ws_session(replica, sid, grant) as (ws, _):
            sent = await ws.send({"type": "prompt", "message": "take your time"})
            frames = await ws.until(lambda f: kind(f) == "turn_ended")
            return sent, frames, ws

    sent, frames, ws = asyncio.run(run())
    deltas = [t for t, f in ws.arrivals if kind(f) == "text_delta"]
    ended = next(t for t, f in ws.arrivals if kind(f) == "turn_ended")
    assert deltas[0] - sent >= 0.4
    assert deltas[0] - sent < 2.0
    assert ended - sent >= 0.4 + 11 * 0.025  # the 12th token is due 11 token-times after the 1st
    assert streamed_text(frames).split()[:3] == ["ok:", "take", "your"]
    assert len(streamed_text(frames).split()) == 12


# -- background jobs -----------------------------------------------------------------------------


def test_background_job_outlives_its_session_and_is_read_elsewhere(fleet: Fleet) -> None:
    root = fleet.root / "shard-jobs"
    first = fleet.replica("j1", {"a07-s1": root}, "--session-idle-timeout", "1")
    second = fleet.replica("j2", {"a07-s1": root})
    sid = new_sid()
    grant = fleet.grant("acme", sid)
    exec_url, exec_headers = fleet.sandbox.exec_for(sid.replace(".", "_"))
    job_id = ""
    try:
        with first.client() as client:
            command = "echo tick-1; echo tick-2; sleep 30"
            accepted = post(client, sid, grant, {"type": "prompt", "message": f"bg: {command}"})
            assert accepted.status_code == 202
            messages = settled_messages(client, sid, grant)
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
        tool = messages[2]
        job_id = tool["job_id"]
        assert tool["background"] is True and tool["content"] == f"started background job {job_id}"
        assert messages[3]["content"] == f"result: started background job {job_id}"
        # Nobody is attached: the first replica reaps the session and lets go of its lock.
        eventually(lambda: "agent_sessions_reaped_total 1.0" in first.scrape(), timeout=10)
        with httpx.Client(timeout=10, headers=exec_headers) as sandbox:
            job = sandbox.get(f"{exec_url}/jobs/{job_id}").json()
            assert job["status"] == "running" and job["command"] == command
            with second.client() as client:
                opened = post(
                    client, sid, grant, {"type": "prompt", "message": f"read: {job_id} 0"}
                )
                assert opened.status_code == 202
                assert state(client, sid, grant)["epoch"] == 2  # reopened by another owner
                messages = settled_messages(client, sid, grant)
            assert sandbox.get(f"{exec_url}/jobs/{job_id}").json()["status"] == "running"
        assert messages[5]["tool_calls"][0]["name"] == "job_output"
        read = messages[6]
        assert read["role"] == "tool" and read["job_id"] == job_id
        assert read["content"].startswith("tick-1\ntick-2\n")
        assert read["next_offset"] == len("tick-1\ntick-2\n")
        assert messages[7]["content"] == "result: tick-1"
    finally:
        if job_id:
            httpx.delete(f"{exec_url}/jobs/{job_id}", headers=exec_headers, timeout=10)


# -- refusing, aborting, budgets -----------------------------------------------------------------


def watch_turn(
    replica: Replica,
    sid: str,
    grant: str,
    done: Callable[[list[dict[str, Any]]], bool],
    wait_s: float = 10.0,
) -> None:
    """Read the session's event stream until ``done`` accepts the frames of the turn seen so
    far (those its catch-up replays, then live ones); ``TimeoutError`` if not in ``wait_s``."""
    frames: list[dict[str, Any]] = []
    deadline = time.monotonic() + wait_s
    with (
        httpx.Client(base_url=replica.url, timeout=wait_s) as client,
        client.stream(
            "GET", f"/_beyond/agent/events?session_id={sid}", headers={"x-beyond-grant": grant}
        ) as response,
    ):
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data:"):
                frame = json.loads(line[5:])
                frames += frame["turn"] if frame["type"] == "catchup" else [frame]
                if done(frames):
                    return
            if time.monotonic() > deadline:
                break
    raise TimeoutError(f"the turn did not get there in {wait_s} s: {frames[-3:]}")


@pytest.fixture(scope="module")
def slow_replica(fleet: Fleet) -> Replica:
    return fleet.replica(
        "slow", shard(fleet, "slow"), "--model", "stub:ttft=50ms,per_token=30ms,tokens=300"
    )


def test_second_prompt_is_409_and_abort_over_post_commits_the_partial_reply(
    fleet: Fleet, slow_replica: Replica
) -> None:
    sid = new_sid()
    grant = fleet.grant("acme", sid, sandbox=False)
    before = turn_outcomes(slow_replica)
    with slow_replica.client() as client:
        assert post(client, sid, grant, {"type": "prompt", "message": "go on"}).status_code == 202
        busy = post(client, sid, grant, {"type": "prompt", "id": "p2", "message": "me too"})
        assert busy.status_code == 409 and busy.headers["x-session-id"] == sid
        body = busy.json()
        assert body["type"] == "response" and body["id"] == "p2" and body["command"] == "prompt"
        assert body["success"] is False and "already running" in body["error"]
        archive = post(client, sid, grant, {"type": "new_session"})
        assert archive.status_code == 200 and archive.json()["success"] is False
        # The reply's first words are out (the aborted reply is checked for them).
        watch_turn(slow_replica, sid, grant, lambda f: len(streamed_text(f).split()) >= 3)
        aborted = post(client, sid, grant, {"type": "abort", "id": "a1"})
        assert aborted.status_code == 200
        assert aborted.json()["data"] == {"aborted": True} and aborted.json()["id"] == "a1"
        messages = settled_messages(client, sid, grant, timeout=5)
        again = post(client, sid, grant, {"type": "abort"}).json()["data"]
    assert again == {"aborted": False}
    assert [m["role"] for m in messages] == ["user", "assistant"]
    words = messages[1]["content"].split()
    assert 0 < len(words) < 300 and words[:3] == ["ok:", "go", "on"]
    assert messages[1]["stop"] == "aborted"
    assert outcomes_since(slow_replica, before, 1) == {
        "succeeded": 0.0,
        "failed": 0.0,
        "aborted": 1.0,
    }


def test_abort_does_not_wait_for_a_running_tool(fleet: Fleet, slow_replica: Replica) -> None:
    sid = new_sid()
    grant = fleet.grant("acme", sid)
    started = fleet.root / "sandboxes" / sid.replace(".", "_") / "workspace" / "started"

    async def run() -> tuple[list[dict[str, Any]], float]:
        async with ws_session(slow_replica, sid, grant) as (ws, _):
            await ws.send({"type": "prompt", "message": "wait\nrun: touch started; sleep 5"})
            frames = await ws.until(lambda f: kind(f) == "tool_call")
            await eventually_async(
                started.exists, timeout=10, message="the command never ran in the sandbox"
            )
            aborted_at = await ws.send({"type": "abort"})
            frames += await ws.until(lambda f: kind(f) == "turn_ended")
            return frames, time.monotonic() - aborted_at

    frames, took = asyncio.run(run())
    assert took < 1.5
    assert events(frames, "turn_ended")[0]["outcome"] == "aborted"
    assert events(frames, "tool_result") == []
    with slow_replica.client() as client:
        messages = settled_messages(client, sid, grant)
    [call] = events(frames, "tool_call")
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["tool_calls"][0]["id"] == call["id"] and messages[1]["stop"] == "aborted"
    assert messages[2]["tool_call_id"] == call["id"] and "aborted" in messages[2]["content"]


def test_step_and_time_budgets_end_turns_with_their_reasons(fleet: Fleet) -> None:
    replica = fleet.replica(
        "budget",
        shard(fleet, "budget"),
        "--model",
        "stub:ttft=20ms,per_token=60ms,tokens=100",
        "--turn-max-steps",
        "1",
        "--turn-max-seconds",
        "1.5",
    )
    steps, slow = new_sid(), new_sid()
    steps_grant, slow_grant = fleet.grant("acme", steps), fleet.grant("acme", slow, sandbox=False)

    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
        async with ws_session(replica, steps, steps_grant) as (ws, _):
            stepped = await ws.turn("two things\nrun: echo one\nrun: echo two")
        async with ws_session(replica, slow, slow_grant) as (ws, _):
            started = await ws.send({"type": "prompt", "message": "a long story"})
            timed = await ws.until(lambda f: kind(f) == "turn_ended")
            return stepped, timed, time.monotonic() - started

    stepped, timed, took = asyncio.run(run())
    assert events(stepped, "turn_ended")[0]["reason"] == "budget_steps"
    assert [json.loads(c["arguments"])["command"] for c in events(stepped, "tool_call")] == [
        "echo one"
    ]
    assert events(timed, "turn_ended")[0]["reason"] == "budget_time"
    assert 1.5 <= took < 4.0  # the whole reply would take 6 s
    with replica.client() as client:
        stepped_msgs = settled_messages(client, steps, steps_grant)
        timed_msgs = settled_messages(client, slow, slow_grant)
    assert [m["role"] for m in stepped_msgs] == ["user", "assistant", "tool"]
    assert stepped_msgs[1]["stop"] == "budget_steps"
    assert stepped_msgs[2]["content"].startswith("one\n")
    assert [m["role"] for m in timed_msgs] == ["user", "assistant"]
    assert timed_msgs[1]["stop"] == "budget_time"
    assert 0 < len(timed_msgs[1]["content"].split()) < 100
