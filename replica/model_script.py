"""The scripted model: what the mock and stub providers and the simulator's model server answer.

One pure function, :func:`plan_reply`, turns a conversation into a :class:`Reply`, so the
in-process providers (``replica.model``) and the OpenAI-compatible test server
(``fleet_sim.model_server``) can never disagree about what a prompt produces. Nothing here
sleeps or does I/O; the callers decide how fast the units of a reply are delivered.

The last user message may carry directive lines (``key: value``, one per line):

``run: CMD``            call ``bash`` with ``{"command": CMD}``
``bg: CMD``             call ``bash`` with ``{"command": CMD, "background": true}``
``read: JOB [OFFSET]``  call ``job_output`` with ``{"job_id": JOB, "offset": OFFSET}`` (0)
``calls: parallel``     issue every tool directive in the first reply instead of one per step
``words: N``            plain replies are exactly N words long
``error: STATUS``       every reply fails as an HTTP error with that status (400-599)
``hangup: N``           every reply's stream breaks off after N units

Tool directives are issued one per model step, in order: step k (the number of assistant
tool-call messages since the last user message) issues directive k. A directive only fires if
its tool was offered, as a real model can only call the tools it is given. Once the directives
are used up and the conversation ends in tool results, the reply quotes the first line of each.
Any line that is not a well-formed directive is ordinary prompt text.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import re
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

ScriptFinish = Literal["stop", "tool_calls", "length"]

MAX_WORDS = 20_000
"""Upper bound of ``words: N`` so one prompt cannot make a reply of unbounded size."""

_PIECE = re.compile(r"\S{1,16}\s*|\s+")
_DIRECTIVE = re.compile(r"(run|bg|read|calls|words|error|hangup):\s*(.*)")
_FILLER = (
    "the",
    "change",
    "compiles",
    "and",
    "every",
    "test",
    "passes",
    "after",
    "a",
    "small",
    "fix",
    "in",
    "module",
    "code",
)
_QUOTE_CHARS = 200
_ECHO_CHARS = 80


class ScriptMessage(Protocol):
    """What the script reads of a message; ``replica.model.ChatMessage`` satisfies it."""

    @property
    def role(self) -> str: ...

    @property
    def content(self) -> str: ...

    @property
    def tool_calls(self) -> Sequence[object]: ...


@dataclass(frozen=True, slots=True)
class ScriptedCall:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class TextPiece:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    """A tool call's id and name, sent before any of its arguments (as OpenAI streams them)."""

    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgPiece:
    index: int
    text: str


Unit = TextPiece | CallStart | ArgPiece
"""One token's worth of output: one streamed chunk, spaced by the per-token time."""


@dataclass(frozen=True, slots=True)
class Reply:
    units: tuple[Unit, ...]
    calls: tuple[ScriptedCall, ...]
    """Complete tool calls; empty when the reply was cut short by ``max_tokens``."""
    finish: ScriptFinish
    prompt_tokens: int
    completion_tokens: int
    error_status: int | None = None
    hangup_after: int | None = None

    @property
    def text(self) -> str:
        return "".join(u.text for u in self.units if isinstance(u, TextPiece))


@dataclass(frozen=True, slots=True)
class _Directives:
    calls: tuple[tuple[str, str], ...]
    parallel: bool
    words: int | None
    error_status: int | None
    hangup_after: int | None
    prose: str


def pieces(text: str) -> tuple[str, ...]:
    """Split text into token-sized pieces whose concatenation is the text itself."""
    return tuple(_PIECE.findall(text))


@functools.lru_cache(maxsize=65536)
def count_tokens(text: str) -> int:
    # Cached: every call re-counts the whole conversation's prompt, message by message.
    return len(pieces(text))


def unit_offset(index: int, ttft_s: float, per_token_s: float) -> float:
    """Seconds after the request at which unit ``index`` is due under a declared latency.

    Callers sleep until this absolute offset rather than ``per_token_s`` after the previous
    unit, so scheduling jitter does not accumulate over a long reply.
    """
    return ttft_s + index * per_token_s


def units_due(elapsed_s: float, ttft_s: float, per_token_s: float) -> int:
    """How many units are due ``elapsed_s`` after the request (the inverse of
    ``unit_offset``); ``per_token_s`` must be above zero."""
    if elapsed_s < ttft_s:
        return 0
    count = int((elapsed_s - ttft_s) / per_token_s) + 1
    # Float division can land a hair either side of a whole number: settle it by the offsets.
    while count > 0 and unit_offset(count - 1, ttft_s, per_token_s) > elapsed_s:
        count -= 1
    while unit_offset(count, ttft_s, per_token_s) <= elapsed_s:
        count += 1
    return count


def plan_reply(
    messages: Sequence[ScriptMessage],
    tool_names: Collection[str],
    *,
    max_tokens: int,
    default_words: int | None = None,
) -> Reply:
    """Decide the next assistant reply for a conversation.

    ``default_words`` sets the length of plain replies when the prompt has no ``words:``
    directive (the stub's token count); ``None`` keeps the short echo.
    """
    if max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    prompt_tokens = sum(_message_tokens(m) for m in messages)
    last_user = _last_user_index(messages)
    directives = _parse(messages[last_user].content if last_user is not None else "")
    offered = [(n, a) for n, a in directives.calls if n in tool_names]
    step = 0 if last_user is None else sum(1 for m in messages[last_user + 1 :] if m.tool_calls)
    position = len(messages)

    if directives.parallel and offered:
        chosen = offered if step == 0 else []
    else:
        chosen = offered[step : step + 1]

    calls = tuple(
        ScriptedCall(_call_id(position, i, name, args), name, args)
        for i, (name, args) in enumerate(chosen)
    )
    if calls:
        units: list[Unit] = []
        for i, call in enumerate(calls):
            units.append(CallStart(i, call.id, call.name))
            units.extend(ArgPiece(i, p) for p in pieces(call.arguments))
        finish: ScriptFinish = "tool_calls"
    else:
        text = _text_reply(messages, directives, default_words)
        units = [TextPiece(p) for p in pieces(text)]
        finish = "stop"

    if len(units) > max_tokens:
        units = units[:max_tokens]
        calls = ()
        finish = "length"
    return Reply(
        units=tuple(units),
        calls=calls,
        finish=finish,
        prompt_tokens=prompt_tokens,
        completion_tokens=len(units),
        error_status=directives.error_status,
        hangup_after=directives.hangup_after,
    )


def _last_user_index(messages: Sequence[ScriptMessage]) -> int | None:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].role == "user":
            return i
    return None


def _message_tokens(message: ScriptMessage) -> int:
    # Tool calls are opaque here; their arguments count roughly as one token per call.
    return count_tokens(message.content) + len(message.tool_calls)


def _parse(content: str) -> _Directives:
    calls: list[tuple[str, str]] = []
    parallel = False
    words: int | None = None
    error_status: int | None = None
    hangup_after: int | None = None
    prose: list[str] = []
    for raw in content.splitlines():
        line = raw.strip()
        match = _DIRECTIVE.fullmatch(line)
        key, value = (match.group(1), match.group(2).strip()) if match else ("", "")
        if key == "run" and value:
            calls.append(("bash", json.dumps({"command": value})))
        elif key == "bg" and value:
            calls.append(("bash", json.dumps({"command": value, "background": True})))
        elif key == "read" and (read := _read_args(value)) is not None:
            calls.append(("job_output", json.dumps({"job_id": read[0], "offset": read[1]})))
        elif key == "calls" and value in ("parallel", "serial"):
            parallel = value == "parallel"
        elif key == "words" and (n := _int_in(value, 1, MAX_WORDS)) is not None:
            words = n
        elif key == "error" and (n := _int_in(value, 400, 599)) is not None:
            error_status = n
        elif key == "hangup" and (n := _int_in(value, 0, 1_000_000)) is not None:
            hangup_after = n
        else:
            prose.append(line)
    return _Directives(
        calls=tuple(calls),
        parallel=parallel,
        words=words,
        error_status=error_status,
        hangup_after=hangup_after,
        prose=" ".join(" ".join(prose).split()),
    )


def _read_args(value: str) -> tuple[str, int] | None:
    parts = value.split()
    if len(parts) == 1:
        return parts[0], 0
    if len(parts) == 2 and (offset := _int_in(parts[1], 0, 2**62)) is not None:
        return parts[0], offset
    return None


def _int_in(value: str, low: int, high: int) -> int | None:
    if not value.isascii() or not value.isdigit():
        return None
    n = int(value)
    return n if low <= n <= high else None


def _call_id(position: int, index: int, name: str, arguments: str) -> str:
    # The position in the conversation keeps ids unique across the steps of one transcript.
    digest = hashlib.sha256(f"{position}:{index}:{name}:{arguments}".encode()).hexdigest()
    return "call_" + digest[:20]


def _text_reply(
    messages: Sequence[ScriptMessage], directives: _Directives, default_words: int | None
) -> str:
    if messages and messages[-1].role == "tool":
        results = list(itertools.takewhile(lambda m: m.role == "tool", reversed(messages)))
        quoted = " | ".join(_first_line(m.content) for m in reversed(results))
        base = "result: " + quoted
    else:
        base = "ok: " + (directives.prose[:_ECHO_CHARS] or "(empty prompt)")
    target = directives.words if directives.words is not None else default_words
    if target is None:
        return base
    return " ".join(itertools.islice(_word_stream(base), target))


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:_QUOTE_CHARS]
    return "(empty)"


def _word_stream(base: str) -> Iterator[str]:
    yield from base.split()
    yield from itertools.cycle(_FILLER)
