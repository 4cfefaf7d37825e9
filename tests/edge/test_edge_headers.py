from __future__ import annotations

from edge.core.headers import (
    chunked_body,
    connection_tokens,
    is_chunked,
    request_head,
    response_fields,
    response_headers,
    websocket_headers,
    websocket_protocols,
)

CLIENT = [
    (b"Host", b"edge.example"),
    (b"Connection", b"keep-alive, X-Hop"),
    (b"X-Hop", b"1"),
    (b"x-beyond-grant", b"g"),
    (b"TE", b"trailers"),
    (b"Content-Length", b"2"),
    (b"Expect", b"100-continue"),
    (b"Cookie", b"a=b"),
]


def test_request_head_drops_hop_by_hop_and_reframes() -> None:
    head = request_head("POST", "/_beyond/agent?session_id=x", CLIENT, host=b"r:1", body_length=2)
    assert head == (
        b"POST /_beyond/agent?session_id=x HTTP/1.1\r\n"
        b"Host: edge.example\r\nx-beyond-grant: g\r\nCookie: a=b\r\nContent-Length: 2\r\n\r\n"
    )


def test_request_head_for_a_callback_keeps_its_framing() -> None:
    headers = [(b"Authorization", b"Bearer bjn_v1.t"), (b"Transfer-Encoding", b"chunked")]
    head = request_head("POST", "/a", headers, host=b"r:1", body_length=5, keep_framing=True)
    assert head == (
        b"POST /a HTTP/1.1\r\nAuthorization: Bearer bjn_v1.t\r\nTransfer-Encoding: chunked\r\n"
        b"Host: r:1\r\n\r\n"
    )


def test_request_head_without_body() -> None:
    assert (
        request_head("GET", "/e", [], host=b"r:1", body_length=0)
        == b"GET /e HTTP/1.1\r\nHost: r:1\r\n\r\n"
    )
    assert request_head("POST", "/e", [], host=b"r:1", body_length=0).endswith(
        b"Content-Length: 0\r\n\r\n"
    )


def test_non_utf8_bytes_pass_untouched() -> None:
    head = request_head("POST", "/a", [(b"X-Odd", b"\xff\xfe")], host=b"r:1", body_length=0)
    assert b"X-Odd: \xff\xfe\r\n" in head


def test_response_headers() -> None:
    upstream = [
        (b"Content-Type", b"text/event-stream"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Connection", b"close, X-Gone"),
        (b"X-Gone", b"1"),
        (b"Content-Length", b"9"),
        (b"X-Session-Id", b"a07-s1.x"),
    ]
    assert response_headers(upstream, keep_length=True) == [
        ("Content-Type", "text/event-stream"),
        ("Content-Length", "9"),
        ("X-Session-Id", "a07-s1.x"),
    ]
    assert ("Content-Length", "9") not in response_headers(upstream, keep_length=False)


def test_response_fields_agree_with_response_headers() -> None:
    plain = [
        (b"date", b"Sun, 29 Nov 2026 17:00:00 GMT"),
        (b"content-length", b"9"),
        (b"Keep-Alive", b"timeout=5"),
        (b"content-type", b"application/json"),
    ]
    listed = [*plain, (b"Connection", b"close, X-Gone"), (b"X-Gone", b"1"), (b"X-Kept", b"2")]
    for upstream in (plain, listed):
        expected = b"".join(
            n.encode() + b": " + v.encode() + b"\r\n"
            for n, v in response_headers(upstream, keep_length=False)
        )
        assert response_fields(upstream) == expected
    assert response_fields(plain) == (
        b"date: Sun, 29 Nov 2026 17:00:00 GMT\r\ncontent-type: application/json\r\n"
    )
    assert b"X-Gone" not in response_fields(listed) and b"X-Kept: 2" in response_fields(listed)


def test_websocket_fields() -> None:
    handshake = [
        (b"Upgrade", b"websocket"),
        (b"Connection", b"Upgrade"),
        (b"Sec-WebSocket-Key", b"k"),
        (b"Sec-WebSocket-Version", b"13"),
        (b"Sec-WebSocket-Protocol", b"beyond.v1, other"),
        (b"Sec-WebSocket-Protocol", b"third"),
        (b"x-beyond-grant", b"g"),
        (b"Origin", b"https://app"),
    ]
    assert websocket_headers(handshake) == [(b"x-beyond-grant", b"g"), (b"Origin", b"https://app")]
    assert websocket_protocols(handshake) == ("beyond.v1", "other", "third")


def test_small_helpers() -> None:
    assert connection_tokens([(b"Connection", b"Keep-Alive, , X-A")]) == {b"keep-alive", b"x-a"}
    assert is_chunked([(b"transfer-encoding", b"Chunked")])
    assert not is_chunked([(b"Content-Length", b"1")])
    assert chunked_body(b"abc") == b"3\r\nabc\r\n0\r\n\r\n"
    assert chunked_body(b"") == b"0\r\n\r\n"
