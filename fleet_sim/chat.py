"""``fleet-sim chat``: a small client for people. Prompts in, streamed frames out, over a
WebSocket through the edge, exactly as any client would hold a session."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from typing import Any, Final, TextIO

import websockets

from wire.http import AGENT_PATH, GRANT_HEADER, SESSION_ID_PARAM


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


RECONNECT_BUDGET_S: Final = 120.0  # the edge's retry budget: longer than a storage lease
RETRYABLE_STATUSES: Final = frozenset({502, 503, 504})


class Lost(Exception):
    """The session's connection is gone (or the replica asked us to come back)."""


@dataclass(slots=True)
class Turn:
    """The prompt whose turn has not ended yet, and how much of it has been shown."""

    text: str
    sent: bool = False
    shown: int = 0  # frames of the turn written out; a replay after a reconnect skips them


def after_reconnect(catchup: dict[str, Any], turn: Turn) -> str:
    """What became of ``turn`` while the connection was down, read from the new connection's
    catchup: ``running`` (the turn is replayed and goes on), ``ended`` (its reply was
    committed), ``lost`` (its prompt was committed, its replica went before the reply was) or
    ``unsent`` (nothing of it was committed: an ack is no promise, and sending it again cannot
    store it twice, since the epoch fence stops a replica that lost the session from
    committing anything)."""
    if catchup.get("turn"):
        return "running"
    messages = catchup.get("messages") or []
    asked = [
        i
        for i, m in enumerate(messages)
        if m.get("role") == "user" and m.get("content") == turn.text
    ]
    if asked:
        later = messages[asked[-1] + 1 :]
        return "ended" if any(m.get("role") == "assistant" for m in later) else "lost"
    return "unsent"


class Chat:
    """One person's hold on a session: prompts from stdin (or one ``message``), frames out."""

    def __init__(self, url: str, grant: str, message: str | None, out: TextIO) -> None:
        self.url = url
        self.grant = grant
        self.prompts = [message] if message is not None else None
        self.out = out
        self.turn: Turn | None = None
        self.failed = False  # a one-shot turn that did not end well

    async def hold(self, reconnect_budget_s: float) -> int:
        lost_at: float | None = None
        while True:
            try:
                async with websockets.connect(
                    self.url, additional_headers={GRANT_HEADER: self.grant}, max_size=None
                ) as ws:
                    await self._session(ws, resumed=lost_at is not None)
                    return 1 if self.failed else 0
            except websockets.InvalidStatus as exc:
                status = exc.response.status_code
                if status not in RETRYABLE_STATUSES or _spent(lost_at, reconnect_budget_s):
                    body = exc.response.body or b""
                    said = body.decode(errors="replace").strip()
                    print(f"fleet-sim chat: refused with {status}: {said}", file=sys.stderr)
                    return 1
            except (OSError, websockets.ConnectionClosed, Lost) as exc:
                if _spent(lost_at, reconnect_budget_s):
                    print(f"fleet-sim chat: connection failed: {exc}", file=sys.stderr)
                    return 1
                if lost_at is None:
                    self._write(f"\n[connection lost ({exc}); reconnecting]\n")
            lost_at = lost_at or time.monotonic()
            await asyncio.sleep(0.25)

    async def _session(self, ws: Any, *, resumed: bool) -> None:
        """Run over one connection until there is nothing more to send."""
        catchup = json.loads(await ws.recv())
        self._write(("[reconnected] " if resumed else "") + (render(catchup) or ""))
        if resumed and self.turn is not None:
            self._resume(catchup, self.turn)
        while True:
            if self.turn is None:
                text = await self._next_prompt()
                if text is None:
                    return
                self.turn = Turn(text)
            if not self.turn.sent:
                await ws.send(json.dumps({"type": "prompt", "message": self.turn.text}))
                self.turn.sent = True
            await self._follow(ws, self.turn)

    def _resume(self, catchup: dict[str, Any], turn: Turn) -> None:
        what = after_reconnect(catchup, turn)
        if what == "running":
            replay = list(catchup["turn"])
            for frame in replay[turn.shown :]:
                self._write(render(frame))
            turn.shown = len(replay)
            if any(_ends_turn(f) for f in replay):
                self.turn = None
        elif what == "ended":
            self._write("[the turn ended while the connection was down; its reply is above]\n")
            self.turn = None
        elif what == "lost":
            self._write("[the turn was lost with its replica; the session goes on]\n")
            self.failed = self.prompts is not None
            self.turn = None
        else:
            self._write("[the prompt was not stored before the connection went; sending again]\n")
            turn.sent, turn.shown = False, 0

    async def _follow(self, ws: Any, turn: Turn) -> None:
        while True:
            frame = json.loads(await ws.recv())
            kind = frame.get("type")
            if kind in ("reconnect", "session_superseded"):
                self._write(render(frame))
                raise Lost(str(kind))
            self._write(render(frame))
            if kind in ("event", "response"):
                turn.shown += kind == "event"
            if _ends_turn(frame):
                self.turn = None
                return

    async def _next_prompt(self) -> str | None:
        if self.prompts is not None:
            return self.prompts.pop() if self.prompts else None
        while True:
            self._write("> ")
            line: str = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            if not line:
                return None
            text = line.rstrip("\n").replace("\\n", "\n")
            if text.strip():
                return text

    def _write(self, text: str | None) -> None:
        if text:
            self.out.write(text)
            self.out.flush()


def _ends_turn(frame: dict[str, Any]) -> bool:
    if frame.get("type") == "response":
        return not frame.get("success")
    return frame.get("type") == "event" and frame["event"].get("kind") == "turn_ended"


def _spent(lost_at: float | None, budget_s: float) -> bool:
    return lost_at is not None and time.monotonic() - lost_at > budget_s


async def chat(
    edge: str,
    session_id: str,
    grant: str,
    message: str | None,
    out: TextIO = sys.stdout,
    *,
    reconnect_budget_s: float = RECONNECT_BUDGET_S,
) -> int:
    """Hold a session until stdin ends (or, with ``message``, for one turn). A lost connection
    (its replica died, drained or was fenced; the edge restarted) is made again within
    ``reconnect_budget_s``, and the turn in flight is followed on if it survived."""
    url = (
        edge.replace("http", "ws", 1).rstrip("/") + f"{AGENT_PATH}?{SESSION_ID_PARAM}={session_id}"
    )
    return await Chat(url, grant, message, out).hold(reconnect_budget_s)
