"""The web page server's error tree.

Errors the page server raises on purpose derive from :class:`WebUIError`::

    WebUIError
    └── ConfigError     the server cannot start as asked (a routable listen address, a bad URL)

A request that the server refuses is answered with an HTTP status and a short text, never with
one of these: they only stop the process before it listens.
"""

from __future__ import annotations


class WebUIError(Exception):
    """Base of every deliberate page-server error."""


class ConfigError(WebUIError):
    """The page server was asked to start in a way it refuses."""
