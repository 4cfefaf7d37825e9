from __future__ import annotations

import asyncio
import io
import logging
import re
from collections.abc import Iterator

import pytest

from edge.core.accesslog import (
    AccessRecord,
    AccessSink,
    use_sink,
    write,
)
from edge.core.classify import Kind
from edge.core.metrics import Outcome
from wire.redaction import RedactCredentials, redact, redact_handlers


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
    redact_handlers()
    record = AccessRecord("POST", "/_beyond/agent")
    record.kind = Kind.CALLBACK
    record.answered(202)
    record.tally.replica = "r2"
    record.tally.attempts = 3
    with caplog.at_level(logging.INFO, "edge.access"):
        write(record, 0.0123)
    assert caplog.messages == [
        "POST /_beyond/agent 202 kind=callback lane=aiohttp outcome=delivered replica=r2 "
        "attempts=3 ms=12.3"
    ]
    assert record.outcome is Outcome.DELIVERED


def test_paths_are_logged_on_one_line() -> None:
    record = AccessRecord("GET", "/a\nb c" + "x" * 300)
    line = record.line(0.0)
    assert "\n" not in line and len(line) < 400


@pytest.fixture
def sink() -> Iterator[tuple[AccessSink, io.StringIO]]:
    stream = io.StringIO()
    made = AccessSink(stream, flush_after_s=0.05, max_lines=4)
    use_sink(made)
    try:
        yield made, stream
    finally:
        use_sink(None)


def delivered(path: str = "/_beyond/agent", method: str = "POST") -> AccessRecord:
    record = AccessRecord(method, path)
    record.kind = Kind.COMMAND
    record.answered(200)
    record.tally.replica = "r1"
    record.tally.attempts = 1
    return record


@pytest.mark.anyio
async def test_the_sink_batches_lines_and_writes_them_soon(
    sink: tuple[AccessSink, io.StringIO], caplog: pytest.LogCaptureFixture
) -> None:
    _, stream = sink
    with caplog.at_level(logging.INFO, "edge.access"):
        write(delivered(), 0.002)
        write(delivered(), 0.003)
        assert stream.getvalue() == ""  # buffered, not yet written
        # Not a wait for anything: the sink's timer (flush_after_s, 0.05 s) is what is under
        # test, and the loop runs timers in deadline order, so it has fired by this sleep's end.
        await asyncio.sleep(0.2)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and not caplog.messages  # the sink, not the logger
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO edge\.access: POST /_beyond/agent 200 "
        r"kind=command lane=aiohttp outcome=delivered replica=r1 attempts=1 ms=2\.0",
        lines[0],
    )


@pytest.mark.anyio
async def test_a_full_buffer_is_written_at_once_and_a_removed_sink_is_flushed(
    sink: tuple[AccessSink, io.StringIO], caplog: pytest.LogCaptureFixture
) -> None:
    made, stream = sink
    with caplog.at_level(logging.INFO, "edge.access"):
        for _ in range(5):
            write(delivered(), 0.001)
        assert len(stream.getvalue().splitlines()) == 4  # max_lines reached
        assert use_sink(None) is made
        assert len(stream.getvalue().splitlines()) == 5


def test_the_sink_keeps_quiet_below_info_and_redacts_what_the_client_chose(
    sink: tuple[AccessSink, io.StringIO], caplog: pytest.LogCaptureFixture
) -> None:
    made, stream = sink
    with caplog.at_level(logging.WARNING, "edge.access"):
        write(delivered(), 0.001)
    made.flush()
    assert stream.getvalue() == ""
    with caplog.at_level(logging.INFO, "edge.access"):
        write(delivered("/_beyond/agent/bjn_v1.secret", method="bjn_v1.other"), 0.001)
    made.flush()  # no running loop: written at once anyway
    text = stream.getvalue()
    assert "secret" not in text and "other" not in text and text.count("[redacted]") == 2


def test_a_broken_stream_does_not_fail_the_request(caplog: pytest.LogCaptureFixture) -> None:
    stream = io.StringIO()
    stream.close()
    use_sink(AccessSink(stream))
    try:
        with caplog.at_level(logging.INFO, "edge.access"):
            write(delivered(), 0.001)
    finally:
        use_sink(None)


def test_the_filter_on_a_handler_covers_every_logger_below_it() -> None:
    # A filter on a logger misses its children's records; on the handler it sees them all.
    stream = io.StringIO()
    top = logging.getLogger("hygiene-test")
    top.propagate = False
    handler = logging.StreamHandler(stream)
    top.addHandler(handler)
    try:
        redact_handlers(top)
        redact_handlers(top)  # idempotent
        assert len(handler.filters) == 1
        logging.getLogger("hygiene-test.lane.deeper").warning("Cookie: sid=hunter2")
    finally:
        top.removeHandler(handler)
    assert "hunter2" not in stream.getvalue() and "[redacted]" in stream.getvalue()
