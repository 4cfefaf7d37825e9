"""The workload's prompt client against a scripted WebSocket server on loopback: how each way a
connection can end is recorded (ok, fail, unknown), and a connection lost before the prompt went
out is retried rather than counted as a refusal."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Request, Response

from fleet_sim.sim.journal import Journal, load
from fleet_sim.sim.workload import Session, prompt_ws

SESSION = Session("s1-abc", "tenant-a", "grant")
Handler = Callable[[ServerConnection, int], Awaitable[None]]


@asynccontextmanager
async def scripted(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A server that calls ``handler(ws, n)`` for its n-th connection (0-based)."""
    seen: list[int] = []

    async def serve_one(ws: ServerConnection) -> None:
        seen.append(len(seen))
        await handler(ws, seen[-1])

    async with serve(serve_one, "127.0.0.1", 0) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        yield f"http://127.0.0.1:{port}", seen


async def a_whole_turn(ws: ServerConnection) -> None:
    await ws.send(json.dumps({"type": "catchup", "messages": []}))
    prompt = json.loads(await ws.recv())
    assert prompt["type"] == "prompt"
    for leaf in ("m1", "m2"):
        await ws.send(json.dumps({"type": "committed", "leaf_id": leaf}))
    ended = {"kind": "turn_ended", "outcome": "succeeded"}
    await ws.send(json.dumps({"type": "event", "event": ended}))
    await ws.wait_closed()


def run(handler: Handler, tmp_path: Path) -> tuple[dict[str, object], list[int]]:
    async def go() -> tuple[dict[str, object], list[int]]:
        journal = Journal(tmp_path / "journal.jsonl")
        async with scripted(handler) as (url, seen):
            op = await prompt_ws(url, SESSION, journal, timeout_s=10)
        journal.close()
        (recorded,) = load(journal.path)
        assert recorded == op
        return {"outcome": op.outcome, "detail": op.detail, **op.figures}, seen

    return asyncio.run(go())


def test_a_whole_turn_is_ok(tmp_path: Path) -> None:
    async def handler(ws: ServerConnection, n: int) -> None:
        await a_whole_turn(ws)

    op, seen = run(handler, tmp_path)
    assert (op["outcome"], op["leaf"], op["reconnects"], seen) == ("ok", "m2", 0, [0])


def test_lost_before_the_prompt_went_out_reconnects(tmp_path: Path) -> None:
    # The owner dies between the upgrade and the catch-up; the edge closes the client with 1011.
    async def handler(ws: ServerConnection, n: int) -> None:
        if n < 2:
            await ws.close(1011, "the replica connection was lost")
            return
        await a_whole_turn(ws)

    op, seen = run(handler, tmp_path)
    assert (op["outcome"], op["reconnects"], seen) == ("ok", 2, [0, 1, 2])


def test_a_close_that_is_not_a_loss_is_a_failure(tmp_path: Path) -> None:
    async def handler(ws: ServerConnection, n: int) -> None:
        await ws.close(1008, "policy")

    op, seen = run(handler, tmp_path)
    assert (op["outcome"], op["detail"], op["reconnects"], seen) == (
        "fail",
        "ConnectionClosedError",
        0,
        [0],
    )


def test_lost_after_the_prompt_went_out_is_unknown(tmp_path: Path) -> None:
    async def handler(ws: ServerConnection, n: int) -> None:
        await ws.send(json.dumps({"type": "catchup", "messages": []}))
        await ws.recv()
        await ws.close(1011, "the replica connection was lost")

    op, seen = run(handler, tmp_path)
    assert (op["outcome"], op["reconnects"], seen) == ("unknown", 0, [0])


def test_refused_at_the_handshake_is_a_failure(tmp_path: Path) -> None:
    async def go() -> dict[str, object]:
        def refuse(connection: ServerConnection, request: Request) -> Response:
            return connection.respond(503, "no replica\n")

        journal = Journal(tmp_path / "journal.jsonl")
        async with serve(a_whole_turn, "127.0.0.1", 0, process_request=refuse) as server:
            port = next(iter(server.sockets)).getsockname()[1]
            op = await prompt_ws(f"http://127.0.0.1:{port}", SESSION, journal, timeout_s=10)
        journal.close()
        return {"outcome": op.outcome, "detail": op.detail, **op.figures}

    op = asyncio.run(go())
    assert (op["outcome"], op["detail"], op["reconnects"]) == ("fail", "refused 503", 0)
