from __future__ import annotations

import pytest
from websockets.frames import Frame, Opcode

from replica.websocket_protocol import text_frame


@pytest.mark.parametrize("size", [0, 1, 125, 126, 127, 65_535, 65_536, 70_000])
def test_a_text_frame_is_the_bytes_the_websockets_library_would_send(size: int) -> None:
    # Every length encoding of RFC 6455 5.2: 7 bits, 16 bits and 64 bits, at their edges.
    payload = ("é" * size).encode()[:size]
    expected = Frame(Opcode.TEXT, payload).serialize(mask=False, extensions=[])
    assert text_frame(payload) == expected
