from __future__ import annotations

import logging

import pytest

from edge.accesslog import AccessRecord, RedactCredentials, install_redaction, redact, write
from edge.classify import Kind
from edge.metrics import Outcome


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("Authorization: Bearer bjn_v1.abc", "bjn_v1.abc"),
        ("b'Authorization: Bearer bjn_v1.abc\\x01'", "bjn_v1.abc"),
        ("x-beyond-grant: eyJhbGciOiJFZERTQSJ9.e30.sig", "eyJhbGciOiJFZERTQSJ9"),
        ("cookie=session=abc123", "abc123"),
        ("token bjn_v1.zzz seen", "bjn_v1.zzz"),
        ("bearer  user-secret", "user-secret"),
    ],
)
def test_redact_removes_credentials(text: str, secret: str) -> None:
    assert secret not in redact(text)
    assert "[redacted]" in redact(text)


def test_redact_leaves_ordinary_text() -> None:
    text = "POST /_beyond/agent 200 kind=command outcome=delivered"
    assert redact(text) == text


def test_the_filter_rewrites_messages_and_tracebacks() -> None:
    try:
        raise ValueError("b'Authorization: Bearer bjn_v1.secret'")
    except ValueError:
        import sys

        record = logging.LogRecord(
            "aiohttp.server", logging.ERROR, "f", 1, "from %s", ("bjn_v1.x",), sys.exc_info()
        )
    assert RedactCredentials().filter(record)
    assert "bjn_v1.x" not in record.getMessage()
    assert record.exc_text is not None and "bjn_v1.secret" not in record.exc_text


def test_access_lines_hold_no_query(caplog: pytest.LogCaptureFixture) -> None:
    install_redaction()
    record = AccessRecord("POST", "/_beyond/agent")
    record.kind = Kind.CALLBACK
    record.answered(202)
    record.tally.replica = "r2"
    record.tally.attempts = 3
    with caplog.at_level(logging.INFO, "edge.access"):
        write(record, 0.0123)
    assert caplog.messages == [
        "POST /_beyond/agent 202 kind=callback outcome=delivered replica=r2 attempts=3 ms=12.3"
    ]
    assert record.outcome is Outcome.DELIVERED


def test_paths_are_logged_on_one_line() -> None:
    record = AccessRecord("GET", "/a\nb c" + "x" * 300)
    line = record.line(0.0)
    assert "\n" not in line and len(line) < 400
