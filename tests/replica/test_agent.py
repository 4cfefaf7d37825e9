from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from replica.agent import (
    DEFAULT_BUDGET,
    TITLE_CHARS,
    TurnBudget,
    TurnDeps,
    make_title,
    run_turn,
    to_chat,
)
from replica.coalescing import DEFAULT_COALESCING, Coalescing
from replica.live import LiveSession, SessionContext, Subscriber
from replica.locking import NoLocking
from replica.model import MockModel, StubModel
from replica.model_types import (
    ChatMessage,
    Finish,
    ModelEvent,
    ModelStreamError,
    TextDelta,
    ToolCall,
    ToolCallEvent,
    ToolSpec,
)
from replica.store import SessionStore
from replica.tools import NotifyTarget
from replica.transcript import Message
from tests.harness import eventually_async
from wire.names import parse_session_id

pytestmark = pytest.mark.anyio
T = TypeVar("T")
DEK = bytes(range(32))
SID = parse_session_id("a07-s1.agent1")
CONTEXT = SessionContext("http://127.0.0.1:9/exec", (), "/work/repo", DEK)


@dataclass
class Exec:
    stdout: str
    stderr: str = ""
    exit_code: int | None = 0
    timed_out: bool = False


@dataclass
class Job:
    job_id: str


@dataclass
class FakeSandbox:
    """Runs nothing: answers each command with a scripted result and records what it was asked."""

    hang: bool = False
    commands: list[tuple[str, float]] = field(default_factory=list)
    started: list[tuple[str, str | None, str | None]] = field(default_factory=list)

    async def exec(self, command: str, timeout_s: float) -> Exec:
        self.commands.append((command, timeout_s))
        if self.hang:
            await asyncio.sleep(60)
        return Exec(f"out of {command}\nsecond line")

    async def start_job(
        self, command: str, notify_url: str | None, notify_token: str | None
    ) -> Job:
        self.started.append((command, notify_url, notify_token))
        return Job(f"j{len(self.started)}")

    async def jobs(self) -> list[Any]:
        return []

    async def job_output(self, job_id: str, offset: int, limit: int) -> Any:
        raise AssertionError("not used")

    async def kill(self, job_id: str) -> Any:
        raise AssertionError("a turn never kills a job")


class ToolLoop:
    """A model that calls bash on every step, reporting ``tokens`` completion tokens each."""

    def __init__(self, tokens: int = 1, fail_on_step: int | None = None) -> None:
        self.tokens = tokens
        self.fail_on_step = fail_on_step
        self.max_tokens: list[int] = []

    async def stream(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], *, max_tokens: int
    ) -> AsyncIterator[ModelEvent]:
        step = len(self.max_tokens)
        self.max_tokens.append(max_tokens)
        await asyncio.sleep(0)  # a model's stream yields to the loop, as a real one does
        if step == self.fail_on_step:
            raise ModelStreamError("stream broke off")
        yield TextDelta(f"step {step}")
        yield ToolCallEvent(ToolCall(f"call{step}", "bash", json.dumps({"command": "true"})))
        yield Finish("tool_calls", 10, self.tokens)

    async def aclose(self) -> None:
        return None


async def run_io(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.to_thread(fn, *args)


@dataclass
class Rig:
    store: SessionStore
    live: LiveSession
    reader: Subscriber
    sandbox: FakeSandbox
    emitted: list[dict[str, Any]]

    def deps(self, model: Any, budget: TurnBudget = DEFAULT_BUDGET) -> TurnDeps:
        return TurnDeps(
            model=model,
            sandbox=lambda live: self.sandbox,
            notify=lambda live: NotifyTarget("http://127.0.0.1:9/notify", "bjn_v1.tok.mac"),
            emit=self.emitted.append,
            budget=budget,
        )

    def frames(self) -> list[dict[str, Any]]:
        out = [json.loads(item.text) for item in self.reader.queue]
        self.reader.queue.clear()
        return out

    def history(self) -> tuple[list[Message], int]:
        history = self.store.read("acme", SID, DEK)
        return history.transcript.messages, history.batches


def make_rig(tmp_path: Path, coalescing: Coalescing) -> Iterator[Rig]:
    store = SessionStore(tmp_path)
    owned = store.open("acme", SID, DEK)
    live = LiveSession(
        "acme",
        SID,
        owned,
        CONTEXT,
        run_io=run_io,
        on_superseded=lambda s: None,
        coalescing=coalescing,
    )
    yield Rig(store, live, live.attach("ws"), FakeSandbox(), [])
    owned.release()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    yield from make_rig(tmp_path, DEFAULT_COALESCING)


@pytest.fixture
def held_rig(tmp_path: Path) -> Iterator[Rig]:
    """A rig whose coalescing window never closes within a test: text goes out only when the
    turn's next frame, or its end, sends it."""
    yield from make_rig(tmp_path, Coalescing(window_s=60.0))


def kinds(frames: list[dict[str, Any]]) -> list[str]:
    return [f["event"]["kind"] if f["type"] == "event" else f["type"] for f in frames]


def assert_every_call_answered(messages: Sequence[Message]) -> None:
    asked = [c["id"] for m in messages for c in m.extra.get("tool_calls", ())]
    answered = [m.extra["tool_call_id"] for m in messages if m.role == "tool"]
    assert asked == answered


async def test_plain_turn_commits_the_prompt_first_then_the_run(rig: Rig) -> None:
    seen_at_call: list[list[str]] = []

    class Watching(MockModel):
        def stream(
            self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], *, max_tokens: int
        ) -> AsyncIterator[ModelEvent]:
            # What is durable when the model is called: the prompt, already committed.
            seen_at_call.append(
                [m.content for m in rig.store.read("acme", SID, DEK).transcript.messages]
            )
            return super().stream(messages, tools, max_tokens=max_tokens)

    await run_turn(rig.live, "hello there", "r1", rig.deps(Watching()))
    assert seen_at_call == [["hello there"]]
    messages, batches = rig.history()
    assert batches == 2
    user, reply = messages
    assert (user.role, user.content, reply.role, reply.content) == (
        "user",
        "hello there",
        "assistant",
        "ok: hello there",
    )
    assert user.extra == {"run_id": "r1", "title": "hello there", "cwd": "/work/repo"}
    assert reply.extra == {"stop": "stop"} and reply.parent_id == user.id
    frames = rig.frames()
    assert kinds(frames)[:2] == ["turn_started", "committed"]
    assert kinds(frames)[-2:] == ["committed", "turn_ended"]
    assert frames[1]["leaf_id"] == user.id and frames[-2]["leaf_id"] == reply.id
    text = "".join(f["event"]["text"] for f in frames if kinds([f]) == ["text_delta"])
    assert text == "ok: hello there"
    assert frames[-1]["event"] == {
        "kind": "turn_ended",
        "run_id": "r1",
        "outcome": "succeeded",
        "reason": "stop",
    }
    assert rig.live.turn is None
    base = {"session_id": "a07-s1.agent1", "tenant": "acme", "run_id": "r1"}
    assert rig.emitted == [
        {
            "type": "session_named",
            "session_id": "a07-s1.agent1",
            "tenant": "acme",
            "title": "hello there",
        },
        {"type": "run", "phase": "started", **base},
        {"type": "run", "phase": "succeeded", "reason": "stop", **base},
    ]
    # A second turn names nothing and carries no title.
    rig.emitted.clear()
    await run_turn(rig.live, "again", "r2", rig.deps(MockModel()))
    assert [e["phase"] for e in rig.emitted] == ["started", "succeeded"]
    messages, batches = rig.history()
    assert batches == 4 and messages[2].extra == {"run_id": "r2"}
    assert messages[2].parent_id == reply.id


async def test_run_directive_calls_bash_and_feeds_the_result_back(rig: Rig) -> None:
    await run_turn(rig.live, "run: make test", "r1", rig.deps(MockModel()))
    messages, batches = rig.history()
    assert batches == 2
    assert [m.role for m in messages] == ["user", "assistant", "tool", "assistant"]
    call = messages[1].extra["tool_calls"]
    assert [c["name"] for c in call] == ["bash"]
    assert json.loads(call[0]["arguments"]) == {"command": "make test"}
    assert messages[2].extra["tool_call_id"] == call[0]["id"]
    assert messages[2].content.startswith("out of make test")
    assert messages[2].extra["exit_code"] == 0
    assert messages[3].content == "result: out of make test"
    assert messages[3].extra["stop"] == "stop"
    assert rig.sandbox.commands == [("make test", 60.0)]
    frames = rig.frames()
    assert "tool_call" in kinds(frames) and "tool_result" in kinds(frames)
    result = next(f["event"] for f in frames if kinds([f]) == ["tool_result"])
    assert result["id"] == call[0]["id"] and result["is_error"] is False
    assert_every_call_answered(messages)


async def test_background_job_gets_the_notify_target(rig: Rig) -> None:
    await run_turn(rig.live, "bg: ./serve", "r1", rig.deps(MockModel()))
    assert rig.sandbox.started == [("./serve", "http://127.0.0.1:9/notify", "bjn_v1.tok.mac")]
    messages, _ = rig.history()
    assert messages[2].extra["job_id"] == "j1" and messages[2].extra["background"] is True
    assert "bjn_v1" not in json.dumps([m.to_wire() for m in messages])


async def test_step_budget_answers_every_call(rig: Rig) -> None:
    model = ToolLoop()
    await run_turn(rig.live, "loop", "r1", rig.deps(model, TurnBudget(max_steps=3)))
    assert len(model.max_tokens) == 3 and len(rig.sandbox.commands) == 3
    messages, batches = rig.history()
    assert batches == 2 and len(messages) == 1 + 3 * 2
    assert_every_call_answered(messages)
    assert rig.emitted[-1]["phase"] == "succeeded"
    assert rig.emitted[-1]["reason"] == "budget_steps"


@pytest.mark.parametrize(
    ("budget", "reason"),
    [(TurnBudget(max_steps=2), "budget_steps"), (TurnBudget(max_tokens=100), "budget_tokens")],
)
async def test_budget_reason_is_recorded_in_the_transcript(
    rig: Rig, budget: TurnBudget, reason: str
) -> None:
    await run_turn(rig.live, "loop", "r1", rig.deps(ToolLoop(tokens=60), budget))
    assert rig.emitted[-1]["reason"] == reason
    messages, _ = rig.history()
    assert [m.extra.get("stop") for m in messages if "stop" in m.extra] == [reason]


async def test_token_budget_caps_each_call_and_ends_the_turn(rig: Rig) -> None:
    model = ToolLoop(tokens=60)
    budget = TurnBudget(max_tokens=100, max_tokens_per_call=80)
    await run_turn(rig.live, "loop", "r1", rig.deps(model, budget))
    # 80 (per call), then the 40 left; after 120 the budget is spent and no third call is made.
    assert model.max_tokens == [80, 40]
    assert rig.emitted[-1]["reason"] == "budget_tokens"
    messages, _ = rig.history()
    assert_every_call_answered(messages)


async def test_wall_time_budget_commits_the_partial_reply(rig: Rig) -> None:
    model = StubModel(ttft_s=0.0, per_token_s=0.02, tokens=500)
    started = time.monotonic()
    await run_turn(rig.live, "talk", "r1", rig.deps(model, TurnBudget(max_seconds=0.25)))
    assert time.monotonic() - started < 1.5
    messages, _ = rig.history()
    last = messages[-1]
    assert last.role == "assistant" and last.extra["stop"] == "budget_time"
    assert 0 < len(last.content.split()) < 100
    assert rig.emitted[-1]["reason"] == "budget_time"


async def test_wall_time_budget_answers_a_tool_call_that_never_returned(rig: Rig) -> None:
    rig.sandbox.hang = True
    started = time.monotonic()
    await run_turn(
        rig.live, "run: sleep 1000", "r1", rig.deps(MockModel(), TurnBudget(max_seconds=0.2))
    )
    assert time.monotonic() - started < 1.5
    messages, batches = rig.history()
    assert batches == 2 and [m.role for m in messages] == ["user", "assistant", "tool"]
    assert messages[2].content == "not run: the turn ended (budget_time)"
    assert_every_call_answered(messages)
    assert rig.emitted[-1]["reason"] == "budget_time"


async def test_abort_commits_the_partial_text(rig: Rig) -> None:
    model = StubModel(ttft_s=0.0, per_token_s=0.02, tokens=500)
    task = asyncio.create_task(run_turn(rig.live, "talk", "r1", rig.deps(model)))
    rig.live.turn_task = task
    deltas: list[str] = []

    def three_deltas() -> bool:
        nonlocal deltas
        deltas += [f["event"]["text"] for f in rig.frames() if kinds([f]) == ["text_delta"]]
        return len(deltas) >= 3

    await eventually_async(three_deltas, timeout=2.0, interval=0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    messages, batches = rig.history()
    assert batches == 2
    last = messages[-1]
    assert last.role == "assistant" and last.extra == {"stop": "aborted"}
    assert last.content.startswith("".join(deltas)) and len(last.content.split()) < 400
    frames = rig.frames()
    assert frames[-1]["event"]["outcome"] == "aborted"
    assert rig.emitted[-1] == {
        "type": "run",
        "phase": "aborted",
        "reason": "aborted",
        "session_id": "a07-s1.agent1",
        "tenant": "acme",
        "run_id": "r1",
    }
    assert rig.live.turn is None


async def test_abort_during_a_tool_call_answers_it(rig: Rig) -> None:
    rig.sandbox.hang = True
    task = asyncio.create_task(run_turn(rig.live, "run: sleep 1000", "r1", rig.deps(MockModel())))
    await eventually_async(lambda: rig.sandbox.commands, timeout=2.0, interval=0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    messages, _ = rig.history()
    assert messages[-1].content == "not run: the turn ended (aborted)"
    assert_every_call_answered(messages)


async def test_model_error_fails_the_turn_and_still_commits(rig: Rig) -> None:
    await run_turn(rig.live, "words: 30\nhangup: 3", "r1", rig.deps(MockModel()))
    messages, batches = rig.history()
    assert batches == 2 and messages[-1].role == "assistant"
    assert messages[-1].extra["stop"] == "error" and messages[-1].content
    frames = rig.frames()
    error = next(f["event"] for f in frames if kinds([f]) == ["error"])
    assert "broke off" in error["error"]
    assert frames[-1]["event"]["outcome"] == "failed"
    assert rig.emitted[-1]["phase"] == "failed" and rig.emitted[-1]["reason"] == "error"


async def test_model_error_after_a_tool_step_keeps_the_step(rig: Rig) -> None:
    await run_turn(rig.live, "loop", "r1", rig.deps(ToolLoop(fail_on_step=1)))
    messages, batches = rig.history()
    assert batches == 2 and [m.role for m in messages] == ["user", "assistant", "tool"]
    assert_every_call_answered(messages)
    assert rig.emitted[-1]["phase"] == "failed"


async def test_an_immediate_model_error_commits_only_the_prompt(rig: Rig) -> None:
    await run_turn(rig.live, "error: 503", "r1", rig.deps(MockModel()))
    messages, batches = rig.history()
    assert batches == 1 and [m.role for m in messages] == ["user"]
    assert rig.emitted[-1]["phase"] == "failed"


async def test_a_fenced_owner_never_calls_the_model(tmp_path: Path) -> None:
    store = SessionStore(tmp_path, locker=NoLocking())
    owned = store.open("acme", SID, DEK)
    store.open("acme", SID, DEK).release()  # a successor claims the next epoch
    live = LiveSession("acme", SID, owned, CONTEXT, run_io=run_io, on_superseded=lambda s: None)
    model = ToolLoop()
    emitted: list[dict[str, Any]] = []
    deps = TurnDeps(model, lambda s: FakeSandbox(), lambda s: None, emitted.append)
    try:
        await run_turn(live, "hello", "r1", deps)
    finally:
        owned.release()
    assert model.max_tokens == [] and emitted == [] and live.turn is None


def test_make_title() -> None:
    assert make_title("  fix   the\tbuild \nand more") == "fix the build"
    long = make_title("word " * 40)
    assert len(long) == TITLE_CHARS and long.endswith("…")
    assert make_title("x" * TITLE_CHARS) == "x" * TITLE_CHARS
    assert make_title("   ") == ""


def test_to_chat_maps_roles() -> None:
    messages = [
        Message("m1", None, "user", "hi", 1.0),
        Message(
            "m2",
            "m1",
            "assistant",
            "",
            1.0,
            {"tool_calls": [{"id": "c1", "name": "bash", "arguments": "{}"}]},
        ),
        Message("m3", "m2", "tool", "done", 1.0, {"tool_call_id": "c1"}),
        Message("m4", "m3", "event", "job j1 ended", 1.0),
        Message("m5", "m4", "system", "ignored", 1.0),
    ]
    chat = to_chat(messages)
    assert [m.role for m in chat] == ["system", "user", "assistant", "tool", "user"]
    assert chat[2].tool_calls == (ToolCall("c1", "bash", "{}"),)
    assert chat[3].tool_call_id == "c1" and chat[4].content == "[notice] job j1 ended"


async def test_a_new_conversation_is_named_again(rig: Rig) -> None:
    await run_turn(rig.live, "first topic", "r1", rig.deps(MockModel()))
    assert await rig.live.reset("a07-s1.archived") is not None
    rig.emitted.clear()
    await run_turn(rig.live, "second topic", "r2", rig.deps(MockModel()))
    assert [e["type"] for e in rig.emitted] == ["session_named", "run", "run"]
    assert rig.emitted[0]["title"] == "second topic"
    messages, _ = rig.history()
    assert [m.content for m in messages] == ["second topic", "ok: second topic"]
    assert messages[0].extra["title"] == "second topic"


async def test_abort_while_the_prompt_commits_ends_the_turn(rig: Rig) -> None:
    gate = asyncio.Event()
    asked = asyncio.Event()

    async def gated_io(fn: Callable[..., T], *args: Any) -> T:
        asked.set()
        await gate.wait()  # storage that has not answered yet
        return fn(*args)

    live = LiveSession(
        "acme", SID, rig.live.owned, CONTEXT, run_io=gated_io, on_superseded=lambda s: None
    )
    reader = live.attach("ws")
    task = asyncio.create_task(run_turn(live, "hello", "r1", rig.deps(MockModel())))
    await eventually_async(
        asked.is_set, timeout=2.0, message="the prompt's commit never reached storage"
    )
    assert live.turn is not None and not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert live.turn is None
    assert json.loads(reader.queue[-1].text)["event"]["kind"] == "turn_ended"


# -- text deltas coalesced ------------------------------------------------------------------------


class Chatty:
    """Says something in small deltas, then calls bash (once), then, if ``then`` says so,
    breaks off or hangs instead of finishing."""

    def __init__(self, pieces: Sequence[str], then: str = "finish") -> None:
        self.pieces = pieces
        self.then = then
        self.spoken = asyncio.Event()

    async def stream(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], *, max_tokens: int
    ) -> AsyncIterator[ModelEvent]:
        await asyncio.sleep(0)
        for piece in self.pieces:
            yield TextDelta(piece)
        self.spoken.set()
        if self.then == "break":
            raise ModelStreamError("stream broke off")
        if self.then == "hang":
            await asyncio.Event().wait()
        if messages[-1].role != "tool":
            yield ToolCallEvent(ToolCall("call0", "bash", json.dumps({"command": "true"})))
        yield Finish("tool_calls", 10, len(self.pieces))

    async def aclose(self) -> None:
        return None


def text_of(frames: list[dict[str, Any]]) -> str:
    return "".join(f["event"]["text"] for f in frames if kinds([f]) == ["text_delta"])


async def test_text_streamed_before_a_tool_call_is_sent_before_it(held_rig: Rig) -> None:
    model = Chatty(["let ", "me ", "look"])
    await run_turn(held_rig.live, "look", "r1", held_rig.deps(model, TurnBudget(max_steps=2)))
    frames = held_rig.frames()
    assert kinds(frames) == [
        "turn_started",
        "committed",
        "text_delta",  # the three deltas, one frame, sent by the tool call that follows
        "tool_call",
        "tool_result",
        "text_delta",  # the second step's, sent by the commit
        "committed",
        "turn_ended",
    ]
    assert text_of(frames) == "let me looklet me look"
    messages, _ = held_rig.history()
    assert [m.content for m in messages if m.role == "assistant"] == ["let me look"] * 2


async def test_a_model_error_comes_after_the_text_streamed_before_it(held_rig: Rig) -> None:
    model = Chatty(["half ", "a ", "thought"], then="break")
    await run_turn(held_rig.live, "think", "r1", held_rig.deps(model))
    frames = held_rig.frames()
    assert kinds(frames) == [
        "turn_started",
        "committed",
        "text_delta",
        "error",
        "committed",
        "turn_ended",
    ]
    messages, _ = held_rig.history()
    assert text_of(frames) == messages[-1].content == "half a thought"


async def test_an_abort_sends_the_gathered_text_before_the_turn_ends(held_rig: Rig) -> None:
    model = Chatty(["still ", "typing"], then="hang")
    task = asyncio.create_task(run_turn(held_rig.live, "go", "r1", held_rig.deps(model)))
    held_rig.live.turn_task = task
    await asyncio.wait_for(model.spoken.wait(), 5.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    frames = held_rig.frames()
    assert kinds(frames) == ["turn_started", "committed", "text_delta", "committed", "turn_ended"]
    assert frames[-1]["event"]["outcome"] == "aborted"
    messages, _ = held_rig.history()
    assert text_of(frames) == messages[-1].content == "still typing"
    assert held_rig.live._flush_timer is None  # nothing left to go out on a timer later
