from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import asynccontextmanager

import pytest

from fleet_sim.model_server import REQUESTS, ModelServerConfig, RequestLog, start_model_server
from fleet_sim.ports import free_port
from replica.errors import ConfigError
from replica.model import (
    ChatMessage,
    Finish,
    MockModel,
    ModelError,
    ModelEvent,
    ModelHTTPError,
    ModelProtocolError,
    ModelStreamError,
    ModelTimeout,
    ModelUnavailable,
    OpenAIModel,
    OpenAISpec,
    TextDelta,
    ToolCallEvent,
    ToolSpec,
    make_provider,
)
from replica.model_wire import merge_text
from tests.replica.raw_http import (
    RawRequest,
    answer,
    chunk,
    client_gone,
    raw_server,
    sse,
    stream_head,
    text_chunk,
)

TOOLS = (
    ToolSpec("bash", "run a shell command", {"type": "object", "required": ["command"]}),
    ToolSpec("job_output", "read a job's output", {"type": "object"}),
)
KEY = "sk-proj-Zq81TESTKEYabcdefghijklmnop"
PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


@asynccontextmanager
async def served_model(
    config: ModelServerConfig | None = None, **client: object
) -> AsyncIterator[tuple[OpenAIModel, RequestLog]]:
    runner, url = await start_model_server("127.0.0.1", 0, config)
    model = OpenAIModel(url, **client)  # type: ignore[arg-type]
    try:
        yield model, runner.app[REQUESTS]
    finally:
        await model.aclose()
        await runner.cleanup()


async def collect(
    provider: OpenAIModel | MockModel, messages: Sequence[ChatMessage], max_tokens: int = 500
) -> list[ModelEvent]:
    return [e async for e in provider.stream(messages, TOOLS, max_tokens=max_tokens)]


def user(text: str) -> list[ChatMessage]:
    return [ChatMessage("user", text)]


def text_of(events: Sequence[ModelEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


@pytest.fixture(autouse=True)
def no_ambient_key_or_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


@pytest.mark.anyio
async def test_text_stream_matches_the_mock_model_with_usage() -> None:
    messages = [ChatMessage("system", "terse"), *user("words: 30\ndescribe the fence")]
    async with served_model() as (model, log):
        events = await collect(model, messages)
    # What arrived in one read is one delta, so only the text and the other events compare.
    assert merge_text(events) == merge_text(await collect(MockModel(), messages))
    assert len(text_of(events).split()) == 30
    finish = events[-1]
    assert isinstance(finish, Finish)
    assert (finish.reason, finish.completion_tokens) == ("stop", 30)
    assert finish.prompt_tokens > 0
    [sent] = log.recent
    assert sent.body["stream"] is True
    assert sent.body["stream_options"] == {"include_usage": True}
    assert sent.body["max_tokens"] == 500
    assert [t["function"]["name"] for t in sent.body["tools"]] == ["bash", "job_output"]
    assert not sent.had_authorization


@pytest.mark.anyio
async def test_tool_calls_are_reassembled_from_fragments_and_round_trip() -> None:
    prompt = user("calls: parallel\nrun: grep -rn 'fn main' src | head -5\nread: j-42 128")
    async with served_model() as (model, log):
        first = await collect(model, prompt)
        calls = tuple(e.call for e in first if isinstance(e, ToolCallEvent))
        history = [
            *prompt,
            ChatMessage("assistant", "", calls),
            ChatMessage("tool", "src/main.rs:1:fn main() {\nmore", tool_call_id=calls[0].id),
            ChatMessage("tool", "job output", tool_call_id=calls[1].id),
        ]
        second = await collect(model, history)
    assert merge_text(first) == merge_text(await collect(MockModel(), prompt))
    assert [json.loads(c.arguments) for c in calls] == [
        {"command": "grep -rn 'fn main' src | head -5"},
        {"job_id": "j-42", "offset": 128},
    ]
    assert isinstance(first[-1], Finish) and first[-1].reason == "tool_calls"
    text = "".join(e.text for e in second if isinstance(e, TextDelta))
    assert text == "result: src/main.rs:1:fn main() { | job output"
    sent = log.recent[-1].body["messages"]
    assert sent[1]["tool_calls"][1]["function"]["name"] == "job_output"
    assert sent[2]["tool_call_id"] == calls[0].id


@pytest.mark.anyio
@pytest.mark.parametrize("window_s", [0.0, 0.1])
async def test_a_read_window_gathers_the_tokens_of_each_window_into_one_delta(
    window_s: float,
) -> None:
    config = ModelServerConfig(per_token_s=0.01, tokens=30)
    runner, url = await start_model_server("127.0.0.1", 0, config)
    model = make_provider(OpenAISpec(url), read_window_s=window_s)
    assert isinstance(model, OpenAIModel)
    try:
        started = time.monotonic()
        events = await collect(model, user("hi"))
        elapsed = time.monotonic() - started
    finally:
        await model.aclose()
        await runner.cleanup()
    deltas = sum(isinstance(e, TextDelta) for e in events)
    assert len(text_of(events).split()) == 30
    if window_s:
        # The first read, then at most one a window.
        assert deltas <= elapsed / window_s + 2
    else:
        # A token every 10 ms, each its own read.
        assert deltas > elapsed / 0.1 + 2


@pytest.mark.anyio
async def test_max_tokens_reaches_the_server_and_finishes_with_length() -> None:
    async with served_model() as (model, _):
        events = await collect(model, user("words: 40\nx"), max_tokens=5)
    assert events[-1] == Finish("length", 3, 5)


@pytest.mark.anyio
async def test_http_error_becomes_model_http_error() -> None:
    async with served_model() as (model, _):
        with pytest.raises(ModelHTTPError) as info:
            await collect(model, user("error: 503"))
    assert info.value.status == 503
    assert info.value.retryable
    assert "503" in str(info.value)


@pytest.mark.anyio
async def test_server_closing_mid_stream_is_a_stream_error() -> None:
    got: list[ModelEvent] = []
    async with served_model() as (model, _):
        with pytest.raises(ModelStreamError):
            async for event in model.stream(user("words: 20\nhangup: 4"), TOOLS, max_tokens=99):
                got.append(event)
        # The client survives a broken stream: the next call on it works.
        after = await collect(model, user("again"))
    mock: list[ModelEvent] = []
    with pytest.raises(ModelStreamError):
        async for event in MockModel().stream(user("words: 20\nhangup: 4"), TOOLS, max_tokens=99):
            mock.append(event)
    assert len(mock) == 4
    assert text_of(got) == text_of(mock)
    assert after[-1] == Finish("stop", 1, 2)


@pytest.mark.anyio
async def test_slow_first_token_times_out() -> None:
    async with served_model(ModelServerConfig(ttft_s=2.0), timeout=0.2) as (model, _):
        started = time.monotonic()
        with pytest.raises(ModelTimeout):
            await collect(model, user("hi"))
    assert time.monotonic() - started >= 0.2


@pytest.mark.anyio
async def test_refused_connection_is_unavailable() -> None:
    port = free_port()
    model = OpenAIModel(f"http://127.0.0.1:{port}/v1", timeout=5)
    try:
        with pytest.raises(ModelUnavailable) as info:
            await collect(model, user("hi"))
    finally:
        await model.aclose()
    assert info.value.retryable


@pytest.mark.anyio
async def test_api_key_comes_from_env_and_never_shows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_TEST_KEY", KEY)
    config = ModelServerConfig(api_key=KEY)
    async with served_model(config, api_key_env="FLEET_TEST_KEY") as (model, log):
        events = await collect(model, user("hi"))
        assert KEY not in repr(model)
    assert events[-1] == Finish("stop", 1, 2)
    assert log.recent[-1].had_authorization

    monkeypatch.setenv("FLEET_TEST_KEY", "sk-wrong-" + KEY[-12:])
    async with served_model(config, api_key_env="FLEET_TEST_KEY") as (model, _):
        with pytest.raises(ModelHTTPError) as info:
            await collect(model, user("hi"))
    assert info.value.status == 401
    assert not info.value.retryable
    assert KEY[-12:] not in str(info.value) + repr(info.value)


@pytest.mark.anyio
async def test_key_echoed_by_a_server_is_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)

    async def echo(request: RawRequest, _: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        message = f"Incorrect API key provided: {request.headers['authorization'][7:]}"
        w.write(answer(401, JSON, json.dumps({"error": {"message": message}}).encode()))
        return True

    async with raw_server(echo) as server:
        model = OpenAIModel(server.url)
        with pytest.raises(ModelHTTPError) as info:
            await collect(model, user("hi"))
        await model.aclose()
    assert [r.headers["authorization"] for r in server.requests] == ["Bearer " + KEY]
    assert "Incorrect API key provided" in str(info.value)
    assert KEY not in str(info.value) + repr(info.value)
    assert info.value.__cause__ is None and info.value.__context__ is None


def test_unusable_key_is_refused_without_showing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-has space")
    with pytest.raises(ConfigError) as info:
        OpenAIModel("http://127.0.0.1:1/v1")
    assert "OPENAI_API_KEY" in str(info.value)
    assert "has space" not in str(info.value)


def test_repr_hides_url_credentials() -> None:
    model = OpenAIModel("http://user:hunter2@127.0.0.1:1/v1")
    assert "hunter2" not in repr(model)


SSE = {"content-type": "text/event-stream"}
JSON = {"content-type": "application/json"}


@pytest.mark.anyio
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize(
    ("status", "headers", "body", "error"),
    [
        (200, SSE, b"data: {not json\n\n", ModelProtocolError),
        (200, JSON, b'{"choices": []}', ModelProtocolError),
        (200, {**SSE, "content-encoding": "gzip"}, b"\x1f\x8b", ModelProtocolError),
        (200, SSE, b'data: {"choices": []}\n\n', ModelStreamError),
        (200, SSE, b'data: {"error": {"message": "overloaded"}}\n\n', ModelStreamError),
        (429, {"retry-after": "7"}, b"slow down", ModelHTTPError),
    ],
    ids=["not-json", "json-answer", "encoded", "no-finish", "error-event", "429"],
)
async def test_malformed_or_failed_responses_raise_model_errors(
    status: int, headers: dict[str, str], body: bytes, error: type[ModelError], chunked: bool
) -> None:
    async def handler(_: RawRequest, __: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(answer(status, headers, body, chunked=chunked))
        return True

    async with raw_server(handler) as server:
        model = OpenAIModel(server.url)
        with pytest.raises(error) as info:
            await collect(model, user("hi"))
        await model.aclose()
    assert type(info.value) is error
    if isinstance(info.value, ModelHTTPError):
        assert (info.value.status, info.value.retry_after) == (429, 7.0)
        assert "slow down" in str(info.value)


@pytest.mark.anyio
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_stream_read_to_its_end_leaves_its_connection_for_the_next(chunked: bool) -> None:
    body = text_chunk("hello ") + text_chunk("world", "stop") + sse("[DONE]")

    async def handler(_: RawRequest, __: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(answer(200, SSE, body, chunked=chunked))
        return True

    async with raw_server(handler) as server:
        model = OpenAIModel(server.url)
        try:
            for _ in range(3):
                events = await collect(model, user("hi"))
                assert text_of(events) == "hello world"
                assert events[-1] == Finish("stop", 0, 0)
        finally:
            await model.aclose()
    assert [(r.connection, r.index) for r in server.requests] == [(0, 0), (0, 1), (0, 2)]
    request = server.requests[0]
    assert (request.method, request.target) == ("POST", "/v1/chat/completions")
    assert request.headers["accept"] == "text/event-stream"
    assert request.headers["content-type"] == "application/json"
    assert request.headers["host"] == f"127.0.0.1:{server.port}"
    assert json.loads(request.body)["stream"] is True


@pytest.mark.anyio
async def test_an_abandoned_stream_closes_its_connection_at_once() -> None:
    gone = asyncio.Event()

    async def handler(
        request: RawRequest, reader: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> bool:
        if request.connection == 0:
            # Two tokens, then nothing: the reply is far from its end when the client leaves.
            w.write(stream_head() + chunk(text_chunk("one ")) + chunk(text_chunk("two ")))
            await client_gone(reader)
            gone.set()
            return False
        w.write(answer(200, SSE, text_chunk("again", "stop") + sse("[DONE]")))
        return True

    async with raw_server(handler) as server:
        model = OpenAIModel(server.url)
        try:
            stream = model.stream(user("hi"), TOOLS, max_tokens=9)
            assert isinstance(stream, AsyncGenerator)
            first = await anext(stream)
            assert isinstance(first, TextDelta)
            await stream.aclose()  # what the agent does on an abort or a budget
            await asyncio.wait_for(gone.wait(), 10)
            after = await collect(model, user("hi"))
        finally:
            await model.aclose()
    assert text_of(after) == "again"
    assert [r.connection for r in server.requests] == [0, 1]


@pytest.mark.anyio
async def test_a_slow_head_or_a_stalled_stream_times_out() -> None:
    release = asyncio.Event()

    async def handler(
        request: RawRequest, reader: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> bool:
        if request.connection == 1:
            w.write(stream_head() + chunk(text_chunk("one ")))
        await release.wait()  # never set before the client has given up
        return False

    async with raw_server(handler) as server:
        model = OpenAIModel(server.url, timeout=0.3)
        try:
            started = time.monotonic()
            with pytest.raises(ModelTimeout) as head:
                await collect(model, user("hi"))
            got: list[ModelEvent] = []
            with pytest.raises(ModelTimeout) as stalled:
                async for event in model.stream(user("hi"), TOOLS, max_tokens=9):
                    got.append(event)
            elapsed = time.monotonic() - started
        finally:
            release.set()
            await model.aclose()
    assert "ReadTimeout" in str(head.value) and "ReadTimeout" in str(stalled.value)
    assert text_of(got) == "one "
    assert elapsed >= 0.6


@pytest.mark.anyio
async def test_url_credentials_are_sent_as_basic_and_never_shown() -> None:
    async def handler(_: RawRequest, __: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(answer(200, SSE, text_chunk("ok", "stop") + sse("[DONE]")))
        return True

    async with raw_server(handler) as server:
        url = server.url.replace("//", "//bob:hunter2@", 1)
        model = OpenAIModel(url)
        try:
            await collect(model, user("hi"))
            assert "hunter2" not in repr(model)
        finally:
            await model.aclose()
    assert server.requests[0].headers["authorization"] == "Basic Ym9iOmh1bnRlcjI="


@pytest.mark.anyio
async def test_a_proxy_named_by_the_environment_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    async def proxy(_: RawRequest, __: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(answer(200, SSE, text_chunk("proxied", "stop") + sse("[DONE]")))
        return True

    async def direct(_: RawRequest, __: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(answer(200, SSE, text_chunk("direct", "stop") + sse("[DONE]")))
        return True

    async with raw_server(proxy) as via, raw_server(direct) as server:
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{via.port}")
        model = OpenAIModel(server.url)
        try:
            proxied = await collect(model, user("hi"))
        finally:
            await model.aclose()
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        model = OpenAIModel(server.url)
        try:
            unproxied = await collect(model, user("hi"))
        finally:
            await model.aclose()
    assert text_of(proxied) == "proxied"
    # A proxy is asked for the absolute URL.
    assert [r.target for r in via.requests] == [f"{server.url}/chat/completions"]
    assert text_of(unproxied) == "direct"
    assert len(server.requests) == 1
