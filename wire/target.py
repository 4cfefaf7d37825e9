"""Reading a request-target the way the replica's server does, so the edge routes by exactly
the values the replica then reads.

The path is percent-decoded as uvicorn decodes it, and query values come out as Starlette's
``QueryParams`` makes them (the raw bytes as latin-1, then ``parse_qsl(...,
keep_blank_values=True)``). An edge that decoded either differently could route a request by
one session id, or classify one path, while the replica served another.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, unquote


def split_target(target: str) -> tuple[str, str]:
    """``(decoded path, raw query)`` of an origin-form request-target, as uvicorn splits it.

    A fragment is cut off first (a ``?`` inside it belongs to it), then the query; the path is
    percent-decoded as UTF-8 with replacement, exactly like ``urllib.parse.unquote``.
    """
    target = target.partition("#")[0]
    path, _, query = target.partition("?")
    return unquote(path), query


def query_values(query: str, key: str) -> list[str]:
    """Every value of ``key`` in ``query``, decoded as the replica's query parser decodes it."""
    if "%" in query or "+" in query:
        return [v for k, v in parse_qsl(query, keep_blank_values=True) if k == key]
    # Nothing to unquote: the same split parse_qsl makes ('&' only, first '=' splits, empty
    # parts skipped, a bare name is a blank value), without its per-pair decoding.
    values: list[str] = []
    for part in query.split("&"):
        name, _, value = part.partition("=")
        if name == key:
            values.append(value)
    return values
