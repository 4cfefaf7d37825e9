"""OpenAI chat-completions wire format: the request body and the streamed reply, without I/O.

:func:`request_body` writes a conversation the way OpenAI-compatible servers expect it;
:class:`SSEDecoder` splits a ``text/event-stream`` body into event data; :class:`StreamAssembler`
folds ``chat.completion.chunk`` objects into provider events. Keeping these pure lets the odd
shapes real servers send (interleaved tool-call fragments, a usage chunk after the finish, a
missing ``[DONE]``) be tested without a socket.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from replica.model_types import (
    ChatMessage,
    Finish,
    FinishReason,
    ModelEvent,
    ModelProtocolError,
    ModelStreamError,
    TextDelta,
    ToolCall,
    ToolCallEvent,
    ToolSpec,
)

MAX_EVENT_DATA = 8 * 1024 * 1024
"""Bound of one event's data, so a broken server cannot make the client buffer without end."""
MAX_TOOL_CALLS = 128
_MAX_SHOWN = 200
_FINISH_MAP: Mapping[str, FinishReason] = {
    "stop": "stop",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
    "length": "length",
}


def error_detail(raw: bytes) -> str:
    """The readable part of an error body: OpenAI's ``error.message`` or the text, shortened."""
    text = raw.decode("utf-8", errors="replace")
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        err = parsed.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            text = err["message"]
        elif isinstance(err, str):
            text = err
    return " ".join(text.split())[:_MAX_SHOWN]


def retry_after_seconds(value: str | None) -> float | None:
    """A ``Retry-After`` given in seconds; HTTP dates and absurd values are ignored."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if 0 <= seconds < 86_400 else None


def request_body(
    model: str, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], *, max_tokens: int
) -> dict[str, Any]:
    """The chat-completions request for a conversation, in OpenAI's wire format."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [_wire_message(m) for m in messages],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
    }
    if tools:
        # An empty tools array is rejected by OpenAI; no tools means no key at all.
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": dict(t.parameters),
                },
            }
            for t in tools
        ]
    return body


def _wire_message(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["content"] = message.content or None
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


class SSEDecoder:
    """Turns a ``text/event-stream`` body, fed as it arrives (:meth:`feed_bytes`, in whatever
    pieces the network gives) or line by line (:meth:`feed`), into the data of each event."""

    def __init__(self) -> None:
        self._data: list[str] = []
        self._size = 0
        self._partial = b""  # the start of a line whose end has not arrived

    def feed_bytes(self, chunk: bytes) -> list[str]:
        """The events completed by ``chunk``. Lines end in LF, CRLF or CR; a CR that ends a
        chunk waits for the next one, which may begin with its LF."""
        buffer = self._partial + chunk if self._partial else chunk
        held = buffer.endswith(b"\r")
        lines = (buffer[:-1] if held else buffer).splitlines(keepends=True)
        rest = b"\r" if held else b""
        if lines and not lines[-1].endswith((b"\n", b"\r")):
            rest = lines.pop() + rest
        if len(rest) > MAX_EVENT_DATA:
            raise ModelProtocolError("model server sent an oversized stream event")
        self._partial = rest
        out: list[str] = []
        for line in lines:
            out += self.feed(line.decode("utf-8", "replace"))
        return out

    def feed(self, line: str) -> list[str]:
        line = line.rstrip("\r\n")
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return []
        name, _, value = line.partition(":")
        if name == "data":
            value = value.removeprefix(" ")
            self._size += len(value)
            if self._size > MAX_EVENT_DATA:
                raise ModelProtocolError("model server sent an oversized stream event")
            self._data.append(value)
        return []

    def close(self) -> list[str]:
        partial, self._partial = self._partial, b""
        out = self.feed(partial.decode("utf-8", "replace")) if partial.strip(b"\r") else []
        return out + self._dispatch()

    def _dispatch(self) -> list[str]:
        if not self._data:
            return []
        data = "\n".join(self._data)
        self._data = []
        self._size = 0
        return [data]


def merge_text(events: list[ModelEvent]) -> list[ModelEvent]:
    """Consecutive text deltas as one (the order of everything else kept): what arrived in one
    read of the stream goes on at once anyway, and each delta costs the turn a step."""
    if len(events) < 2:
        return events
    out: list[ModelEvent] = []
    for event in events:
        if isinstance(event, TextDelta) and out and isinstance(out[-1], TextDelta):
            out[-1] = TextDelta(out[-1].text + event.text)
        else:
            out.append(event)
    return out


@dataclass(slots=True)
class _PartialCall:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class StreamAssembler:
    """Folds chat-completion chunks into provider events (pure; no I/O).

    Tool-call fragments are accumulated by their ``index``; the calls are emitted together when
    the finish reason arrives, because fragments of different indices may interleave and only
    then is every call known to be complete. ``Finish`` waits for ``[DONE]`` (or the end of
    the body) because the usage chunk comes after the finish reason.
    """

    def __init__(self) -> None:
        self._calls: dict[int, _PartialCall] = {}
        self._finish: FinishReason | None = None
        self._prompt_tokens = 0
        self._completion_tokens = 0
        self.done = False

    def feed_data(self, data: str) -> list[ModelEvent]:
        if self.done:
            return []
        if data.strip() == "[DONE]":
            self.done = True
            return self._final()
        try:
            chunk = json.loads(data)
        except ValueError:
            raise ModelProtocolError("model server sent a stream event that is not JSON") from None
        if not isinstance(chunk, dict):
            raise ModelProtocolError("model server sent a stream event that is not an object")
        return self.feed(chunk)

    def feed(self, chunk: Mapping[str, Any]) -> list[ModelEvent]:
        if chunk.get("error") is not None:
            raise ModelStreamError("model server reported an error: " + _error_text(chunk))
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self._prompt_tokens = _count(usage.get("prompt_tokens"))
            self._completion_tokens = _count(usage.get("completion_tokens"))
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return []
        events: list[ModelEvent] = []
        for choice in choices:
            # Only the first choice is ours; we never ask for n > 1.
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            if self._finish is not None:
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                content = delta.get("content")
                if isinstance(content, str) and content:
                    events.append(TextDelta(content))
                fragments = delta.get("tool_calls")
                if isinstance(fragments, list):
                    for position, fragment in enumerate(fragments):
                        self._merge(position, fragment)
            reason = choice.get("finish_reason")
            if isinstance(reason, str):
                events.extend(self._close(_FINISH_MAP.get(reason, "error")))
        return events

    def end_of_stream(self) -> list[ModelEvent]:
        if self.done:
            return []
        if self._finish is None:
            raise ModelStreamError("model stream ended before a finish reason")
        self.done = True
        return [self._finish_event()]

    def _merge(self, position: int, fragment: object) -> None:
        if not isinstance(fragment, dict):
            raise ModelProtocolError("model server sent a malformed tool-call fragment")
        index = fragment.get("index", position)
        if not isinstance(index, int) or not 0 <= index < MAX_TOOL_CALLS:
            raise ModelProtocolError("model server sent a tool-call fragment without an index")
        call = self._calls.setdefault(index, _PartialCall())
        if isinstance(fragment.get("id"), str) and fragment["id"] and not call.id:
            call.id = fragment["id"]
        function = fragment.get("function")
        if isinstance(function, dict):
            name = function.get("name")
            # Some servers repeat the whole name in every fragment, others split it.
            if isinstance(name, str) and name and name != call.name:
                call.name += name
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                call.arguments.append(arguments)

    def _close(self, reason: FinishReason) -> list[ModelEvent]:
        if reason == "stop" and self._calls:
            # Several OpenAI-compatible servers finish a tool-call reply with "stop".
            reason = "tool_calls"
        self._finish = reason
        if reason != "tool_calls":
            return []
        events: list[ModelEvent] = []
        for index in sorted(self._calls):
            partial = self._calls[index]
            if not partial.name:
                raise ModelProtocolError("model server sent a tool call without a name")
            arguments = "".join(partial.arguments) or "{}"
            call_id = partial.id or f"call_{index}"
            events.append(ToolCallEvent(ToolCall(call_id, partial.name, arguments)))
        return events

    def _final(self) -> list[ModelEvent]:
        events: list[ModelEvent] = []
        if self._finish is None:
            # A server that ends with [DONE] but never names a reason finished normally.
            events.extend(self._close("stop"))
        events.append(self._finish_event())
        return events

    def _finish_event(self) -> Finish:
        assert self._finish is not None
        return Finish(self._finish, self._prompt_tokens, self._completion_tokens)


def _error_text(chunk: Mapping[str, Any]) -> str:
    err = chunk.get("error")
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        text = err["message"]
    else:
        text = str(err)
    return " ".join(text.split())[:_MAX_SHOWN]


def _count(value: object) -> int:
    return value if isinstance(value, int) and value >= 0 else 0
