"""The edge's access log, and the filter that keeps credentials out of every log line.

An access line carries the method, the path (never the query string: it holds session ids and
tenants), the status, the request kind, the outcome, the replica that answered, the attempts
made and the duration. No header value is ever logged: grants, cookies and callback tokens
(rule E7: a job-end token does not expire, so a copy in a log is a standing credential).

aiohttp quotes the raw bytes of a request it cannot parse in the error it logs, and those bytes
can hold an ``Authorization`` or ``Cookie`` line, so the edge hands aiohttp a
:class:`RequestErrors` to log through, which writes such a request as the error's kind, its
status and the peer, and nothing of its bytes. As a second line,
:class:`wire.redaction.RedactCredentials` sits on the log handlers and rewrites any message or
traceback text that holds a credential-bearing header or a ``bjn_v1.`` token.

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
import enum
import functools
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

from aiohttp.http_exceptions import HttpProcessingError

from edge.core.classify import Kind
from edge.core.metrics import Outcome
from edge.core.placement import Tally
from wire.redaction import redact

access_log = logging.getLogger("edge.access")

_MAX_LOGGED_PATH = 256


class RequestErrors:
    """What aiohttp's request handler logs through (its ``logger``): a request it could not
    parse is written as the error's kind, its status and the peer, never as the bytes aiohttp
    quotes in the error (a header line that failed to parse may be an ``Authorization`` or a
    ``Cookie``). Anything else goes to ``aiohttp.server`` as aiohttp wrote it."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self._logger = logger or logging.getLogger("aiohttp.server")

    def _log(self, level: int, msg: str, args: tuple[Any, ...], exc_info: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else None
        if exc is None and exc_info is True:
            exc = sys.exc_info()[1]
        if isinstance(exc, HttpProcessingError):
            peer = next((str(a) for a in args if isinstance(a, str)), "-")
            self._logger.info(
                "bad request from %s: %s (%d)", _loggable(peer), type(exc).__name__, exc.code
            )
            return
        self._logger.log(level, msg, *args, exc_info=exc_info)

    def debug(self, msg: str, *args: Any, exc_info: Any = None, **_: Any) -> None:
        if self._logger.isEnabledFor(logging.DEBUG):
            self._log(logging.DEBUG, msg, args, exc_info)

    def info(self, msg: str, *args: Any, exc_info: Any = None, **_: Any) -> None:
        self._log(logging.INFO, msg, args, exc_info)

    def warning(self, msg: str, *args: Any, exc_info: Any = None, **_: Any) -> None:
        self._log(logging.WARNING, msg, args, exc_info)

    def error(self, msg: str, *args: Any, exc_info: Any = None, **_: Any) -> None:
        self._log(logging.ERROR, msg, args, exc_info)

    def exception(self, msg: str, *args: Any, exc_info: Any = True, **_: Any) -> None:
        self._log(logging.ERROR, msg, args, exc_info)


class Lane(enum.StrEnum):
    """Which of the edge's lanes carried a request (see ARCHITECTURE.md)."""

    FAST = enum.auto()  # a command served off the socket by edge.fast.fastpath, in a task
    EXPRESS = enum.auto()  # a command followed by callbacks alone (edge.fast.express)
    AIOHTTP = enum.auto()  # everything else, on aiohttp's server


class AccessRecord:
    """Filled in while a request is handled; written once when it ends."""

    __slots__ = ("kind", "lane", "method", "outcome", "path", "status", "tally")

    def __init__(self, method: str, path: str, lane: Lane = Lane.AIOHTTP) -> None:
        self.method = _loggable(method)
        self.path = _loggable(path)
        self.lane = lane
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
            f"{self.method} {self.path} {self.status} kind={self.kind} lane={self.lane} "
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


# Writes up to this size reach a pipe whole, never interleaved with another process's writes
# (POSIX's PIPE_BUF): what keeps the lines of several edge workers on one stderr apart.
ATOMIC_WRITE_BYTES = 4096


def _whole_lines(text: str) -> Iterator[str]:
    """``text`` in pieces of whole lines, each at most :data:`ATOMIC_WRITE_BYTES` where its
    lines allow (a longer line goes alone)."""
    # Characters per piece: a byte each when ASCII (the usual case), else at most four.
    most = ATOMIC_WRITE_BYTES if text.isascii() else ATOMIC_WRITE_BYTES // 4
    if len(text) <= most:
        yield text
        return
    start = 0
    while start < len(text):
        end = text.rfind("\n", start, start + most)
        if end < start:
            end = text.find("\n", start)
            if end < 0:
                end = len(text) - 1
        yield text[start : end + 1]
        start = end + 1


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
            for piece in _whole_lines(text):
                self.stream.write(piece)
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
