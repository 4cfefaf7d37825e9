"""Client-side helpers for functional tests; the processes themselves come from
``fleet_sim.local``."""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from fleet_sim.local import Fleet, Replica, fleet_at

__all__ = [
    "Fleet",
    "Replica",
    "agent_url",
    "eventually",
    "eventually_async",
    "fleet_at",
    "post",
    "sse_events",
]


def agent_url(session_id: str, **extra: str) -> str:
    query = "&".join(f"{k}={v}" for k, v in {"session_id": session_id, **extra}.items())
    return f"/_beyond/agent?{query}"


def post(
    client: httpx.Client, session_id: str, grant: str | None, body: Any, **headers: str
) -> httpx.Response:
    hdrs = dict(headers)
    if grant is not None:
        hdrs["x-beyond-grant"] = grant
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(agent_url(session_id), content=data, headers=hdrs)


def eventually(
    predicate: Callable[[], Any],
    timeout: float = 10.0,
    interval: float = 0.02,
    message: str = "condition not met in time",
) -> Any:
    """Poll ``predicate`` every ``interval`` seconds until it returns something truthy, and
    return that; ``TimeoutError(message)`` once ``timeout`` seconds have passed without."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(message)


async def eventually_async(
    predicate: Callable[[], Any],
    timeout: float = 10.0,  # noqa: ASYNC109 - the same bound as eventually's, with its message
    interval: float = 0.02,
    message: str = "condition not met in time",
) -> Any:
    """:func:`eventually` in an async test: the loop runs between polls, and ``predicate`` may
    be a coroutine function (its result is awaited) or a plain one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(interval)
    raise TimeoutError(message)


def sse_events(lines: Sequence[str]) -> list[dict[str, str]]:
    """Parse SSE text lines into events (fields joined), ignoring comments."""
    events: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for line in lines:
        if line == "":
            if current:
                events.append(current)
                current = {}
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        # Repeated data lines join with a newline, as the SSE standard reads them.
        current[name] = f"{current[name]}\n{value}" if name == "data" and name in current else value
    return events
