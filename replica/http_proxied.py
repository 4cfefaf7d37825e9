"""The model client's way through a proxy: httpx, for an endpoint the environment sends
through one.

``replica.http1_client`` connects straight to the server. httpx honours ``HTTP_PROXY``,
``HTTPS_PROXY``, ``ALL_PROXY`` and ``NO_PROXY`` (in either case) from the environment, so where
one of those applies to the endpoint (:func:`proxy_applies`) the request goes through httpx
instead, as it always did, read through :class:`ProxiedResponse`, which has the lean client's
response interface and raises its error classes.
"""

from __future__ import annotations

import contextlib
import ipaddress
import urllib.request
from collections.abc import Mapping, Sequence
from types import UnionType
from typing import Final

import httpx

from replica.http1_client import (
    ConnectError,
    ConnectTimeout,
    HTTPError,
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    WriteError,
    WriteTimeout,
    read_to_end,
)


def proxy_applies(scheme: str, host: str, proxies: Mapping[str, str] | None = None) -> bool:
    """Whether httpx would send a request for ``scheme://host`` through a proxy named by the
    environment (``proxies`` as ``urllib.request.getproxies`` gives them, which is where httpx
    reads them). When unsure, True: httpx then applies its own ``NO_PROXY`` rules, so an
    endpoint is never sent past a proxy the environment names for it. A ``NO_PROXY`` entry
    excludes the host when it is ``*``, the host itself, or a domain the host is in
    (``example.com`` or ``.example.com``; an address or ``localhost`` only as itself)."""
    if proxies is None:
        proxies = urllib.request.getproxies()
    if not (proxies.get(scheme) or proxies.get("all")):
        return False
    host = host.lower()
    for raw in proxies.get("no", "").split(","):
        entry = raw.strip().lower()
        if entry == "*":
            return False
        if not entry or "://" in entry or "/" in entry:
            continue  # a URL pattern or a range: httpx's to judge
        if entry == host or entry.strip("[]") == host:
            return False
        if entry.startswith("."):
            if host.endswith(entry):
                return False
        elif entry != "localhost" and not _is_address(entry) and host.endswith("." + entry):
            return False
    return True


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return False
    return True


class ProxiedClient:
    """httpx with the environment's proxies; ``timeout_s`` as the lean client reads it."""

    def __init__(self, timeout_s: float) -> None:
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s))

    async def request(
        self, url: str, headers: Sequence[tuple[str, str]], body: bytes
    ) -> ProxiedResponse:
        request = self._client.build_request("POST", url, headers=list(headers), content=body)
        failure: HTTPError | None = None
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            failure = _translated(exc)
        if failure is not None:
            raise failure
        return ProxiedResponse(response)

    async def aclose(self) -> None:
        await self._client.aclose()


class ProxiedResponse:
    """An httpx response read as ``replica.http1_client.Response`` is read."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code
        self._chunks = response.aiter_bytes()

    def header(self, name: str) -> str | None:
        value = self._response.headers.get(name)
        return None if value is None else str(value)

    def pace(self, window_s: float) -> None:
        """httpx reads as data arrives; the window is not kept here."""

    async def read(self) -> bytes:
        failure: HTTPError | None = None
        try:
            async for chunk in self._chunks:
                if chunk:
                    return chunk
            return b""
        except httpx.HTTPError as exc:
            failure = _translated(exc)
        raise failure

    async def drain(self, limit: int) -> bool:
        return await read_to_end(self.read, limit)

    async def aclose(self) -> None:
        aclose = getattr(self._chunks, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(httpx.HTTPError):
                await aclose()
        with contextlib.suppress(httpx.HTTPError):
            await self._response.aclose()


# httpx's errors and the lean client's classes of the same meaning, most specific first.
_FROM_HTTPX: Final[tuple[tuple[type[httpx.HTTPError] | UnionType, type[HTTPError]], ...]] = (
    (httpx.ConnectTimeout | httpx.PoolTimeout, ConnectTimeout),
    (httpx.WriteTimeout, WriteTimeout),
    (httpx.TimeoutException, ReadTimeout),
    (httpx.ConnectError, ConnectError),
    (httpx.WriteError, WriteError),
    (httpx.NetworkError, ReadError),
    (httpx.TransportError, RemoteProtocolError),
)


def _translated(exc: httpx.HTTPError) -> HTTPError:
    """httpx's error as the lean client's class of the same name (its message is not kept:
    an httpx message may quote the request)."""
    kind = next((ours for theirs, ours in _FROM_HTTPX if isinstance(exc, theirs)), HTTPError)
    return kind(f"through a proxy ({type(exc).__name__})")
