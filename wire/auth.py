"""What an ``Authorization`` header makes of a request: a job-end callback, a look-alike, or
neither (rule E1 of the contract), decided on the values' *bytes*, never on decoded text:

* a request **is a callback** when it carries exactly one ``Authorization`` header whose value
  starts with ``Bearer`` (any case), one or more spaces, then the notify-token prefix
  ``bjn_v1.``, and the value is valid UTF-8;
* it **looks like a callback** when any ``Authorization`` value starts with ``bearer`` (any
  case), any run of spaces and tabs (possibly none), then ``bjn_v1.``.

Something that looks like a callback but is not one (two headers, a tab, no space, a value that
is not UTF-8) is refused 400 by both sides and never forwarded: it would otherwise reach a
replica as a user request carrying a callback token. The edge and the replica classify with this
one function, so they can never disagree about which requests are callbacks.

The token after the prefix is the replica's business (``replica.notify`` mints and verifies it);
to everyone else it is opaque.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from typing import Final

NOTIFY_TOKEN_PREFIX: Final = "bjn_v1."  # noqa: S105 (a public marker, not a secret)

_AUTHORIZATION = b"authorization"
_PREFIX = re.escape(NOTIFY_TOKEN_PREFIX.encode("ascii"))
# Anchored at the start of the value: HTTP parsers strip the optional whitespace around a field
# value, so what they hand over begins with the scheme.
_CALLBACK = re.compile(rb"[Bb][Ee][Aa][Rr][Ee][Rr] +" + _PREFIX)
_LOOKS_LIKE = re.compile(rb"[Bb][Ee][Aa][Rr][Ee][Rr][ \t]*" + _PREFIX)


class AuthClass(enum.Enum):
    NONE = enum.auto()
    CALLBACK = enum.auto()
    LOOKALIKE = enum.auto()


def classify_authorization(headers: Iterable[tuple[bytes, bytes]]) -> AuthClass:
    """Rule E1 on raw ``(name, value)`` pairs; names compare case-insensitively."""
    values = [value for name, value in headers if name.lower() == _AUTHORIZATION]
    if not values:
        return AuthClass.NONE
    if not any(_LOOKS_LIKE.match(value) for value in values):
        return AuthClass.NONE
    if len(values) == 1 and _CALLBACK.match(values[0]) and _is_utf8(values[0]):
        return AuthClass.CALLBACK
    return AuthClass.LOOKALIKE


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
