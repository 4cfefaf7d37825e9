"""The edge's access log, and the filter that keeps credentials out of every log line.

An access line carries the method, the path (never the query string: it holds session ids and
tenants), the status, the request kind, the outcome, the replica that answered, the attempts
made and the duration. No header value is ever logged: grants, cookies and callback tokens
(rule E7: a job-end token does not expire, so a copy in a log is a standing credential).

aiohttp itself logs the raw bytes of a request it cannot parse, and those bytes can hold an
``Authorization`` line, so :class:`RedactCredentials` is installed on the aiohttp and edge
loggers: it rewrites any message or traceback text that contains a credential-bearing header or
a ``bjn_v1.`` token before any handler sees it.
"""

from __future__ import annotations

import logging
import re
from typing import Final

from edge.classify import Kind
from edge.metrics import Outcome
from edge.placement import Tally

access_log = logging.getLogger("edge.access")

REDACTED: Final = "[redacted]"
_TOKEN = re.compile(r"bjn_v1\.\S*")
_CREDENTIAL_FIELD = re.compile(
    r"(?i)\b(authorization|proxy-authorization|x-beyond-grant|cookie|set-cookie)(\s*[:=]\s*)[^\r\n]*"
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
    return _TOKEN.sub("bjn_v1." + REDACTED, text)


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
        self.method = method
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
            f"{self.method} {self.path} {self.status} kind={self.kind.value} "
            f"outcome={self.outcome.value} replica={replica} attempts={attempts} "
            f"ms={duration_s * 1000:.1f}"
        )


def _loggable(path: str) -> str:
    # One line per request, whatever the client sent: no control characters, bounded length.
    if len(path) > _MAX_LOGGED_PATH:
        path = path[:_MAX_LOGGED_PATH] + "..."
    if not path.isprintable() or " " in path:
        path = path.encode("unicode_escape").decode("ascii").replace(" ", "%20")
    return path


def write(record: AccessRecord, duration_s: float) -> None:
    if access_log.isEnabledFor(logging.INFO):
        access_log.info("%s", record.line(duration_s))
