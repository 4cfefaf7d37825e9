"""Fuzz query decoding and target splitting: the edge must read the value the replica reads.

Input: a raw request-target (bytes, read as latin-1 the way the edge receives it). Neither
``split_target`` nor ``query_values`` documents an error. Checked: the path and query agree with
what uvicorn's httptools protocol gives the replica for the same target (where it accepts it), and
``query_values`` agrees with Starlette's ``QueryParams.getlist`` for ``session_id``, ``tenant``,
``since`` and the target's own first key.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fuzz.common import instrument

    instrument("wire.target")

from starlette.datastructures import QueryParams

from fuzz.common import Harness, main
from fuzz.fuzz_classify import uvicorn_split
from fuzz.known import Mismatch
from wire.target import query_values, split_target

KEYS = ("session_id", "tenant", "since")


def check(data: bytes) -> None:
    target = data.decode("latin-1")
    path, query = split_target(target)
    if target.startswith("/"):
        replica = uvicorn_split(target)
        if replica is not None and replica != (path, query.encode("latin-1")):
            raise Mismatch("split", f"edge {(path, query)!r}, replica {replica!r}")
    raw = query.encode("latin-1")
    first_key = query.partition("&")[0].partition("=")[0]
    for key in (*KEYS, first_key):
        edge = query_values(query, key)
        replica_values = QueryParams(raw).getlist(key)
        if edge != replica_values:
            code = "query-values-empty-key" if key == "" else "query-values"
            raise Mismatch(code, f"key {key!r}: edge {edge!r}, Starlette {replica_values!r}")


HARNESS = Harness(
    target="query",
    test=check,
    tokens=(
        b"?",
        b"#",
        b"&",
        b"=",
        b"+",
        b";",
        b"%",
        b"%5F",
        b"%3D",
        b"%26",
        b"%ZZ",
        b"%C3%A9",
        b"%FF",
        b"session_id=",
        b"session%5Fid=",
        b"session+id",
        b"tenant=",
        b"since=",
        b"/_beyond/agent",
    ),
    max_len=1024,
)

if __name__ == "__main__":
    main(HARNESS)
