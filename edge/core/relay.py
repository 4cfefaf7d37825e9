"""The one loop that passes a replica's streamed answer body on to a client, whichever lane
carries it, over a small :class:`BodySink` interface.

Each piece is written the moment it arrives, with no buffering and no response timeout, only an
idle guard: ``idle_s`` without a byte ends the relay. A replica that falls silent or breaks off
ends it with the client connection *aborted*, never ended cleanly, so a client cannot mistake a
truncated body for a whole one. (A WebSocket's frames are relayed by ``edge.aio.websocket``: frames,
not bytes, and both directions at once.)
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from edge.core.errors import UpstreamError
from edge.core.metrics import Outcome
from edge.upstream.pool import UpstreamResponse

log = logging.getLogger("edge.core.relay")


class BodySink(Protocol):
    """Where a lane writes an answer body (its head has gone out already)."""

    async def write(self, chunk: bytes) -> None:
        """Pass one piece on, waiting while the client is slower than the replica."""

    async def end(self) -> None:
        """The body is whole: end it as its framing says."""

    def abort(self) -> None:
        """The body broke off: close the client connection without ending the body."""


async def relay_body(
    response: UpstreamResponse, sink: BodySink, idle_s: float, what: str
) -> Outcome:
    """Relay the rest of ``response``'s body to ``sink``; how it ended. ``what`` names the
    answer in the log when it goes silent (``"an event stream"``, ``"a command's answer"``)."""
    try:
        while True:
            async with asyncio.timeout(idle_s):
                chunk = await response.read()
            if not chunk:
                break
            await sink.write(chunk)
    except TimeoutError:
        log.warning("%s from a replica was silent for %g s; closing it", what, idle_s)
        sink.abort()
        return Outcome.TIMED_OUT
    except UpstreamError as exc:
        log.warning("%s", exc)
        sink.abort()
        return Outcome.UPSTREAM_ERROR
    await sink.end()
    return Outcome.DELIVERED
