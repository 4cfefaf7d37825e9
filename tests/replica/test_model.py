from __future__ import annotations

import json
import time
from collections.abc import Sequence

import pytest

from replica.errors import ConfigError, ReplicaError
from replica.model import (
    ChatMessage,
    Finish,
    MockModel,
    MockSpec,
    ModelEvent,
    ModelHTTPError,
    ModelProvider,
    ModelStreamError,
    OpenAIModel,
    OpenAISpec,
    StubModel,
    StubSpec,
    TextDelta,
    ToolCall,
    ToolCallEvent,
    ToolSpec,
    make_provider,
    parse_model_spec,
)

TOOLS = (
    ToolSpec("bash", "run a shell command", {"type": "object"}),
    ToolSpec("job_output", "read a job's output", {"type": "object"}),
)


async def collect(
    provider: ModelProvider,
    messages: Sequence[ChatMessage],
    tools: Sequence[ToolSpec] = TOOLS,
    max_tokens: int = 1000,
) -> list[ModelEvent]:
    return [e async for e in provider.stream(messages, tools, max_tokens=max_tokens)]


def user(text: str) -> list[ChatMessage]:
    return [ChatMessage("system", "be brief"), ChatMessage("user", text)]


def text_of(events: Sequence[ModelEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def calls_of(events: Sequence[ModelEvent]) -> list[ToolCall]:
    return [e.call for e in events if isinstance(e, ToolCallEvent)]


def finish_of(events: Sequence[ModelEvent]) -> Finish:
    assert isinstance(events[-1], Finish)
    assert sum(isinstance(e, Finish) for e in events) == 1
    return events[-1]


@pytest.mark.anyio
async def test_mock_plain_reply_echoes_prompt_in_several_deltas() -> None:
    events = await collect(MockModel(), user("explain  the\nring hash"))
    assert text_of(events) == "ok: explain the ring hash"
    deltas = [e for e in events if isinstance(e, TextDelta)]
    assert len(deltas) == 5
    finish = finish_of(events)
    assert finish.reason == "stop"
    assert finish.completion_tokens == 5
    assert finish.prompt_tokens == 2 + 4


@pytest.mark.anyio
async def test_mock_is_deterministic() -> None:
    messages = user("run: ls -la")
    assert await collect(MockModel(), messages) == await collect(MockModel(), messages)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("line", "name", "arguments"),
    [
        ("run: echo hi && ls", "bash", {"command": "echo hi && ls"}),
        ("bg: sleep 30", "bash", {"command": "sleep 30", "background": True}),
        ("read: job-7 4096", "job_output", {"job_id": "job-7", "offset": 4096}),
        ("read: job-7", "job_output", {"job_id": "job-7", "offset": 0}),
    ],
)
async def test_mock_directive_makes_a_tool_call(
    line: str, name: str, arguments: dict[str, object]
) -> None:
    events = await collect(MockModel(), user(f"please do this\n{line}\n"))
    [call] = calls_of(events)
    assert call.name == name
    assert json.loads(call.arguments) == arguments
    assert call.id.startswith("call_")
    assert text_of(events) == ""
    assert finish_of(events).reason == "tool_calls"


@pytest.mark.anyio
async def test_mock_answers_tool_result_by_quoting_its_first_line() -> None:
    first = await collect(MockModel(), user("run: printf 'a\\nb'"))
    [call] = calls_of(first)
    history = [
        *user("run: printf 'a\\nb'"),
        ChatMessage("assistant", "", (call,)),
        ChatMessage("tool", "\n  alpha line \nbeta\n", tool_call_id=call.id),
    ]
    events = await collect(MockModel(), history)
    assert calls_of(events) == []
    assert text_of(events) == "result: alpha line"
    assert finish_of(events).reason == "stop"


@pytest.mark.anyio
async def test_mock_issues_directives_one_step_at_a_time() -> None:
    history = user("run: make\nbg: ./serve\nread: j1 10")
    seen: list[str] = []
    for step in range(4):
        events = await collect(MockModel(), history)
        calls = calls_of(events)
        if not calls:
            break
        assert len(calls) == 1
        seen.append(calls[0].name)
        history += [
            ChatMessage("assistant", "", tuple(calls)),
            ChatMessage("tool", f"output {step}", tool_call_id=calls[0].id),
        ]
    assert seen == ["bash", "bash", "job_output"]
    assert text_of(events) == "result: output 2"


@pytest.mark.anyio
async def test_mock_parallel_calls_come_in_one_reply_with_distinct_ids() -> None:
    events = await collect(MockModel(), user("calls: parallel\nrun: a\nrun: b"))
    calls = calls_of(events)
    assert [json.loads(c.arguments)["command"] for c in calls] == ["a", "b"]
    assert len({c.id for c in calls}) == 2
    history = [
        *user("calls: parallel\nrun: a\nrun: b"),
        ChatMessage("assistant", "", tuple(calls)),
        ChatMessage("tool", "A out", tool_call_id=calls[0].id),
        ChatMessage("tool", "B out", tool_call_id=calls[1].id),
    ]
    assert text_of(await collect(MockModel(), history)) == "result: A out | B out"


@pytest.mark.anyio
async def test_mock_never_calls_a_tool_it_was_not_offered() -> None:
    events = await collect(MockModel(), user("run: ls"), tools=())
    assert calls_of(events) == []
    assert finish_of(events).reason == "stop"


@pytest.mark.anyio
async def test_words_directive_sets_reply_length() -> None:
    events = await collect(MockModel(), user("words: 120\nsummarise"))
    words = text_of(events).split()
    assert len(words) == 120
    assert words[:2] == ["ok:", "summarise"]


@pytest.mark.anyio
async def test_max_tokens_cuts_the_reply_with_length() -> None:
    events = await collect(MockModel(), user("words: 50\nx"), max_tokens=7)
    assert len(text_of(events).split()) == 7
    finish = finish_of(events)
    assert (finish.reason, finish.completion_tokens) == ("length", 7)
    cut_call = await collect(MockModel(), user("run: " + "word " * 20), max_tokens=3)
    assert calls_of(cut_call) == []
    assert finish_of(cut_call).reason == "length"


@pytest.mark.anyio
async def test_error_directive_raises_http_error() -> None:
    with pytest.raises(ModelHTTPError) as info:
        await collect(MockModel(), user("error: 503"))
    assert info.value.status == 503
    assert info.value.retryable
    assert isinstance(info.value, ReplicaError)
    with pytest.raises(ModelHTTPError) as info:
        await collect(MockModel(), user("error: 400"))
    assert not info.value.retryable


@pytest.mark.anyio
async def test_hangup_directive_breaks_the_stream_after_n_units() -> None:
    events: list[ModelEvent] = []
    with pytest.raises(ModelStreamError):
        async for event in MockModel().stream(user("words: 10\nhangup: 3"), TOOLS, max_tokens=99):
            events.append(event)
    assert len(events) == 3
    assert all(isinstance(e, TextDelta) for e in events)


@pytest.mark.anyio
async def test_stub_waits_ttft_then_streams_declared_tokens() -> None:
    stub = StubModel(ttft_s=0.15, per_token_s=0.005, tokens=20)
    started = time.monotonic()
    first_at: float | None = None
    events: list[ModelEvent] = []
    async for event in stub.stream(user("hello"), TOOLS, max_tokens=1000):
        if first_at is None:
            first_at = time.monotonic() - started
        events.append(event)
    elapsed = time.monotonic() - started
    assert first_at is not None and first_at >= 0.15
    assert elapsed >= 0.15 + 19 * 0.005
    assert [type(e) for e in events] == [TextDelta] * 20 + [Finish]
    assert finish_of(events).completion_tokens == 20
    assert text_of(events).startswith("ok: hello ")


@pytest.mark.anyio
async def test_stub_with_a_tick_gives_every_token_due_together() -> None:
    """One wake a tick, not one per token: the same text, in fewer deltas, never early."""
    exact = await collect(StubModel(ttft_s=0.0, per_token_s=0.005, tokens=40), user("hello"))
    started = time.monotonic()
    ticked = await collect(
        StubModel(ttft_s=0.0, per_token_s=0.005, tokens=40, tick_s=0.05), user("hello")
    )
    elapsed = time.monotonic() - started
    assert text_of(ticked) == text_of(exact)
    assert elapsed >= 39 * 0.005
    deltas = [e for e in ticked if isinstance(e, TextDelta)]
    # 0.195 s of tokens at one wake per 0.05 s: the first at once, then at most four more.
    assert 2 <= len(deltas) <= 6 < len([e for e in exact if isinstance(e, TextDelta)])
    assert finish_of(ticked) == finish_of(exact)


@pytest.mark.anyio
async def test_stub_tool_call_follows_directives_after_ttft() -> None:
    stub = StubModel(ttft_s=0.1, per_token_s=0.001, tokens=5)
    started = time.monotonic()
    events = await collect(stub, user("run: uname -a"))
    assert time.monotonic() - started >= 0.1
    assert calls_of(events) == calls_of(await collect(MockModel(), user("run: uname -a")))
    assert [type(e) for e in events] == [ToolCallEvent, Finish]


def test_chat_message_rejects_inconsistent_shapes() -> None:
    call = ToolCall("c1", "bash", "{}")
    with pytest.raises(ValueError, match="tool_call_id"):
        ChatMessage("tool", "out")
    with pytest.raises(ValueError, match="tool_call_id"):
        ChatMessage("user", "hi", tool_call_id="c1")
    with pytest.raises(ValueError, match="tool calls"):
        ChatMessage("user", "hi", (call,))
    with pytest.raises(ValueError, match="role"):
        ChatMessage("robot", "hi")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("mock", MockSpec()),
        ("stub", StubSpec(0.3, 0.012, 200)),
        ("stub:ttft=300ms,per_token=12ms,tokens=200", StubSpec(0.3, 0.012, 200)),
        ("stub:tokens=50", StubSpec(0.3, 0.012, 50)),
        ("stub:ttft=1.5s", StubSpec(1.5, 0.012, 200)),
        ("stub:tick=0ms", StubSpec(0.3, 0.012, 200, 0.0)),
        ("stub:tick=10ms,tokens=5", StubSpec(0.3, 0.012, 5, 0.01)),
        ("stub:per_token=0ms,ttft=0s", StubSpec(0.0, 0.0, 200)),
        ("openai:http://127.0.0.1:8000/v1", OpenAISpec("http://127.0.0.1:8000/v1")),
        ("openai:http://127.0.0.1:8000/v1/", OpenAISpec("http://127.0.0.1:8000/v1")),
        (
            "openai:https://api.example.test/v1#model=gpt-4.1&key_env=MY_KEY&timeout=30s",
            OpenAISpec("https://api.example.test/v1", "gpt-4.1", "MY_KEY", 30.0),
        ),
    ],
)
def test_parse_model_spec_accepts(spec: str, expected: object) -> None:
    assert parse_model_spec(spec) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "unknown provider"),
        ("gpt4", "unknown provider"),
        ("mock:fast", "mock takes no options"),
        ("stub:ttft=300", "duration"),
        ("stub:ttft=-1ms", "duration"),
        ("stub:ttft=1h", "duration"),
        ("stub:speed=2", "unknown option 'speed'"),
        ("stub:tokens=0", "tokens"),
        ("stub:tokens=many", "tokens"),
        ("stub:tokens=5,tokens=6", "given twice"),
        ("stub:ttft", "KEY=VALUE"),
        ("openai:", "URL"),
        ("openai:127.0.0.1:8000", "URL"),
        ("openai:ftp://127.0.0.1/v1", "URL"),
        ("openai:http://127.0.0.1/v1#model=", "KEY=VALUE"),
        ("openai:http://127.0.0.1/v1#temperature=1", "unknown option"),
        ("openai:http://127.0.0.1/v1#key_env=not-a-name", "environment variable"),
        ("openai:http://127.0.0.1/v1#timeout=0s", "positive"),
    ],
)
def test_parse_model_spec_rejects(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_model_spec(spec)


def test_spec_errors_never_show_url_credentials() -> None:
    with pytest.raises(ConfigError) as info:
        parse_model_spec("openai:http://bob:hunter2@127.0.0.1/v1#colour=red")
    assert "hunter2" not in str(info.value)


@pytest.mark.anyio
async def test_make_provider_builds_what_the_spec_names() -> None:
    assert isinstance(make_provider("mock"), MockModel)
    stub = make_provider("stub:ttft=5ms,per_token=1ms,tokens=3")
    assert isinstance(stub, StubModel)
    assert (stub.ttft_s, stub.per_token_s, stub.tokens) == (0.005, 0.001, 3)
    remote = make_provider(OpenAISpec("http://127.0.0.1:9/v1", model="m1"))
    assert isinstance(remote, OpenAIModel)
    assert remote.model == "m1"
    await remote.aclose()
