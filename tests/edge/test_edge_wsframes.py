"""The pure parts of the WebSocket relay: the frame tracker, close frames and the handshakes
(edge.core.wsframes, edge.core.wshandshake)."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.core.wsframes import (
    NO_STATUS,
    FrameTracker,
    Stop,
    close_frame,
    unmask,
)
from edge.core.wshandshake import (
    Upgrade,
    accept_value,
    check_upgrade,
    client_handshake,
    upgrade_request,
)
from tests.edge.wsraw import (
    BINARY,
    CLOSE,
    CONTINUATION,
    PING,
    PONG,
    TEXT,
    close_payload,
    frame,
)

SIZES = st.sampled_from([0, 1, 2, 125, 126, 127, 1000, 65535, 65536, 70_000])
FRAMES = st.lists(
    st.tuples(st.sampled_from([TEXT, BINARY, PING, PONG]), SIZES, st.booleans()),
    min_size=1,
    max_size=6,
)


def build(specs: list[tuple[int, int, bool]]) -> tuple[bytes, list[tuple[int, int]], set[int]]:
    """The wire for ``specs`` (opcode, size, masked), each frame's header span, and the offsets
    that are frame boundaries."""
    wire = b""
    heads: list[tuple[int, int]] = []
    boundaries = {0}
    for opcode, size, masked in specs:
        if opcode in (PING, PONG):
            size = min(size, 125)
        one = frame(opcode, bytes(size), masked=masked)
        heads.append((len(wire), len(wire) + len(one) - size))
        wire += one
        boundaries.add(len(wire))
    return wire, heads, boundaries


@settings(max_examples=150, deadline=None)
@given(FRAMES, st.lists(st.integers(min_value=1, max_value=80_000), max_size=12))
def test_every_byte_goes_on_in_order_and_never_half_a_header(
    specs: list[tuple[int, int, bool]], cuts: list[int]
) -> None:
    wire, heads, boundaries = build(specs)
    tracker = FrameTracker()
    out = b""
    at = 0
    for step in [*cuts, len(wire)]:
        piece = wire[at : at + step]
        at += len(piece)
        out += tracker.feed(piece)
        assert wire.startswith(out)
        assert not any(start < len(out) < end for start, end in heads)
        assert tracker.between_frames == (len(out) in boundaries)
        assert len(out) + tracker.holding == at
    assert out == wire and tracker.between_frames and tracker.stopped is None


@pytest.mark.parametrize("size", [0, 125, 126, 65535, 65536, 1 << 20])
def test_a_frame_of_each_size_class_is_passed_whole(size: int) -> None:
    for masked in (False, True):
        one = frame(BINARY, b"p" * size, masked=masked)
        tracker = FrameTracker()
        assert tracker.feed(one) == one  # the same object: nothing copied
        assert tracker.between_frames
        # Byte by byte: the header waits until whole, the payload goes on as it comes.
        tracker = FrameTracker()
        head = len(one) - size
        out = [tracker.feed(one[i : i + 1]) for i in range(min(len(one), head + 3))]
        assert out[: head - 1] == [b""] * (head - 1)
        assert out[head - 1] == one[:head]
        assert b"".join(out) == one[: len(out)]


def test_a_big_payload_passes_without_being_read() -> None:
    tracker = FrameTracker()
    head = frame(BINARY, bytes(10_000_000))[:10]
    assert tracker.feed(head) == head
    chunk = bytes(65536)
    assert tracker.feed(chunk) is chunk
    assert tracker.left == 10_000_000 - 65536


def test_a_close_frame_is_held_back_and_read() -> None:
    before = frame(TEXT, b"last", masked=True)
    close = frame(CLOSE, close_payload(4000, "done ✓".encode()), masked=True)
    after = frame(TEXT, b"never", masked=True)
    tracker = FrameTracker()
    wire = before + close + after
    # Cut inside the close frame's payload.
    assert tracker.feed(wire[: len(before) + 5]) == before
    assert tracker.stopped is None and tracker.between_frames
    assert tracker.feed(wire[len(before) + 5 :]) == b""
    assert tracker.stopped is Stop.CLOSE
    assert (tracker.close_code, tracker.close_reason) == (4000, "done ✓".encode())
    assert tracker.feed(frame(TEXT, b"more")) == b""  # stopped: nothing more goes on


def test_close_frames_without_a_code_or_with_a_bad_reason() -> None:
    tracker = FrameTracker()
    assert tracker.feed(frame(CLOSE)) == b""
    assert (tracker.stopped, tracker.close_code, tracker.close_reason) == (
        Stop.CLOSE,
        NO_STATUS,
        b"",
    )
    tracker = FrameTracker()
    tracker.feed(frame(CLOSE, close_payload(1000, b"\xff\xfe"), masked=True))
    assert (tracker.stopped, tracker.close_code, tracker.close_reason) == (Stop.CLOSE, 1000, b"")


@pytest.mark.parametrize(
    "bad",
    [
        frame(CLOSE, b"\x03"),  # a one-byte close payload
        frame(PING, bytes(126)),  # a control frame over 125 bytes
        frame(PONG, b"x", fin=False),  # a fragmented control frame
        bytes((0x82, 127)) + (1 << 63).to_bytes(8, "big"),  # a length with its top bit set
    ],
)
def test_headers_no_endpoint_may_send_stop_the_tracker_before_them(bad: bytes) -> None:
    ok = frame(BINARY, b"fine")
    tracker = FrameTracker()
    assert tracker.feed(ok + bad + ok) == ok
    assert tracker.stopped is Stop.INVALID and tracker.between_frames


def test_a_message_over_the_limit_stops_before_the_frame_that_passes_it() -> None:
    tracker = FrameTracker(limit=100)
    first = frame(TEXT, bytes(60), fin=False, masked=True)
    ping = frame(PING, bytes(100), masked=True)  # control frames do not count
    second = frame(CONTINUATION, bytes(40), masked=True)  # exactly 100: allowed
    assert tracker.feed(first + ping + second) == first + ping + second
    fresh = frame(BINARY, bytes(100), masked=True)  # a new message counts from zero
    assert tracker.feed(fresh) == fresh
    over = frame(CONTINUATION, bytes(1), masked=True)
    assert tracker.feed(over) == b""
    assert tracker.stopped is Stop.TOO_BIG


def test_rest_of_frame_takes_only_what_completes_the_payload() -> None:
    tracker = FrameTracker()
    one = frame(BINARY, bytes(1000))
    tracker.feed(one[:500])
    assert not tracker.between_frames
    rest = one[500:] + frame(TEXT, b"next")
    assert tracker.rest_of_frame(rest) == one[500:]
    assert tracker.between_frames
    tracker.feed(one[:500])
    assert tracker.rest_of_frame(one[500:600]) == one[500:600] and tracker.left == len(one) - 600


def test_close_frames_the_edge_writes() -> None:
    assert close_frame(1001) == b"\x88\x02\x03\xe9"
    masked = close_frame(1011, b"the replica connection was lost", b"\x01\x02\x03\x04")
    assert masked[:2] == bytes((0x88, 0x80 | 33)) and masked[2:6] == b"\x01\x02\x03\x04"
    assert unmask(masked[6:], b"\x01\x02\x03\x04") == b"\x03\xf3the replica connection was lost"
    tracker = FrameTracker()
    tracker.feed(masked)
    assert (tracker.close_code, tracker.close_reason) == (1011, b"the replica connection was lost")
    # A reason too long for a control frame is cut at a character boundary.
    long = close_frame(1000, "é".encode() * 100)
    assert len(long) == 2 + 2 + 122 and long[4:].decode() == "é" * 61


# --- handshakes ------------------------------------------------------------------------------

KEY = b"dGhlIHNhbXBsZSBub25jZQ=="  # RFC 6455 1.3's example
GOOD = [
    (b"Host", b"edge"),
    (b"Upgrade", b"websocket"),
    (b"Connection", b"keep-alive, Upgrade"),
    (b"Sec-WebSocket-Version", b"13"),
    (b"Sec-WebSocket-Key", KEY),
]


def test_the_accept_value_is_rfc_6455s() -> None:
    assert accept_value(KEY) == b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
    assert client_handshake(GOOD) == b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo="


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (
            (b"Upgrade", b"h2c"),
            'No WebSocket UPGRADE hdr: h2c\n Can "Upgrade" only to "WebSocket".',
        ),
        ((b"Connection", b"keep-alive"), "No CONNECTION upgrade hdr: keep-alive"),
        ((b"Sec-WebSocket-Version", b"12"), "Unsupported version: 12"),
        ((b"Sec-WebSocket-Key", b"c2hvcnQ="), "Handshake error: 'c2hvcnQ='"),
        ((b"Sec-WebSocket-Key", b"not base64!"), "Handshake error: 'not base64!'"),
    ],
)
def test_a_malformed_client_handshake_is_refused_in_aiohttps_words(
    change: tuple[bytes, bytes], refusal: str
) -> None:
    headers = [change if name == change[0] else (name, value) for name, value in GOOD]
    assert client_handshake(headers) == refusal


def test_the_upgrade_request_for_a_replica() -> None:
    fields = [(b"x-beyond-grant", b"g.r.ant"), (b"Origin", b"https://app")]
    request = upgrade_request(
        "/_beyond/agent?session_id=s\xe9",
        fields,
        host=b"10.0.0.1:8080",
        key=KEY,
        protocols=("a", "b"),
    )
    assert request == (
        b"GET /_beyond/agent?session_id=s\xe9 HTTP/1.1\r\n"
        b"x-beyond-grant: g.r.ant\r\nOrigin: https://app\r\nHost: 10.0.0.1:8080\r\n"
        b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Key: " + KEY + b"\r\nSec-WebSocket-Protocol: a,b\r\n\r\n"
    )
    with_host = upgrade_request("/", [(b"Host", b"edge")], host=b"x", key=KEY, protocols=())
    assert with_host.count(b"Host") == 1 and b"Host: edge\r\n" in with_host
    assert b"Sec-WebSocket-Protocol" not in with_host


def test_the_replicas_101_is_checked() -> None:
    accept = accept_value(KEY)
    ok = [
        (b"Upgrade", b"WebSocket"),
        (b"Connection", b"Upgrade"),
        (b"Sec-WebSocket-Accept", accept),
    ]
    assert check_upgrade(ok, KEY, ()) == Upgrade(None)
    chosen = [*ok, (b"Sec-WebSocket-Protocol", b"b")]
    assert check_upgrade(chosen, KEY, ("a", "b")) == Upgrade("b")
    assert check_upgrade(chosen, KEY, ("a",)) == Upgrade(None)  # not offered: ignored
    assert check_upgrade(ok[1:], KEY, ()) == "Invalid upgrade header"
    assert check_upgrade([ok[0], ok[2]], KEY, ()) == "Invalid connection header"
    other = base64.b64encode(b"x" * 20)
    assert check_upgrade([*ok[:2], (b"Sec-WebSocket-Accept", other)], KEY, ()) == (
        "Invalid challenge response"
    )
    deflate = [*ok, (b"Sec-WebSocket-Extensions", b"permessage-deflate")]
    assert check_upgrade(deflate, KEY, ()) == "an extension the edge did not offer"
