from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from fleet_sim.model_server import REQUESTS, ModelServerConfig, RequestLog, start_model_server
from replica.model import ChatMessage, MockModel, TextDelta

BASH = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}


@asynccontextmanager
async def serving(config: ModelServerConfig | None = None) -> AsyncIterator[tuple[str, RequestLog]]:
    runner, url = await start_model_server("127.0.0.1", 0, config)
    try:
        yield url, runner.app[REQUESTS]
    finally:
        await runner.cleanup()


async def sse_chunks(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[str]]:
    """The JSON chunks of a streamed completion, and every raw data payload in order."""
    raw: list[str] = []
    async with client.stream("POST", url + "/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                raw.append(line.removeprefix("data: "))
    return [json.loads(r) for r in raw if r != "[DONE]"], raw


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "mock", "messages": [{"role": "user", "content": text}], **extra}


@pytest.mark.anyio
async def test_models_lists_the_mock() -> None:
    async with serving() as (url, _), httpx.AsyncClient() as client:
        response = await client.get(url + "/models")
    assert response.status_code == 200
    assert [m["id"] for m in response.json()["data"]] == ["mock"]


@pytest.mark.anyio
async def test_streamed_tool_call_uses_openai_fragment_format() -> None:
    body = chat("run: echo hello world", stream=True, tools=[BASH])
    body["stream_options"] = {"include_usage": True}
    async with serving() as (url, _), httpx.AsyncClient() as client:
        chunks, raw = await sse_chunks(client, url, body)
    assert raw[-1] == "[DONE]"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    fragments = [
        c["choices"][0]["delta"]["tool_calls"][0]
        for c in chunks
        if c["choices"] and "tool_calls" in c["choices"][0]["delta"]
    ]
    head, rest = fragments[0], fragments[1:]
    assert head["id"].startswith("call_")
    assert head["function"] == {"name": "bash", "arguments": ""}
    assert len(rest) >= 2
    assert all("id" not in f and "name" not in f["function"] for f in rest)
    arguments = "".join(f["function"]["arguments"] for f in rest)
    assert json.loads(arguments) == {"command": "echo hello world"}
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
    usage = chunks[-1]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 1 + len(rest)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


@pytest.mark.anyio
async def test_usage_chunk_only_when_asked_for() -> None:
    async with serving() as (url, _), httpx.AsyncClient() as client:
        chunks, _ = await sse_chunks(client, url, chat("hello", stream=True))
    assert all("usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "ok: hello"


@pytest.mark.anyio
async def test_non_streamed_reply_matches_the_mock_model() -> None:
    async with serving() as (url, _), httpx.AsyncClient() as client:
        text = (await client.post(url + "/chat/completions", json=chat("words: 12\nhi"))).json()
        tool = (
            await client.post(url + "/chat/completions", json=chat("bg: sleep 9", tools=[BASH]))
        ).json()
    mock = [
        e
        async for e in MockModel().stream([ChatMessage("user", "words: 12\nhi")], [], max_tokens=99)
    ]
    assert text["choices"][0]["message"]["content"] == "".join(
        e.text for e in mock if isinstance(e, TextDelta)
    )
    assert text["choices"][0]["finish_reason"] == "stop"
    assert text["usage"]["completion_tokens"] == 12
    [call] = tool["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"command": "sleep 9", "background": True}
    assert tool["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.anyio
@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        b'{"model": "mock"}',
        b'{"messages": [{"role": "robot", "content": "x"}]}',
        b'{"messages": [{"role": "tool", "content": "x"}]}',
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
        b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
    ],
)
async def test_malformed_requests_are_400_with_an_openai_error(body: bytes) -> None:
    async with serving() as (url, log), httpx.AsyncClient() as client:
        response = await client.post(url + "/chat/completions", content=body)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert log.total == 1


@pytest.mark.anyio
async def test_api_key_is_required_when_configured() -> None:
    config = ModelServerConfig(api_key="sk-test-123456")
    assert "sk-test" not in repr(config)
    async with serving(config) as (url, log), httpx.AsyncClient() as client:
        missing = await client.post(url + "/chat/completions", json=chat("x"))
        wrong = await client.get(url + "/models", headers={"Authorization": "Bearer sk-nope"})
        right = await client.post(
            url + "/chat/completions",
            json=chat("x"),
            headers={"Authorization": "Bearer sk-test-123456"},
        )
    assert (missing.status_code, wrong.status_code, right.status_code) == (401, 401, 200)
    assert [r.had_authorization for r in log.recent] == [False, True, True]


@pytest.mark.anyio
async def test_declared_latency_delays_first_token_and_spaces_the_rest() -> None:
    config = ModelServerConfig(ttft_s=0.2, per_token_s=0.02)
    async with serving(config) as (url, _), httpx.AsyncClient() as client:
        started = time.monotonic()
        content_times: list[float] = []
        async with client.stream(
            "POST", url + "/chat/completions", json=chat("words: 10\nx", stream=True)
        ) as response:
            async for line in response.aiter_lines():
                if '"content": "' in line and '"content": ""' not in line:
                    content_times.append(time.monotonic() - started)
    assert len(content_times) == 10
    assert content_times[0] >= 0.2
    assert content_times[-1] >= 0.2 + 9 * 0.02


@pytest.mark.anyio
async def test_error_directive_answers_that_status() -> None:
    async with serving() as (url, _), httpx.AsyncClient() as client:
        response = await client.post(
            url + "/chat/completions", json=chat("error: 429", stream=True)
        )
    assert response.status_code == 429
    assert "429" in response.json()["error"]["message"]


@pytest.mark.anyio
async def test_hangup_directive_drops_the_connection_mid_stream() -> None:
    received: list[str] = []
    async with serving() as (url, _), httpx.AsyncClient() as client:
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream(
                "POST", url + "/chat/completions", json=chat("words: 9\nhangup: 2", stream=True)
            ) as response:
                async for line in response.aiter_lines():
                    received.append(line)
    data = [line for line in received if line.startswith("data: ")]
    assert len(data) == 3  # the role chunk, then two tokens
    assert "[DONE]" not in "".join(received)


@pytest.mark.anyio
async def test_command_line_prints_url_and_serves_until_sigterm() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fleet_sim.model_server",
        "--listen",
        "127.0.0.1:0",
        "--ttft-ms",
        "1",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode().strip()
        assert line.startswith("http://127.0.0.1:") and line.endswith("/v1")
        async with httpx.AsyncClient() as client:
            response = await client.post(line + "/chat/completions", json=chat("ping"))
        assert response.json()["choices"][0]["message"]["content"] == "ok: ping"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
