"""Which requests the page server answers at all: pure checks on a request's headers.

The server listens on loopback only, but a browser will send requests there on behalf of any
site it visits. Three checks keep other sites out:

* ``Host`` must name this server by a loopback name and its own port. A site that rebinds its
  own DNS name to 127.0.0.1 reaches the socket, but its requests carry its own name here.
* ``Sec-Fetch-Site`` (sent by every current browser) must be ``same-origin`` or ``none``.
* A request that changes anything must carry JSON, and an ``Origin``, when present, must be
  this server's; a cross-site form cannot send ``application/json`` without a preflight that
  this server never approves.

The client cookie is also ``SameSite=Strict``, so a request from another site would carry no
grant even if it got through.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_SAME_SITE = frozenset({"same-origin", "none"})


@dataclass(frozen=True, slots=True)
class Allowed:
    """The names this server answers to: ``host:port`` pairs and the matching origins."""

    hosts: frozenset[str]

    @classmethod
    def for_port(cls, port: int, bound_host: str) -> Allowed:
        bare = bound_host.strip("[]")
        names = {*LOOPBACK_NAMES, f"[{bare}]" if ":" in bare else bare}
        return cls(frozenset(f"{name}:{port}" for name in names))

    @property
    def origins(self) -> frozenset[str]:
        return frozenset(f"http://{host}" for host in self.hosts)


def refusal(method: str, headers: Mapping[str, str], allowed: Allowed) -> str | None:
    """Why a request must be refused, or None when it may be served."""
    host = headers.get("Host", "").lower()
    if host not in allowed.hosts:
        return "this server answers only to its own loopback address"
    site = headers.get("Sec-Fetch-Site")
    if site is not None and site.lower() not in _SAME_SITE:
        return "requests from other sites are refused"
    if method.upper() in SAFE_METHODS:
        return None
    origin = headers.get("Origin")
    if origin is not None and origin.lower() not in allowed.origins:
        return "requests from other origins are refused"
    content_type = headers.get("Content-Type", "").split(";")[0].strip().lower()
    if method.upper() != "DELETE" and content_type != "application/json":
        return "send JSON (Content-Type: application/json)"
    return None
