"""Real clients driving sessions through the real edge, journaling every operation.

A prompt carries a unique token (``op-`` + 12 hex digits) in its text so a checker can find it in
storage afterwards. Its outcome is ``ok`` only once the client saw the turn end successfully
with its batches committed; ``fail`` when it was refused (or gave up) before anything was sent;
``unknown`` when the connection broke (or the session was superseded) after the prompt went out.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import websockets
from websockets.asyncio.client import ClientConnection

from fleet_sim.sim.journal import Journal, Op

OP_TIMEOUT_S = 180.0  # longer than the edge's budget: the edge gives up first, not the client
# The websockets client's own ping interval and pong timeout, and how long it waits for the
# peer's close frame.
LIBRARY_KEEPALIVE_S = 20.0
LIBRARY_CLOSE_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Session:
    session_id: str
    tenant: str
    grant: str


def new_token() -> str:
    return "op-" + secrets.token_hex(6)


def _ws_url(edge: str, session_id: str, since: str | None = None) -> str:
    url = edge.replace("http", "ws", 1) + f"/_beyond/agent?session_id={session_id}"
    return url if since is None else f"{url}&since={since}"


RECONNECT_PAUSE_S = 0.2
# How long a client that finds a turn running when it connects waits for it to end.
RUNNING_TURN_WAIT_S = 10.0
# Close codes that say "the connection was lost, come back": going away, abnormal closure, the
# replica connection was lost (the edge's 1011), service restart, try again later (lagged).
RECONNECT_CODES = frozenset({1001, 1006, 1011, 1012, 1013})


@dataclass(slots=True)
class _Turn:
    """What one prompt's client has seen so far."""

    leaf: str | None
    sent: bool = False
    committed: int = 0
    reconnects: int = 0
    outcome: str = "unknown"
    detail: str = ""


class _Again(Exception):
    """Nothing was sent on this connection: connect again."""


async def _await_turn_end(ws: ClientConnection, turn: _Turn) -> None:
    """A turn was running when the client connected (its own previous one, given up on when a
    connection broke, which the session runs to its end regardless): wait for it to end before
    prompting, as a client must (a prompt during a turn is refused), or connect again for a
    fresh catch-up if it does not end soon. Its commits move the client's leaf on."""
    try:
        async with asyncio.timeout(RUNNING_TURN_WAIT_S):
            while True:
                frame = json.loads(await ws.recv())
                if frame.get("type") == "committed":
                    turn.leaf = frame.get("leaf_id") or turn.leaf
                elif frame.get("type") == "event" and frame["event"].get("kind") == "turn_ended":
                    return
    except TimeoutError:
        raise _Again from None


async def _prompt_on(ws: ClientConnection, turn: _Turn, token: str, message: str) -> None:
    catchup = json.loads(await ws.recv())
    if catchup.get("turn"):
        await _await_turn_end(ws, turn)
    await ws.send(json.dumps({"type": "prompt", "id": token, "message": message}))
    turn.sent = True
    while True:
        frame = json.loads(await ws.recv())
        kind = frame.get("type")
        if kind == "committed":
            turn.committed += 1
            turn.leaf = frame.get("leaf_id") or turn.leaf
        elif kind == "session_superseded":
            turn.detail = "superseded"
            return
        elif kind == "response" and not frame.get("success"):
            turn.outcome, turn.detail = "fail", str(frame.get("error"))
            return
        elif kind == "event" and frame["event"].get("kind") == "turn_ended":
            ended = frame["event"]
            if ended.get("outcome") == "succeeded" and turn.committed >= 2:
                turn.outcome = "ok"
            else:
                turn.detail = f"turn {ended.get('outcome')} ({ended.get('reason')})"
            return


async def prompt_ws(
    edge: str,
    session: Session,
    journal: Journal,
    *,
    text: str = "",
    since: str | None = None,
    timeout_s: float = OP_TIMEOUT_S,
    keepalive_s: float | None = None,
) -> Op:
    """One prompt over a fresh WebSocket through the edge. A client that keeps ``since`` (the
    last committed message id it saw, the op's ``figures["leaf"]``) is sent only what is newer,
    as a reconnecting client is; without it the catch-up carries the whole transcript.

    A connection that closes after its handshake but before the prompt went out (its owner died
    between the upgrade and the catch-up) refused nothing: the client reconnects, as a real one
    does, until ``timeout_s``; ``figures["reconnects"]`` counts how often. So does one that
    finds a turn still running (see :func:`_await_turn_end`).

    ``keepalive_s``: ping every so often and give the connection up when a pong takes longer
    (and the close frame half as long): the edge relays pings to the replica, so this is how a
    client notices a frozen owner, whose kernel keeps the connection open while nothing answers
    on it. Default: the library's 20 s pings and 10 s close."""
    token = new_token()
    started = time.time()
    turn = _Turn(leaf=since)
    pings = LIBRARY_KEEPALIVE_S if keepalive_s is None else keepalive_s
    closing = LIBRARY_CLOSE_TIMEOUT_S if keepalive_s is None else keepalive_s / 2
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    async with websockets.connect(
                        _ws_url(edge, session.session_id, since),
                        max_size=None,
                        open_timeout=timeout_s,
                        additional_headers={"x-beyond-grant": session.grant},
                        ping_interval=pings,
                        ping_timeout=pings,
                        close_timeout=closing,
                    ) as ws:
                        await _prompt_on(ws, turn, token, f"{text or 'turn'} {token}")
                    break
                except websockets.ConnectionClosed as exc:
                    code = exc.rcvd.code if exc.rcvd is not None else 1006
                    if turn.sent or code not in RECONNECT_CODES:
                        raise
                except _Again:
                    pass
                turn.reconnects += 1
                await asyncio.sleep(RECONNECT_PAUSE_S)
    except websockets.InvalidStatus as exc:
        turn.outcome = "unknown" if turn.sent else "fail"
        turn.detail = f"refused {exc.response.status_code}"
    except (OSError, TimeoutError, websockets.ConnectionClosed, websockets.InvalidHandshake) as exc:
        turn.outcome = "unknown" if turn.sent else "fail"
        turn.detail = f"{type(exc).__name__}"
    op = Op(
        session.session_id,
        "prompt",
        token,
        started,
        time.time(),
        turn.outcome,  # type: ignore[arg-type]
        "ws",
        turn.detail,
        {"committed": turn.committed, "leaf": turn.leaf, "reconnects": turn.reconnects},
    )
    journal.record(op)
    return op


async def get_state(
    edge: str, session: Session, client: httpx.AsyncClient, journal: Journal | None = None
) -> Op:
    started = time.time()
    try:
        response = await client.post(
            f"{edge}/_beyond/agent",
            params={"session_id": session.session_id},
            content=b'{"type":"get_state"}',
            headers={"x-beyond-grant": session.grant},
        )
        outcome = "ok" if response.status_code == 200 else "fail"
        detail = "" if outcome == "ok" else f"status {response.status_code}"
    except httpx.HTTPError as exc:
        outcome, detail = "fail", type(exc).__name__
    op = Op(
        session.session_id,
        "get_state",
        "",
        started,
        time.time(),
        outcome,  # type: ignore[arg-type]
        "post",
        detail,
    )
    if journal is not None:
        journal.record(op)
    return op


async def drive(
    edge: str,
    sessions: Sequence[Session],
    journal: Journal,
    *,
    until: float,
    max_ops: int,
    think_s: float = 0.05,
    seed: int = 0,
    fresh_grant: Callable[[Session], Awaitable[Session]] | None = None,
    grant_refresh_s: float = 1800.0,
    keepalive_s: float | None = None,
) -> list[Op]:
    """Each session prompts back to back (with a little think time) until ``until`` or until
    ``max_ops`` operations in all; bounded in both count and time. Each client reconnects with
    the last message id it saw committed, so a long run's catch-ups stay small, and (given
    ``fresh_grant``) renews its grant every ``grant_refresh_s``, as a client of a long session
    must before its grant expires; ``keepalive_s`` is :func:`prompt_ws`'s."""
    rng = random.Random(seed)
    budget = {"left": max_ops}
    ops: list[Op] = []

    async def client(session: Session) -> None:
        await asyncio.sleep(rng.random() * think_s)
        since: str | None = None
        renewed = time.time()
        while time.time() < until and budget["left"] > 0:
            if fresh_grant is not None and time.time() - renewed > grant_refresh_s:
                session, renewed = await fresh_grant(session), time.time()
            budget["left"] -= 1
            op = await prompt_ws(edge, session, journal, since=since, keepalive_s=keepalive_s)
            if op.outcome == "ok":
                since = op.figures["leaf"]
            ops.append(op)
            await asyncio.sleep(think_s * (0.5 + rng.random()))

    await asyncio.gather(*(client(s) for s in sessions))
    return ops


async def reachable(
    edge: str, sessions: Sequence[Session], timeout_s: float = 150.0
) -> dict[str, bool]:
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        results = await asyncio.gather(*(get_state(edge, s, client) for s in sessions))
    return {op.session_id: op.outcome == "ok" for op in results}


def summarize_ops(ops: Sequence[Op]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for op in ops:
        counts[op.outcome] = counts.get(op.outcome, 0) + 1
    return {"operations": len(ops), **counts}
