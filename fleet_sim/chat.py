"""``fleet-sim chat``: a small client for people. Prompts in, streamed frames out, over a
WebSocket through the edge, exactly as any client would hold a session."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any, TextIO

import websockets


def render(frame: dict[str, Any]) -> str | None:
    """One frame as a person wants to read it; None for frames not worth showing."""
    kind = frame.get("type")
    if kind == "catchup":
        return f"[session: {len(frame['messages'])} messages, leaf {frame['leaf_id'] or '-'}]\n"
    if kind == "event":
        event = frame["event"]
        name = event.get("kind")
        if name == "text_delta":
            return str(event["text"])
        if name == "tool_call":
            return f"\n[tool {event['name']} {event['arguments']}]\n"
        if name == "tool_result":
            first = str(event["content"]).strip().splitlines()[:3]
            return "[result] " + " | ".join(first) + "\n"
        if name == "turn_ended":
            return f"\n[turn {event['outcome']} ({event['reason']})]\n"
        if name == "error":
            return f"\n[error] {event['error']}\n"
        return None
    if kind == "response" and not frame.get("success"):
        return f"[{frame['command']} failed: {frame['error']}]\n"
    if kind in ("session_superseded", "error", "reconnect"):
        return f"[{kind}] {json.dumps(frame)}\n"
    return None


async def chat(
    edge: str, session_id: str, grant: str, message: str | None, out: TextIO = sys.stdout
) -> int:
    url = edge.replace("http", "ws", 1).rstrip("/") + f"/_beyond/agent?session_id={session_id}"
    try:
        async with websockets.connect(
            url, additional_headers={"x-beyond-grant": grant}, max_size=None
        ) as ws:
            first = render(json.loads(await ws.recv()))
            if first:
                out.write(first)
            prompts = [message] if message is not None else None
            while True:
                if prompts is not None:
                    if not prompts:
                        return 0
                    text = prompts.pop()
                else:
                    out.write("> ")
                    out.flush()
                    line = await asyncio.get_running_loop().run_in_executor(
                        None, sys.stdin.readline
                    )
                    if not line:
                        return 0
                    text = line.rstrip("\n").replace("\\n", "\n")
                    if not text.strip():
                        continue
                await ws.send(json.dumps({"type": "prompt", "message": text}))
                while True:
                    frame = json.loads(await ws.recv())
                    shown = render(frame)
                    if shown:
                        out.write(shown)
                        out.flush()
                    event = frame.get("event", {}) if frame.get("type") == "event" else {}
                    failed = frame.get("type") == "response" and not frame.get("success")
                    if event.get("kind") == "turn_ended" or failed:
                        break
    except websockets.InvalidStatus as exc:
        body = exc.response.body.decode(errors="replace").strip() if exc.response.body else ""
        print(f"fleet-sim chat: refused with {exc.response.status_code}: {body}", file=sys.stderr)
        return 1
    except (OSError, websockets.ConnectionClosed) as exc:
        print(f"fleet-sim chat: connection failed: {exc}", file=sys.stderr)
        return 1
