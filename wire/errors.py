"""The wire package's error tree.

The contract's grammar refuses with one error, so a caller on either side catches one class::

    WireError
    └── InvalidName    a tenant, shard, slice, session id or replica name that breaks the grammar

Each side maps it to its own answer: the replica answers 400 before the name touches a path,
the edge answers 400 (:class:`edge.core.errors.MalformedSessionId`) or refuses a start-up file
(:class:`edge.core.errors.ConfigError`). Messages say which rule was broken and never quote more of
the offending value than fits a log line: they are safe to log.
"""

from __future__ import annotations


class WireError(Exception):
    """Base of every error the contract's own parsers raise."""


class InvalidName(WireError):
    """A tenant, shard, slice, session id or replica name failed the strict parser."""
