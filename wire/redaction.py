"""Credentials out of log text: which shapes of text carry one, and a logging filter that
replaces them.

This is the second line. The first is that neither side logs request bytes at all: the edge
logs a request it cannot parse by the error's kind and the peer (``edge.core.accesslog``), and the
replica's HTTP server logs such requests without their bytes. The filter is for what slips past
that: a traceback or a library's message that quotes a header. It goes on the *handlers*, so it
sees every record whichever logger it was made on (a filter on a logger would not see its
children's records).
"""

from __future__ import annotations

import logging
import re
from typing import Final

from wire.auth import NOTIFY_TOKEN_PREFIX
from wire.http import GRANT_HEADER

REDACTED: Final = "[redacted]"
_TOKEN: Final = re.compile(re.escape(NOTIFY_TOKEN_PREFIX) + r"\S*")
_CREDENTIAL_FIELD: Final = re.compile(
    rf"(?i)\b(authorization|proxy-authorization|{re.escape(GRANT_HEADER)}|cookie|set-cookie)"
    r"(\s*[:=]\s*)[^\r\n]*"
)
_BEARER: Final = re.compile(r"(?i)\b(bearer)(\s+)\S+")


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


_FILTER: Final = RedactCredentials()


def redact_handlers(logger: logging.Logger | None = None) -> None:
    """Put the filter on every handler of ``logger`` (default: the root logger, where records of
    every logger end up); idempotent. Call it once logging is configured."""
    for handler in (logger or logging.getLogger()).handlers:
        if _FILTER not in handler.filters:
            handler.addFilter(_FILTER)
