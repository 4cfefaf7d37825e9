"""What each command does to a live session. Shared by the WebSocket and POST transports: both
hand a parsed command here and deliver the frames it returns to the one client that asked.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from replica import protocol
from replica.agent import TurnDeps, run_turn
from replica.errors import ReplicaError, StoreError
from replica.listing import list_sessions
from replica.live import LiveSession
from replica.metrics import ReplicaMetrics
from replica.protocol import Command
from replica.registry import Registry
from replica.store import Committed
from replica.transcript import UnknownMessage, new_id
from wire.names import SessionId

log = logging.getLogger("replica.commands")


@dataclass(frozen=True, slots=True)
class CommandDeps:
    registry: Registry
    turn: TurnDeps
    metrics: ReplicaMetrics
    emit: Callable[[dict[str, Any]], None]


async def handle(live: LiveSession, command: Command, deps: CommandDeps) -> list[dict[str, Any]]:
    kind = command.type
    if kind == "prompt":
        return _prompt(live, command, deps)
    if kind == "abort":
        running = live.running
        if running and live.turn_task is not None:
            live.turn_task.cancel()
        return [protocol.response(command, {"aborted": running})]
    if kind == "get_messages":
        try:
            messages = live.owned.transcript.since(command.since)
        except UnknownMessage:
            return [protocol.failure(command, "unknown message id for 'since'")]
        data = {
            "messages": [m.to_wire() for m in messages],
            "leaf_id": live.owned.transcript.leaf_id,
        }
        return [protocol.response(command, data)]
    if kind == "get_state":
        return [protocol.response(command, state(live))]
    if kind == "list_sessions":
        roots = [store.root for store in deps.registry.stores.values()]
        found = await deps.registry.run_io(
            list_sessions, roots, live.tenant, live.context.dek, command.query, command.limit
        )
        return [protocol.response(command, {"sessions": found})]
    if kind == "new_session":
        return [await _new_session(live, command, deps)]
    return [protocol.failure(command, f"{kind} is not accepted on this route")]


def state(live: LiveSession) -> dict[str, Any]:
    transcript = live.owned.transcript
    title = next((str(m.extra["title"]) for m in transcript.messages if "title" in m.extra), "")
    return {
        "session_id": live.session_id,
        "leaf_id": transcript.leaf_id,
        "messages": len(transcript),
        "running": live.running,
        "run_id": live.turn.run_id if live.turn else None,
        "title": title,
        "epoch": live.owned.epoch,
        "attached": live.attached,
    }


async def _end_jobs(live: LiveSession, deps: CommandDeps) -> list[str]:
    """A new conversation ends the old one's background jobs; returns every job id whose end
    the new conversation must not be told of."""
    known = set(live.owned.transcript.started_jobs)
    try:
        sandbox = deps.turn.sandbox(live)
        for job in await sandbox.jobs():
            known.add(job.job_id)
            if job.running:
                await sandbox.kill(job.job_id)
    except ReplicaError as exc:
        log.warning("could not end the old conversation's jobs: %s", exc)
    return sorted(known)


def _prompt(live: LiveSession, command: Command, deps: CommandDeps) -> list[dict[str, Any]]:
    if live.running:
        return [protocol.failure(command, "a turn is already running; abort it or wait")]
    run_id = new_id("r")
    task = asyncio.create_task(run_turn(live, command.message, run_id, deps.turn), name="turn")
    live.turn_task = task
    deps.metrics.runs_in_flight.inc()

    def done(t: asyncio.Task[None]) -> None:
        deps.metrics.runs_in_flight.dec()
        if t.cancelled():
            outcome = "aborted" if live.last_outcome is None else live.last_outcome
        elif t.exception() is not None:
            outcome = "failed"
        else:
            outcome = live.last_outcome or "succeeded"
        live.last_outcome = None
        deps.metrics.turns.labels(outcome).inc()
        live.touch()

    task.add_done_callback(done)
    return [protocol.ack(command)]


async def _new_session(live: LiveSession, command: Command, deps: CommandDeps) -> dict[str, Any]:
    """Archive the conversation into a sibling session, then start afresh under the same id."""
    if live.running:
        return protocol.failure(command, "a turn is running; abort it or wait")
    messages = list(live.owned.transcript.messages)
    if not messages:
        return protocol.response(command, {"archived": False})
    store = deps.registry.store_for(live.session.shard)
    sibling = SessionId(live.session.shard, secrets.token_urlsafe(12))
    try:
        owned = await deps.registry.run_io(store.open, live.tenant, sibling, live.context.dek)
        try:
            outcome = await deps.registry.run_io(owned.commit, messages)
        finally:
            await deps.registry.run_io(owned.release)
    except StoreError as exc:
        return protocol.failure(command, f"could not archive the conversation: {exc}")
    if not isinstance(outcome, Committed):
        return protocol.failure(command, "could not archive the conversation: superseded")
    if await live.reset(str(sibling), await _end_jobs(live, deps)) is None:
        return protocol.failure(command, "this replica no longer owns the session")
    title = next((str(m.extra["title"]) for m in messages if "title" in m.extra), "")
    deps.emit(
        {
            "type": "session_archived",
            "session_id": str(sibling),
            "parent_session_id": live.session_id,
            "tenant": live.tenant,
            "title": title,
        }
    )
    return protocol.response(command, {"archived": True, "messages": len(messages)})
