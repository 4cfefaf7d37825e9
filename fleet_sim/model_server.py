"""An OpenAI-compatible chat-completions server that answers from the scripted model.

It lets the replica's real HTTP client (``replica.model.OpenAIModel``) run against a local
process: the replies are the ones :class:`replica.model.MockModel` gives for the same
conversation (both call ``replica.model_script.plan_reply``), delivered in OpenAI's streamed
chunk format (a tool call's id and name first, its arguments in later fragments, usage in a
final chunk when asked for) on a declared latency: time to first token, then time per token.
The prompt directives ``error: STATUS`` and ``hangup: N`` make it answer an HTTP error or drop
the connection mid-stream, so client failure paths are exercised over a real socket.

    python -m fleet_sim.model_server --listen 127.0.0.1:8400 --ttft-ms 300 --per-token-ms 12

prints its base URL (``http://127.0.0.1:8400/v1``) once it is listening.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hmac
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from fleet_sim.serving import listen_arg
from replica import model_script
from replica.model import ChatMessage, Role, ToolCall

DEFAULT_MAX_TOKENS = 4096
_MAX_BODY = 32 * 1024 * 1024
_ROLES: Mapping[str, Role] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


@dataclass(frozen=True, slots=True)
class ModelServerConfig:
    ttft_s: float = 0.0
    per_token_s: float = 0.0
    tokens: int | None = None
    """Length in words of plain replies (as the stub's ``tokens``); None keeps the mock's."""
    api_key: str | None = field(default=None, repr=False)
    """When set, requests must carry ``Authorization: Bearer <api_key>``."""
    models: tuple[str, ...] = ("mock",)
    stamp: bool = False
    """Each word of a plain reply is the monotonic clock, in ns, at the moment it is sent (one
    clock for every process of the machine): a reader measures how long each took to reach it."""

    def __post_init__(self) -> None:
        if self.ttft_s < 0 or self.per_token_s < 0:
            raise ValueError("latencies must not be negative")
        if self.tokens is not None and self.tokens < 1:
            raise ValueError("tokens must be at least 1")


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """What a test may check about a request; the key itself is never kept."""

    path: str
    had_authorization: bool
    body: Mapping[str, Any]


class RequestLog:
    """The most recent requests, bounded so a long simulation does not grow it without end."""

    def __init__(self, keep: int = 256) -> None:
        self.total = 0
        self.recent: collections.deque[RecordedRequest] = collections.deque(maxlen=keep)

    def add(self, record: RecordedRequest) -> None:
        self.total += 1
        self.recent.append(record)


CONFIG = web.AppKey("model_server_config", ModelServerConfig)
REQUESTS = web.AppKey("model_server_requests", RequestLog)


class _BadRequest(Exception):
    pass


def _error(status: int, message: str, code: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return web.json_response(body, status=status)


def _authorized(request: web.Request, config: ModelServerConfig) -> bool:
    if config.api_key is None:
        return True
    presented = request.headers.get("Authorization", "")
    return hmac.compare_digest(presented.encode(), f"Bearer {config.api_key}".encode())


def _record(request: web.Request, body: Mapping[str, Any]) -> None:
    request.app[REQUESTS].add(
        RecordedRequest(request.path, "Authorization" in request.headers, body)
    )


async def _models(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    _record(request, {})
    if not _authorized(request, config):
        return _error(401, "missing or incorrect API key", "invalid_api_key")
    data = [
        {"id": m, "object": "model", "created": 0, "owned_by": "fleet-sim"} for m in config.models
    ]
    return web.json_response({"object": "list", "data": data})


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    config = request.app[CONFIG]
    try:
        body = await request.json()
    except ValueError:
        body = None
    _record(request, body if isinstance(body, dict) else {})
    if not _authorized(request, config):
        return _error(401, "missing or incorrect API key", "invalid_api_key")
    if not isinstance(body, dict):
        return _error(400, "the request body must be a JSON object")
    try:
        messages = _messages(body.get("messages"))
        tool_names = _tool_names(body.get("tools"))
        max_tokens = _max_tokens(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _BadRequest("stream must be a boolean")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise _BadRequest("stream_options must be an object")
    except _BadRequest as exc:
        return _error(400, str(exc))

    reply = model_script.plan_reply(
        messages, tool_names, max_tokens=max_tokens, default_words=config.tokens
    )
    if reply.error_status is not None:
        return _error(reply.error_status, f"scripted error {reply.error_status}")
    model = str(body.get("model", "mock"))
    if stream:
        return await _stream(request, config, reply, model, options.get("include_usage") is True)
    return await _complete(request, config, reply, model)


def _messages(raw: object) -> list[ChatMessage]:
    if not isinstance(raw, list) or not raw:
        raise _BadRequest("messages must be a non-empty array")
    out: list[ChatMessage] = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise _BadRequest(f"messages[{i}] must be an object")
        role = _ROLES.get(item.get("role", ""))
        if role is None:
            raise _BadRequest(f"messages[{i}].role is not one of {', '.join(_ROLES)}")
        calls = tuple(_tool_call(i, c) for c in _list(item.get("tool_calls"), i))
        call_id = item.get("tool_call_id")
        try:
            out.append(
                ChatMessage(
                    role,
                    _content(item.get("content"), i),
                    calls,
                    call_id if isinstance(call_id, str) else None,
                )
            )
        except ValueError as exc:
            raise _BadRequest(f"messages[{i}]: {exc}") from None
    return out


def _list(value: object, i: int) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _BadRequest(f"messages[{i}].tool_calls must be an array")
    return value


def _content(value: object, i: int) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        # The content-parts form: only text parts mean anything to the script.
        return "".join(
            p["text"]
            for p in value
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        )
    raise _BadRequest(f"messages[{i}].content must be a string, an array or null")


def _tool_call(i: int, raw: object) -> ToolCall:
    function = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or not isinstance(function, dict):
        raise _BadRequest(f"messages[{i}].tool_calls entries need a function object")
    call_id, name, arguments = raw.get("id"), function.get("name"), function.get("arguments")
    if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(arguments, str)):
        raise _BadRequest(f"messages[{i}].tool_calls entries need id, name and arguments strings")
    return ToolCall(call_id, name, arguments)


def _tool_names(raw: object) -> set[str]:
    if raw is None:
        return set()
    if not isinstance(raw, list):
        raise _BadRequest("tools must be an array")
    names: set[str] = set()
    for tool in raw:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _BadRequest("each tool needs type function and a function.name")
        names.add(function["name"])
    return names


def _max_tokens(body: Mapping[str, Any]) -> int:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is None:
        return DEFAULT_MAX_TOKENS
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _BadRequest("max_tokens must be a positive integer")
    return value


def _usage(reply: model_script.Reply) -> dict[str, int]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }


def _delta(unit: model_script.Unit) -> dict[str, Any]:
    if isinstance(unit, model_script.TextPiece):
        return {"content": unit.text}
    if isinstance(unit, model_script.CallStart):
        fragment = {
            "index": unit.index,
            "id": unit.id,
            "type": "function",
            "function": {"name": unit.name, "arguments": ""},
        }
    else:
        fragment = {"index": unit.index, "function": {"arguments": unit.text}}
    return {"tool_calls": [fragment]}


def _drop_connection(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()


async def _sleep_until(deadline: float) -> None:
    await asyncio.sleep(max(0.0, deadline - asyncio.get_running_loop().time()))


async def _stream(
    request: web.Request,
    config: ModelServerConfig,
    reply: model_script.Reply,
    model: str,
    include_usage: bool,
) -> web.StreamResponse:
    start = asyncio.get_running_loop().time()
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    base = {
        "id": "chatcmpl-" + secrets.token_hex(12),
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
    }

    async def send(payload: Mapping[str, Any] | str) -> None:
        data = payload if isinstance(payload, str) else json.dumps({**base, **payload})
        await response.write(f"data: {data}\n\n".encode())

    def choice(delta: Mapping[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    deltas: list[tuple[Mapping[str, Any], str | None]] = [(_delta(u), None) for u in reply.units]
    deltas.append(({}, reply.finish))
    try:
        await send(choice({"role": "assistant", "content": ""}))
        for i, (delta, finish) in enumerate(deltas):
            if i == reply.hangup_after:
                _drop_connection(request)
                return response
            due = start + model_script.unit_offset(i, config.ttft_s, config.per_token_s)
            await _sleep_until(due)
            if config.stamp and delta.get("content"):
                delta = {"content": f" {time.monotonic_ns()}"}
            await send(choice(delta, finish))
        if include_usage:
            await send({"choices": [], "usage": _usage(reply)})
        await send("[DONE]")
        await response.write_eof()
    except ConnectionResetError:
        # The client gave up (a timeout, an abort): nobody is left to answer.
        pass
    return response


async def _complete(
    request: web.Request, config: ModelServerConfig, reply: model_script.Reply, model: str
) -> web.StreamResponse:
    start = asyncio.get_running_loop().time()
    last = max(0, len(reply.units) - 1)
    await _sleep_until(start + model_script.unit_offset(last, config.ttft_s, config.per_token_s))
    if reply.hangup_after is not None and reply.hangup_after <= len(reply.units):
        _drop_connection(request)
        return web.Response(status=500)
    message: dict[str, Any] = {"role": "assistant", "content": reply.text or None}
    if reply.calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in reply.calls
        ]
    body = {
        "id": "chatcmpl-" + secrets.token_hex(12),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": reply.finish}],
        "usage": _usage(reply),
    }
    return web.json_response(body)


def make_app(config: ModelServerConfig) -> web.Application:
    app = web.Application(client_max_size=_MAX_BODY)
    app[CONFIG] = config
    app[REQUESTS] = RequestLog()
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    return app


async def start_model_server(
    host: str = "127.0.0.1", port: int = 0, config: ModelServerConfig | None = None
) -> tuple[web.AppRunner, str]:
    """Start serving on ``host:port`` (0 picks a free port); returns the runner and base URL.

    The caller owns the runner: ``await runner.cleanup()`` stops it. The request log is
    ``runner.app[REQUESTS]``.
    """
    # A short shutdown bound: an open stream must not hold a test or a fleet stop for a minute.
    runner = web.AppRunner(
        make_app(config or ModelServerConfig()), access_log=None, shutdown_timeout=2.0
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0]
    except BaseException:
        await runner.cleanup()
        raise
    bound_host, bound_port = bound[0], bound[1]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    return runner, f"http://{shown}:{bound_port}/v1"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fleet_sim.model_server",
        description="OpenAI-compatible scripted model server with a declared latency.",
    )
    parser.add_argument("--listen", type=listen_arg, required=True, metavar="HOST:PORT")
    parser.add_argument("--ttft-ms", type=float, default=0.0, help="time to first token")
    parser.add_argument("--per-token-ms", type=float, default=0.0, help="time per token")
    parser.add_argument("--tokens", type=int, default=None, help="words per plain reply")
    parser.add_argument(
        "--api-key-env", default=None, metavar="VAR", help="require the key held in VAR"
    )
    parser.add_argument(
        "--stamp",
        action="store_true",
        help="each word of a plain reply is the sender's monotonic clock in ns (for measuring "
        "how long tokens take to reach a client)",
    )
    return parser


def _config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ModelServerConfig:
    api_key = None
    if args.api_key_env is not None:
        api_key = os.environ.get(args.api_key_env) or None
        if api_key is None:
            parser.error(f"--api-key-env: {args.api_key_env} is not set")
    try:
        return ModelServerConfig(
            ttft_s=args.ttft_ms / 1000,
            per_token_s=args.per_token_ms / 1000,
            tokens=args.tokens,
            api_key=api_key,
            stamp=args.stamp,
        )
    except ValueError as exc:
        parser.error(str(exc))


async def _serve(host: str, port: int, config: ModelServerConfig) -> None:
    runner, url = await start_model_server(host, port, config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        print(url, flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    config = _config(args, parser)
    host, port = args.listen
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(host, port, config))
    else:
        uvloop.run(_serve(host, port, config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
