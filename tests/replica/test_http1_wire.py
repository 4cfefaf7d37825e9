"""HTTP/1.1 without I/O (``replica.http1_wire``): the request's bytes, and responses read from
any split of their bytes: framing, informational answers, reuse, and what is refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replica.http1_wire import MAX_HEAD, Head, ResponseReader, WireError, encode_request

CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b"5\r\nhello\r\n"
    b"7;name=value\r\n, world\r\n"
    b"1\r\n!\r\n"
    b"0\r\nx-trailer: yes\r\n\r\n"
)
LENGTH = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 13\r\n\r\nhello, world!"


def read(data: bytes, cuts: list[int] | None = None) -> tuple[ResponseReader, bytes]:
    """Feed ``data`` cut at ``cuts``; the reader and the body it gave."""
    reader = ResponseReader()
    body = b""
    start = 0
    for cut in [*sorted(set(cuts or [])), len(data)]:
        body += reader.feed(data[start:cut])
        start = cut
    return reader, body


def test_request_is_one_buffer_with_its_length() -> None:
    data = encode_request(
        "POST", b"/v1/chat/completions?x=1", [("host", "h:1"), ("accept", "a/b")], b"{}"
    )
    assert data == (
        b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nhost: h:1\r\naccept: a/b\r\n"
        b"content-length: 2\r\n\r\n{}"
    )


@pytest.mark.parametrize(
    ("target", "headers"),
    [
        (b"/v1 x", []),
        (b"v1", []),
        (b"/v1", [("x-a", "v\r\nx-injected: 1")]),
        (b"/v1", [("x a", "v")]),
        (b"/v1", [("x-a", "v\n")]),
    ],
)
def test_request_refuses_what_would_split_its_head(
    target: bytes, headers: list[tuple[str, str]]
) -> None:
    with pytest.raises(ValueError) as info:
        encode_request("POST", target, headers, b"")
    assert "injected" not in str(info.value)


@given(st.lists(st.integers(0, len(CHUNKED)), max_size=12))
def test_chunked_body_is_the_same_however_it_is_split(cuts: list[int]) -> None:
    reader, body = read(CHUNKED, cuts)
    assert body == b"hello, world!"
    assert reader.complete and reader.reusable
    assert reader.head == Head(
        200, ((b"content-type", b"text/event-stream"), (b"transfer-encoding", b"chunked"))
    )


@given(st.lists(st.integers(0, len(LENGTH)), max_size=12))
def test_content_length_body_is_the_same_however_it_is_split(cuts: list[int]) -> None:
    reader, body = read(LENGTH, cuts)
    assert body == b"hello, world!"
    assert reader.complete and reader.reusable
    assert reader.head is not None and reader.head.get("CONTENT-TYPE") == "text/plain"


def test_head_arrives_before_the_body_and_the_body_as_it_comes() -> None:
    reader = ResponseReader()
    assert reader.feed(LENGTH[:20]) == b"" and reader.head is None
    cut = LENGTH.index(b"\r\n\r\n") + 4
    assert reader.feed(LENGTH[20 : cut + 5]) == b"hello"
    assert reader.head is not None and reader.head.status == 200
    assert not reader.complete
    assert reader.feed(LENGTH[cut + 5 :]) == b", world!"
    assert reader.complete


def test_first_value_of_a_repeated_header_and_absent_ones() -> None:
    reader, _ = read(b"HTTP/1.1 204 No Content\r\nX-A: 1\r\nx-a: 2\r\n\r\n")
    assert reader.head is not None
    assert reader.head.get("x-a") == "1"
    assert reader.head.get("retry-after") is None
    assert reader.complete and reader.reusable  # 204 has no body


def test_informational_answers_are_skipped() -> None:
    data = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"
        b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 7\r\ncontent-length: 2\r\n\r\nno"
    )
    reader, body = read(data, [30, 60])
    assert reader.head is not None
    assert (reader.head.status, reader.head.get("retry-after")) == (429, "7")
    assert reader.head.get("link") is None
    assert body == b"no" and reader.reusable


@pytest.mark.parametrize(
    "data",
    [
        b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok",
        b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
        b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nxyz",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok\x00garbage",
    ],
    ids=["connection-close", "http-1.0", "a-second-answer", "garbage-after"],
)
def test_complete_answers_that_leave_the_connection_unusable(data: bytes) -> None:
    reader, body = read(data)
    assert body == b"ok"
    assert reader.complete
    assert not reader.reusable


def test_bytes_after_a_complete_answer_make_it_unusable() -> None:
    reader, _ = read(LENGTH)
    assert reader.reusable
    assert reader.feed(b"x") == b""
    assert not reader.reusable


def test_a_body_delimited_by_the_close_ends_with_it() -> None:
    reader, body = read(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: 1\n\n")
    assert body == b"data: 1\n\n"
    assert not reader.complete
    reader.feed_eof()
    assert reader.complete and not reader.reusable


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"HTTP/1.1 200 OK\r\ncontent-le",
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nabc",
        CHUNKED[:-10],
    ],
    ids=["nothing", "mid-head", "short-length", "mid-chunked"],
)
def test_a_close_before_the_end_is_an_error(data: bytes) -> None:
    reader, _ = read(data)
    with pytest.raises(WireError):
        reader.feed_eof()
    assert not reader.complete


@pytest.mark.parametrize(
    "data",
    [
        b"SSH-2.0-OpenSSH_9.6\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nabc",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nabX\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n",
    ],
    ids=["not-http", "bad-status", "two-lengths", "bad-chunk-size", "chunk-overrun", "upgrade"],
)
def test_what_is_not_a_response_is_refused(data: bytes) -> None:
    with pytest.raises(WireError):
        read(data)


def test_a_head_without_end_is_refused_once_past_the_bound() -> None:
    reader = ResponseReader()
    reader.feed(b"HTTP/1.1 200 OK\r\nx-big: ")
    with pytest.raises(WireError) as info:
        for _ in range(MAX_HEAD // 4096 + 2):
            reader.feed(b"a" * 4096)
    assert "too large" in str(info.value)
