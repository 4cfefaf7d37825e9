"""The edge's access log, and the filter that keeps credentials out of every log line.

An access line carries the method, the path (never the query string: it holds session ids and
tenants), the status, the request kind, the outcome, the replica that answered, the attempts
made and the duration. No header value is ever logged: grants, cookies and callback tokens
(rule E7: a job-end token does not expire, so a copy in a log is a standing credential).

aiohttp itself logs the raw bytes of a request it cannot parse, and those bytes can hold an
``Authorization`` line, so :class:`RedactCredentials` is installed on the aiohttp and edge
loggers: it rewrites any message or traceback text that contains a credential-bearing header or
a ``bjn_v1.`` token before any handler sees it.

A serving edge writes its access lines through an :class:`AccessSink` rather than a logger: one
line per request through ``logging`` (a record, a filter, a formatter, a flush) cost more CPU
than proxying the request. The sink formats the line as the root handler would, keeps it in a
buffer and writes the buffer out at most ``flush_after_s`` later (or once it holds
``max_lines``), and on shutdown. Without a sink (tests, embedding) lines go to the
``edge.access`` logger as before. Either way the only client-controlled parts of a line, the
method and the path, pass through :func:`redact` first.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from typing import Final, TextIO

from edge.classify import Kind
from edge.metrics import Outcome
from edge.placement import Tally
from wire.auth import NOTIFY_TOKEN_PREFIX
from wire.http import GRANT_HEADER

access_log = logging.getLogger("edge.access")

REDACTED: Final = "[redacted]"
_TOKEN = re.compile(re.escape(NOTIFY_TOKEN_PREFIX) + r"\S*")
_CREDENTIAL_FIELD = re.compile(
    rf"(?i)\b(authorization|proxy-authorization|{re.escape(GRANT_HEADER)}|cookie|set-cookie)"
    r"(\s*[:=]\s*)[^\r\n]*"
)
_BEARER = re.compile(r"(?i)\b(bearer)(\s+)\S+")
# Loggers whose records may quote request bytes or headers. A logger's filters apply only to
# records logged on it, not on its children, so each one is named.
PROTECTED_LOGGERS: Final = (
    "aiohttp.access",
    "aiohttp.client",
    "aiohttp.internal",
    "aiohttp.server",
    "aiohttp.web",
    "aiohttp.websocket",
    "asyncio",
    "edge",
    "edge.access",
    "edge.metrics",
    "edge.placement",
    "edge.proxy",
    "edge.server",
    "edge.websocket",
)
_MAX_LOGGED_PATH = 256


def redact(text: str) -> str:
    """``text`` with credential header values and callback tokens replaced."""
    if not text:
        return text
    text = _CREDENTIAL_FIELD.sub(lambda m: m.group(1) + m.group(2) + REDACTED, text)
    text = _BEARER.sub(lambda m: m.group(1) + m.group(2) + REDACTED, text)
    return _TOKEN.sub(NOTIFY_TOKEN_PREFIX + REDACTED, text)


class RedactCredentials(logging.Filter):
    """Rewrites a record in place so no handler can print a credential from it."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: let logging report it as usual
            return True
        cleaned = redact(message)
        if cleaned != message:
            record.msg = cleaned
            record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


_FILTER = RedactCredentials()


def install_redaction() -> None:
    """Attach the redaction filter to every logger that could quote request bytes (idempotent)."""
    for name in PROTECTED_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


class AccessRecord:
    """Filled in while a request is handled; written once when it ends."""

    __slots__ = ("kind", "method", "outcome", "path", "status", "tally")

    def __init__(self, method: str, path: str) -> None:
        self.method = _loggable(method)
        self.path = _loggable(path)
        self.kind = Kind.OTHER
        self.outcome = Outcome.REJECTED
        self.status = 0
        self.tally = Tally()

    def answered(self, status: int) -> None:
        """The client has its status line: whatever happens next, it was answered."""
        self.status = status
        self.outcome = Outcome.DELIVERED

    def line(self, duration_s: float) -> str:
        tally = self.tally
        replica = tally.replica or "-"
        attempts = tally.attempts
        return (
            f"{self.method} {self.path} {self.status} kind={self.kind} "
            f"outcome={self.outcome} replica={replica} attempts={attempts} "
            f"ms={duration_s * 1000:.1f}"
        )


@functools.lru_cache(maxsize=1024)
def _loggable(text: str) -> str:
    # One line per request, whatever the client sent: no control characters, bounded length,
    # nothing that reads as a credential. Cached: a fleet's paths and methods are few.
    if len(text) > _MAX_LOGGED_PATH:
        text = text[:_MAX_LOGGED_PATH] + "..."
    if not text.isprintable() or " " in text:
        text = text.encode("unicode_escape").decode("ascii").replace(" ", "%20")
    return redact(text)


class AccessSink:
    """Buffered access lines on ``stream``, each as ``logging``'s root handler formats a record
    (``<asctime> INFO edge.access: <line>``), written out in batches.

    A request hands over its record and the time; the line is made when the batch is written,
    after the answers have gone out, many lines in one go (which costs a fraction of making each
    as its request ends). A record is not changed once written.
    """

    def __init__(self, stream: TextIO, *, flush_after_s: float = 0.25, max_lines: int = 256):
        self.stream = stream
        self.flush_after_s = flush_after_s
        self.max_lines = max_lines
        self.pending: list[tuple[float, AccessRecord, float]] = []  # (when, what, how long)
        self._timer: asyncio.TimerHandle | None = None
        self._second = -1
        self._stamp = ""

    def add(self, record: AccessRecord, duration_s: float) -> None:
        pending = self.pending
        pending.append((time.time(), record, duration_s))
        if len(pending) >= self.max_lines:
            self.flush()
        elif self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a tool, a test): write at once
                self.flush()
                return
            self._timer = loop.call_later(self.flush_after_s, self.flush)

    def _line(self, now: float, record: AccessRecord, duration_s: float) -> str:
        second = int(now)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
        millis = int((now - second) * 1000)
        return f"{self._stamp},{millis:03d} INFO edge.access: {record.line(duration_s)}\n"

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.pending:
            return
        text = "".join([self._line(*entry) for entry in self.pending])
        self.pending.clear()
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or full stream must not fail requests
            pass


_sink: AccessSink | None = None


def use_sink(sink: AccessSink | None) -> AccessSink | None:
    """Send access lines to ``sink`` (None: back to the ``edge.access`` logger); returns the
    previous sink, flushed."""
    global _sink
    previous, _sink = _sink, sink
    if previous is not None:
        previous.flush()
    return previous


def write(record: AccessRecord, duration_s: float) -> None:
    if not access_log.isEnabledFor(logging.INFO):
        return
    if _sink is not None:
        _sink.add(record, duration_s)
    else:
        access_log.info("%s", record.line(duration_s))
