"""A response's head and its first body piece in one write.

uvicorn writes a response's status line and headers as soon as the application sends
``http.response.start``, then the body with ``http.response.body``: two sends, two TCP segments
for every small answer, and a reader (the edge) that often wakes twice for one response.
:class:`CorkedHttp` is uvicorn's httptools protocol with each request's response cycle writing
through :class:`HeldHead`, which keeps the head back until the first body piece (then sends
both in one write) or until the end of the current event-loop iteration, whichever comes first.
An application that sends start and body back to back (every Starlette ``Response``) costs one
send; one that sends the head and then waits (an event stream) has its head out within the same
iteration, so nothing is delayed.

The same cycle offers a chunk written now, for event streams: ``beyond.http.send_now`` in the
request's scope extensions is a function that writes one piece of a started, chunked,
unfinished response straight to the transport (through the held head, so order holds) and says
True, or says False when the response is not in that state, the client is gone, or flow control
has paused writing: then the caller sends it the ordinary way, through the ASGI ``send``. An
event stream's frames otherwise each go through an async generator step, a cancel scope, the
middleware's wrappers and the ASGI message, as many as a thousand a second per replica core.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

HTTP_SEND_NOW = "beyond.http.send_now"


class HeldHead:
    """A response cycle's view of its connection's transport (see the module doc)."""

    __slots__ = ("_first", "_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._first = True
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
        elif self._first:
            self._first = False
            self._held = bytes(data)
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if not self._transport.is_closing():
                self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CorkedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol, each response cycle writing through :class:`HeldHead`."""

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        # On an upgrade there is no new cycle (the WebSocket protocol takes the transport).
        if cycle is not None and cycle.transport is self.transport:
            cycle.transport = HeldHead(self.transport, self.loop)  # type: ignore[assignment]
            extensions = cycle.scope.setdefault("extensions", {})
            extensions[HTTP_SEND_NOW] = {"send": _chunk_now(cycle)}


def _chunk_now(cycle: RequestResponseCycle) -> Callable[[bytes], bool]:
    def send_now(body: bytes) -> bool:
        """Write ``body`` as one chunk of the response now, if nothing stands in the way."""
        if (
            not cycle.response_started
            or cycle.response_complete
            or cycle.disconnected
            or not cycle.chunked_encoding
            or cycle.flow.write_paused
            or cycle.transport.is_closing()
            or not body
        ):
            return False
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True

    return send_now
