"""The session protocol: commands in, frames out. Pure: no I/O, no session state.

A command is one JSON object (a WebSocket text message or a POST body); every frame is one JSON
object. ``parse_command`` is strict and bounded: anything it returns is safe to act on, anything
else is a :class:`~replica.errors.BadRequest` whose message can go back to the client as is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring as _encode_string  # C, where built
from typing import Any

from replica.errors import BadRequest
from replica.transcript import new_id

MAX_COMMAND_BYTES = 8 * 1024 * 1024
MAX_PROMPT_CHARS = 1024 * 1024
MAX_ID_CHARS = 128
MAX_QUERY_CHARS = 256
LIST_DEFAULT = 50
LIST_CAP = 500

COMMANDS = frozenset(
    {"prompt", "abort", "get_messages", "get_state", "list_sessions", "new_session", "job_ended"}
)


@dataclass(frozen=True, slots=True)
class Command:
    type: str
    id: str
    message: str = ""
    since: str | None = None
    query: str = ""
    limit: int = LIST_DEFAULT
    job_id: str | None = None


def _reject_constant(value: str) -> None:
    raise ValueError(f"{value} is not JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _unicode(value: str, key: str) -> str:
    """JSON escapes can spell lone surrogates, which no UTF-8 writer (the store, a socket)
    accepts: refuse them here rather than fail later."""
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError:
            raise BadRequest(f"'{key}' must be valid Unicode (no lone surrogates)") from None
    return value


def _optional_str(obj: Mapping[str, Any], key: str, limit: int) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= limit:
        raise BadRequest(f"'{key}' must be a string of 1-{limit} characters")
    return _unicode(value, key)


def parse_command(raw: str | bytes) -> Command:
    if len(raw) > MAX_COMMAND_BYTES:
        raise BadRequest(f"a command is at most {MAX_COMMAND_BYTES} bytes")
    try:
        obj = json.loads(raw, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        # UnicodeDecodeError is a ValueError too; the reason never quotes the input.
        raise BadRequest(f"a command must be one JSON object: {type(exc).__name__}") from None
    if not isinstance(obj, dict):
        raise BadRequest("a command must be a JSON object")
    kind = obj.get("type")
    if not isinstance(kind, str) or kind not in COMMANDS:
        raise BadRequest(f"unknown command type; expected one of {', '.join(sorted(COMMANDS))}")
    command_id = _optional_str(obj, "id", MAX_ID_CHARS) or new_id("c")
    if kind == "prompt":
        message = obj.get("message")
        if not isinstance(message, str) or not message.strip():
            raise BadRequest("prompt needs a non-empty 'message' string")
        if len(message) > MAX_PROMPT_CHARS:
            raise BadRequest(f"a prompt is at most {MAX_PROMPT_CHARS} characters")
        return Command(kind, command_id, message=_unicode(message, "message"))
    if kind == "get_messages":
        return Command(kind, command_id, since=_optional_str(obj, "since", MAX_ID_CHARS))
    if kind == "list_sessions":
        query = obj.get("query", "")
        if not isinstance(query, str) or len(query) > MAX_QUERY_CHARS:
            raise BadRequest(f"'query' must be a string of at most {MAX_QUERY_CHARS} characters")
        limit = obj.get("limit", LIST_DEFAULT)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise BadRequest("'limit' must be a positive integer")
        return Command(kind, command_id, query=_unicode(query, "query"), limit=min(limit, LIST_CAP))
    if kind == "job_ended":
        return Command(kind, command_id, job_id=_optional_str(obj, "job_id", MAX_ID_CHARS))
    return Command(kind, command_id)


# Frames. Each constructor returns a plain dict; the session serialises it once for every reader.


def ack(command: Command) -> dict[str, Any]:
    return {"type": "ack", "id": command.id, "command": command.type}


def response(command: Command, data: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "type": "response",
        "id": command.id,
        "command": command.type,
        "success": True,
        "data": data,
    }


def failure(command: Command, error: str) -> dict[str, Any]:
    return {
        "type": "response",
        "id": command.id,
        "command": command.type,
        "success": False,
        "error": error,
    }


def event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": "event", "event": {"kind": kind, **fields}}


def committed(leaf_id: str | None) -> dict[str, Any]:
    return {"type": "committed", "leaf_id": leaf_id}


def catchup(
    messages: Sequence[Mapping[str, Any]], leaf_id: str | None, turn: Sequence[Any], truncated: bool
) -> dict[str, Any]:
    return {
        "type": "catchup",
        "messages": list(messages),
        "leaf_id": leaf_id,
        "turn": list(turn),
        "turn_truncated": truncated,
    }


def superseded(session_id: str) -> dict[str, Any]:
    return {"type": "session_superseded", "session_id": session_id}


def error(message: str) -> dict[str, Any]:
    return {"type": "error", "error": message}


# Characters str.splitlines() breaks on that JSON leaves raw: an SSE writer splitting data into
# lines (sse-starlette does) would cut a frame at them. Inside a JSON string, which is the only
# place a non-ASCII character can stand, the escape is the same value.
_LINE_BREAKS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def text_delta_json(run_id: str, text: str) -> str:
    """``dumps(event("text_delta", run_id=run_id, text=text))`` without building and walking a
    dict: the frame a stream sends most, so it is put together from its two encoded strings."""
    out = (
        '{"type":"event","event":{"kind":"text_delta","run_id":'
        + _encode_string(run_id)
        + ',"text":'
        + _encode_string(text)
        + "}}"
    )
    if out.isascii():
        return out
    return dumps(event("text_delta", run_id=run_id, text=text))


def dumps(frame: Mapping[str, Any]) -> str:
    text = json.dumps(frame, separators=(",", ":"), ensure_ascii=False)
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            # A lone surrogate somewhere: escaped, the frame is still the same JSON value.
            return json.dumps(frame, separators=(",", ":"))
        text = text.translate(_LINE_BREAKS)
    return text
