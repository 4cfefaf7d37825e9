"""One agent turn: commit the prompt, stream the model, run its tool calls, commit the result.

The prompt is committed (and acknowledged with ``committed``) before the model is called, so a
replica lost mid-turn loses only the run, never what the user said. The run's messages are
committed as one batch when it ends, however it ends: finished, out of budget (steps, tokens or
wall time, all enforced here), failed, or aborted. Every tool call gets a result message, even one
the run never reached, so the conversation stays valid for the next model call.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from replica import protocol
from replica.live import LiveSession, LiveState, TurnBuffer
from replica.model_types import (
    ChatMessage,
    Finish,
    ModelError,
    ModelProvider,
    TextDelta,
    ToolCall,
    ToolCallEvent,
)
from replica.tools import TOOL_SPECS, NotifyTarget, Sandbox, ToolResult, run_tool
from replica.transcript import Message, new_message_id

SYSTEM_PROMPT = (
    "You are a coding agent working in a sandbox. Use the bash tool to run commands in the "
    "workspace; start long-running commands with background=true and read their output with "
    "job_output. Be brief."
)
TITLE_CHARS = 60


@dataclass(frozen=True, slots=True)
class TurnBudget:
    max_steps: int = 16
    max_tokens: int = 32_000
    max_seconds: float = 600.0
    max_tokens_per_call: int = 16_384


DEFAULT_BUDGET = TurnBudget()


@dataclass(frozen=True, slots=True)
class TurnDeps:
    model: ModelProvider
    sandbox: Callable[[LiveSession], Sandbox]
    notify: Callable[[LiveSession], NotifyTarget | None]
    emit: Callable[[dict[str, Any]], None]  # lifecycle events; never blocks
    budget: TurnBudget = DEFAULT_BUDGET


def clean(text: str) -> str:
    """Text from outside (a model's deltas, a tool's output) as valid Unicode: JSON escapes can
    spell lone surrogates, which no UTF-8 writer (store, socket, SSE) accepts."""
    return text if text.isascii() else text.encode("utf-8", "replace").decode("utf-8")


def make_title(prompt: str) -> str:
    line = " ".join(prompt.strip().splitlines()[0].split()) if prompt.strip() else ""
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"


def to_chat(messages: Sequence[Message]) -> list[ChatMessage]:
    chat = [ChatMessage("system", SYSTEM_PROMPT)]
    chat.extend(_chat_messages(messages))
    return chat


def chat_history(live: LiveSession) -> list[ChatMessage]:
    """The conversation in the model's vocabulary, converted once per message: the session keeps
    the converted prefix, and a turn converts only what was committed since."""
    transcript = live.owned.transcript
    cached = live.chat_cache
    if cached is None or cached[0] != transcript.resets or cached[1] > len(transcript):
        cached = (transcript.resets, 0, [ChatMessage("system", SYSTEM_PROMPT)])
    chat = cached[2]
    chat.extend(_chat_messages(transcript.messages[cached[1] :]))
    live.chat_cache = (transcript.resets, len(transcript), chat)
    return list(chat)


def _chat_messages(messages: Sequence[Message]) -> list[ChatMessage]:
    chat: list[ChatMessage] = []
    for message in messages:
        if message.role == "assistant":
            calls = tuple(
                ToolCall(str(c["id"]), str(c["name"]), str(c["arguments"]))
                for c in message.extra.get("tool_calls", ())
            )
            chat.append(ChatMessage("assistant", message.content, calls))
        elif message.role == "tool":
            chat.append(
                ChatMessage("tool", message.content, (), str(message.extra["tool_call_id"]))
            )
        elif message.role == "user":
            chat.append(ChatMessage("user", message.content))
        elif message.role == "event":
            chat.append(ChatMessage("user", f"[notice] {message.content}"))
    return chat


class _Run:
    """The state of one run: what it has produced so far, so any ending can commit it."""

    def __init__(self, live: LiveSession, run_id: str) -> None:
        self.live = live
        self.run_id = run_id
        self.pending: list[Message] = []
        self.text = ""  # the assistant text streamed so far in the current step
        self.open_calls: list[ToolCall] = []  # calls of the current step not yet answered
        self.tokens = 0

    def message(self, role: str, content: str, **extra: Any) -> Message:
        return Message(new_message_id(), None, role, content, time.time(), extra)

    def close_step(self, calls: Sequence[ToolCall], **extra: Any) -> None:
        tool_calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]
        if tool_calls:
            extra["tool_calls"] = tool_calls
        self.pending.append(self.message("assistant", self.text, **extra))
        self.text = ""
        self.open_calls = list(calls)

    def finish(self, reason: str) -> None:
        """Give every unanswered tool call a result and mark how the run ended."""
        if self.text:
            self.close_step((), stop=reason)
        for call in self.open_calls:
            self.pending.append(
                self.message("tool", f"not run: the turn ended ({reason})", tool_call_id=call.id)
            )
        self.open_calls = []
        for i in range(len(self.pending) - 1, -1, -1):
            last = self.pending[i]
            if last.role == "assistant":
                self.pending[i] = Message(
                    last.id, None, last.role, last.content, last.ts, {**last.extra, "stop": reason}
                )
                break


async def run_turn(live: LiveSession, prompt: str, run_id: str, deps: TurnDeps) -> None:
    """The body of a turn task. Cancelling the task aborts the run (and still commits it)."""
    live.turn = TurnBuffer(run_id)
    try:
        await _turn(live, prompt, run_id, deps)
    finally:
        # Every ending publishes turn_ended, which sends the gathered text first; an ending that
        # raised before it (the final commit failing in storage) must not leave it to a timer.
        live.flush_text()
        live.turn = None  # however the turn ended, late readers must not see it replayed


async def _turn(live: LiveSession, prompt: str, run_id: str, deps: TurnDeps) -> None:
    live.publish(protocol.event("turn_started", run_id=run_id))
    first = len(live.owned.transcript) == 0
    extra: dict[str, Any] = {"run_id": run_id}
    if first:
        extra["title"] = make_title(prompt)
        extra["cwd"] = live.context.workspace_root
    user = Message(new_message_id(), None, "user", prompt, time.time(), extra)
    try:
        committed = await live.commit([user])
    except asyncio.CancelledError:
        live.publish(
            protocol.event("turn_ended", run_id=run_id, outcome="aborted", reason="aborted")
        )
        raise
    if committed is None:
        return  # no longer the owner: readers were told and closed
    base = {"session_id": live.session_id, "tenant": live.tenant, "run_id": run_id}
    if first:
        deps.emit(
            {
                "type": "session_named",
                "session_id": live.session_id,
                "tenant": live.tenant,
                "title": extra["title"],
            }
        )
    deps.emit({"type": "run", "phase": "started", **base})
    run = _Run(live, run_id)
    outcome, reason = "failed", "error"
    try:
        outcome, reason = await _steps(run, deps)
    except asyncio.CancelledError:
        outcome, reason = "aborted", "aborted"
        raise
    except ModelError as exc:
        live.publish(protocol.event("error", run_id=run_id, error=str(exc)))
    finally:
        run.finish(reason)
        # The batch is committed whatever ended the run. Being fenced during that commit
        # cancels this task (supersede); the run's end is still reported below.
        cancelled = False
        if run.pending:
            try:
                await asyncio.shield(live.commit(run.pending))
            except asyncio.CancelledError:
                cancelled = True
        if live.state is LiveState.SUPERSEDED:
            outcome, reason = "failed", "superseded"
        live.last_outcome = outcome
        live.publish(protocol.event("turn_ended", run_id=run_id, outcome=outcome, reason=reason))
        deps.emit({"type": "run", "phase": outcome, "reason": reason, **base})
        if cancelled:
            raise asyncio.CancelledError


async def _steps(run: _Run, deps: TurnDeps) -> tuple[str, str]:
    budget = deps.budget
    live = run.live
    chat = chat_history(live)
    # Made at the first tool call: most turns make none, and reading the offsets walks the
    # whole transcript. The transcript does not change until the run commits, so they are
    # what they would have been at the start.
    sandbox: Sandbox | None = None
    offsets: dict[str, int] = {}  # read on from where the model left off
    notify = functools.partial(deps.notify, live)  # minted only when a job is started
    try:
        async with asyncio.timeout(budget.max_seconds):
            for _ in range(budget.max_steps):
                remaining = budget.max_tokens - run.tokens
                if remaining <= 0:
                    return "succeeded", "budget_tokens"
                calls = await _stream_step(
                    run, deps.model, chat, min(remaining, budget.max_tokens_per_call)
                )
                chat.append(ChatMessage("assistant", run.pending[-1].content, tuple(calls)))
                if not calls:
                    return "succeeded", "stop"
                if sandbox is None:
                    sandbox = deps.sandbox(live)
                    offsets = live.owned.transcript.read_offsets()
                for call in calls:
                    result = await run_tool(sandbox, call, notify=notify, read_offsets=offsets)
                    result = ToolResult(clean(result.content), result.extra, result.is_error)
                    live.publish(
                        protocol.event(
                            "tool_result",
                            run_id=run.run_id,
                            id=call.id,
                            content=result.content,
                            is_error=result.is_error,
                        )
                    )
                    run.pending.append(
                        run.message("tool", result.content, tool_call_id=call.id, **result.extra)
                    )
                    run.open_calls.remove(call)
                    chat.append(ChatMessage("tool", result.content, (), call.id))
            return "succeeded", "budget_steps"
    except TimeoutError:
        return "succeeded", "budget_time"


async def _stream_step(
    run: _Run, model: ModelProvider, chat: list[ChatMessage], max_tokens: int
) -> list[ToolCall]:
    calls: list[ToolCall] = []
    events = model.stream(chat, TOOL_SPECS, max_tokens=max_tokens)
    try:
        async for item in events:
            if isinstance(item, TextDelta):
                text = clean(item.text)
                run.text += text
                run.live.publish_delta(run.run_id, text)
            elif isinstance(item, ToolCallEvent):
                call = item.call
                item = ToolCallEvent(
                    ToolCall(clean(call.id), clean(call.name), clean(call.arguments))
                )
                calls.append(item.call)
                run.live.publish(
                    protocol.event(
                        "tool_call",
                        run_id=run.run_id,
                        id=item.call.id,
                        name=item.call.name,
                        arguments=item.call.arguments,
                    )
                )
            elif isinstance(item, Finish):
                run.tokens += item.completion_tokens
    finally:
        # An abandoned stream (abort, budget) must release its connection at once.
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
    run.close_step(calls)
    return calls
