"""The replica's WebSocket server protocol: uvicorn's sans-I/O one, mended, plus a direct send.

Mended twice: uvicorn logs "ASGI callable returned without completing handshake" (and tries a
500) after every denial, although the denial went out complete, so a denial marks the handshake
finished; and a handshake caught by shutdown gets 503 + Retry-After (the edge walks on) instead
of 500.

The direct send: a streamed frame goes through the ASGI ``send`` (Starlette's wrappers, an
awaited message dict, the websockets state machine's frame objects) only when it must wait. A
reader's frames are otherwise written to the transport at once, as the frame is published, by
``send_now``, offered to the application as the ``beyond.websocket.send_now`` scope extension.
It writes only while the connection is open, writable (not paused by flow control) and has no
extension negotiated that would change the frame's bytes (``permessage-deflate`` is off), and it
says False otherwise, so the caller queues the frame and its writer sends it the ordinary way.
"""

from __future__ import annotations

from typing import Any, Final

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.protocol import State

from wire.http import RETRY_AFTER_HEADER, RETRY_AFTER_S, RETRY_LATER

WS_SEND_NOW: Final = "beyond.websocket.send_now"
_TEXT_FIN: Final = 0x81  # FIN and the text opcode; a server's frames are not masked


def text_frame(payload: bytes) -> bytes:
    """One unfragmented, unmasked text frame (RFC 6455 5.2) holding ``payload``."""
    size = len(payload)
    if size < 126:
        return bytes((_TEXT_FIN, size)) + payload
    if size < 1 << 16:
        return bytes((_TEXT_FIN, 126)) + size.to_bytes(2, "big") + payload
    return bytes((_TEXT_FIN, 127)) + size.to_bytes(8, "big") + payload


class ReplicaWebSockets(WebSocketsSansIOProtocol):
    async def send(self, message: Any) -> None:
        await super().send(message)
        if message["type"] == "websocket.http.response.body" and not message.get("more_body"):
            self.handshake_complete = True

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)  # absent when the upgrade was refused outright
        if scope is not None:
            scope["extensions"][WS_SEND_NOW] = {"send": self.send_now}

    def send_now(self, text: str) -> bool:
        """Write ``text`` as one frame now if nothing stands in the way; False: send it later
        through the ASGI ``send``, which waits for what does."""
        if (
            self.close_sent
            or self.disconnected
            or self.initial_response is not None
            or not self.handshake_complete
            or not self.writable.is_set()
            or self.conn.state is not State.OPEN
            or self.conn.extensions
            or self.transport.is_closing()
        ):
            return False
        self.transport.write(text_frame(text.encode()))
        return True

    _shutting_down = False

    def shutdown(self) -> None:
        self._shutting_down = True
        super().shutdown()

    def send_500_response(self) -> None:
        # uvicorn answers 500 to a handshake still in progress when the server shuts down (the
        # last stage of a drain): that is "retry elsewhere", not a server error. The edge
        # retries a 503 and walks on; a 500 would reach the client. Other 500s stay 500s.
        if not self._shutting_down:
            super().send_500_response()
            return
        if self.initial_response or self.handshake_complete or self.transport.is_closing():
            return
        response = self.conn.reject(RETRY_LATER, "this replica is shutting down; retry\n")
        response.headers[RETRY_AFTER_HEADER] = str(RETRY_AFTER_S)
        self.conn.send_response(response)
        self.transport.write(b"".join(self.conn.data_to_send()))
