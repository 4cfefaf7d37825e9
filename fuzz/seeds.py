"""Write the seed corpora: ``python -m fuzz.seeds`` (re)writes ``tests/corpus/<target>/seed-*``.

Seeds are small valid and near-valid inputs in each harness's input format; files not named
``seed-*`` (``crash-*`` inputs, hand-added cases) are left alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from fuzz.formats import build_segment
from fuzz.fuzz_grants import NOW, signed_token
from fuzz.fuzz_notify import token_for
from fuzz.fuzz_segments import SEALER
from replica.grants import encode_secrets

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "corpus"
SID = "a07-s1.abc"
AGENT = f"/_beyond/agent?session_id={SID}&tenant=acme"


def _head(request_line: str, *headers: bytes) -> bytes:
    return (
        request_line.encode() + b" HTTP/1.1\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n"
    )


def classify() -> Iterator[bytes]:
    host = b"Host: edge"
    yield _head(f"POST {AGENT}", host, b"Authorization: Bearer bjn_v1.tok", b"Content-Length: 2")
    yield _head(f"POST {AGENT}", host, b"x-beyond-grant: eyJ.a.b", b"Content-Length: 2")
    yield _head(f"GET {AGENT}", host, b"Upgrade: websocket", b"Connection: Upgrade")
    yield _head(f"GET /_beyond/agent/events?session_id={SID}", host, b"Last-Event-ID: m1")
    yield _head("GET /livez", host)
    yield _head("GET /readyz", host, b"Authorization: Bearer bjn_v1.x")
    yield _head(f"POST {AGENT}", host, b"Authorization: Bearer\tbjn_v1.tok")
    yield _head(f"POST {AGENT}", host, b"Authorization: bearerbjn_v1.tok")
    yield _head(f"POST {AGENT}", b"authorization: Bearer bjn_v1.a", b"AUTHORIZATION: Basic x")
    yield _head(f"POST {AGENT}", host, b"Authorization: Bearer bjn_v1.tok\xff")
    yield _head(f"GET {AGENT}", host, b"Authorization: BEARER   bjn_v1.tok")
    yield _head(f"POST /_beyond/agent?session_id={SID}&session_id={SID}", host)
    yield _head("POST /_beyond/agent?session%5Fid=a07-s1.x&a=%ZZ+b#frag?session_id=z", host)
    yield _head("POST /_beyond/%61gent?session_id=a07-s1.x", host)
    yield _head("OPTIONS *", host)
    yield _head("GET http://edge/_beyond/agent?session_id=a07-s1.x", host)


def query() -> Iterator[bytes]:
    yield AGENT.encode()
    yield b"/_beyond/agent?session_id=a07-s1.x&session_id=a07-s1.y"
    yield b"/_beyond/agent?session%5Fid=a07-s1.x&tenant=a+b&since=m%41"
    yield b"/_beyond/agent?session_id&=x&&;session_id=q"
    yield b"/_beyond/%2Fagent?session_id=%C3%A9%FF%ZZ#frag?session_id=z"
    yield b"/a%2F..%2F?x=1+%2B"
    yield b"/_beyond/agent?session_id=\xe9"


def names() -> Iterator[bytes]:
    yield from (b"a07-s1.abc", b"a07-s1", b"a07", b"acme", b"acme.corp-1_x", b"acme|a07-s1.abc")
    yield from (b"a07-s1.", b".abc", b"a07.x", b"-s1.x", b"a07-s1.a/b", b"..", b"acme..x")
    yield from (b"a07-s1.ab\xc4\xb1", b"a07-s1.\xff", b"A" * 33 + b"-s.x", b"a07-s1.x\n")


def protocol() -> Iterator[bytes]:
    commands: list[dict[str, object]] = [
        {"type": "prompt", "id": "p1", "message": "hello"},
        {"type": "abort"},
        {"type": "get_messages", "since": "m1"},
        {"type": "get_state", "id": "s"},
        {"type": "list_sessions", "query": "q", "limit": 10},
        {"type": "new_session"},
        {"type": "job_ended", "job_id": "j1"},
    ]
    yield from (json.dumps(c).encode() for c in commands)
    yield b'{"type":"prompt","message":"\\ud800"}'
    yield b'{"type":"prompt","type":"abort"}'
    yield b'{"type":"list_sessions","limit":true}'
    yield b'{"type":"get_messages","since":NaN}'
    yield b"[" * 64 + b"]" * 64
    yield b'\xff\xfe{\x00"\x00}\x00'


def _secrets() -> bytes:
    return encode_secrets(bytes(range(32)), {"x-sandbox-token": "t"})


def _claims(**changes: object) -> dict[str, object]:
    claims: dict[str, object] = {
        "iss": "beyond-control-plane",
        "aud": "beyond-fleet",
        "iat": NOW - 10,
        "exp": NOW + 600,
        "ten": "acme",
        "sid": SID,
        "shard": "a07-s1",
        "ws": "/workspace",
        "exec": "http://127.0.0.1:9/exec",
        "sec": "@SEALED@",
    }
    claims.update(changes)
    return claims


def _structured(claims: dict[str, object], header: bytes = b"", secrets: bytes = b"") -> bytes:
    head = header or b'{"alg":"EdDSA","kid":"k1","typ":"JWT"}'
    body = json.dumps(claims, separators=(",", ":")).encode()
    return head + b"\n" + body + b"\n" + (secrets or _secrets())


def grants() -> Iterator[bytes]:
    valid = _structured(_claims())
    yield valid
    yield signed_token(valid).encode()
    yield _structured(_claims(), header=b'{"alg":"none","kid":"k1"}')
    yield _structured(_claims(), header=b'{"alg":"EdDSA","kid":"k2"}')
    yield _structured(_claims(), header=b'{"alg":"EdDSA","kid":"k1","jku":"x"}')
    yield _structured(_claims(exp=NOW - 100))
    yield _structured(_claims(sid="a07-s2.abc"))
    yield _structured(_claims(exec="http://u:p@127.0.0.1:9/x"))
    yield _structured(_claims(), secrets=b'{"dek":"AAAA","exec_headers":{}}')
    yield _structured(_claims(), secrets=b'{"dek":"x","exec_headers":{"Host":"h"}}')
    yield b"eyJhbGciOiJub25lIn0.eyJ9.x"
    yield b"a.b"


def notify() -> Iterator[bytes]:
    payload = b'{"t":"acme","s":"a07-s1.abc","n":"x"}'
    yield payload
    yield token_for(payload).encode()
    yield b'{"t":"acme","s":"../x","n":"x"}'
    yield b'{"t":1}'
    yield b"bjn_v1.eyJ0IjoiYSJ9.AAAA"
    yield b"bjn_v1.a.b.c"


def last_event_id() -> Iterator[bytes]:
    yield b"m2\n\nm1\nm2\nm3"
    yield b"\nsince=m1\nm1\nm2"
    yield b"m9\nsince=m1\nm1\nm2"
    yield b"\nsince=%6D1&since=m2\nm1\nm2"
    yield b"\xff\n\n\xc3\xbf\nm1"


def sse() -> Iterator[bytes]:
    yield b"\x00hello world\x1fmAAAAAAAAAAAA"
    yield b"\x00multi\nline\r\ntext\x1fm1\x1fmore"
    yield b"\x00: not a comment\x1fid\rwith\ncr"
    yield b"\x00nul\x00inside\x1fid\x00nul"
    yield b"\x02latin-1 \xe9"


def _segment_one() -> tuple[bytes, int]:
    header = b'{"k":"h","prev":null,"seal":null,"owner":"r1","ts":1.0}'
    batch = (
        b'{"k":"b","m":[{"id":"m1","parent_id":null,"role":"user","content":"hi","ts":1},'
        b'{"id":"m2","parent_id":"m1","role":"assistant","content":"hello","ts":2}]}'
    )
    script = b"prefix 1\nrec 0 " + header + b"\nrec 1 " + batch
    end = len(build_segment(script.split(b"\n"), 1, SEALER).data)
    return script, end


def segments() -> Iterator[bytes]:
    script, end = _segment_one()
    yield script
    yield script + b"\nzrec 2 " + b'{"k":"b","m":[],"pad":"' + b"x" * 200 + b'"}'
    yield script + b"\nrec 2 " + b'{"k":"r","jobs":["j1"]}'
    yield script + b"\nbound " + str(end).encode()
    yield script + b"\nheader-only"
    yield script + b"\nlen 200\nraw abc"
    yield script + b"\nzero 64"
    yield b"epoch 2\nprefix 2\nrec 0 " + b'{"k":"h","prev":1,"seal":13,"owner":"r2","ts":2}'
    yield b"prefix 1\nrec 0@2 {}"
    yield b"prefix 1\nsealed 0 \x02{}"
    yield b"raw BFS"


def history() -> Iterator[bytes]:
    script, end = _segment_one()
    second = (
        b"prefix 2\nrec 0 "
        + f'{{"k":"h","prev":1,"seal":{end},"owner":"r2","ts":2}}'.encode()
        + b'\nrec 1 {"k":"r","jobs":["j1"]}'
    )
    yield b"file epoch-0000000001.seg\n" + script
    yield (
        b"file epoch-0000000001.seg\n"
        + script
        + b"\nraw stale\nfile epoch-0000000002.seg\n"
        + second
    )
    yield b"file epoch-0000000002.seg\n" + second
    yield b"file epoch-0000000001.seg\n" + script + b"\nfile epoch-0000000003.seg\n" + second
    yield b"dir epoch-0000000001.seg\nfile lock\nraw x"
    yield b"file epoch-0000000001.seg\nprefix 1\nrec 0 {}"


SEEDS = {
    "classify": classify,
    "query": query,
    "names": names,
    "protocol": protocol,
    "grants": grants,
    "notify": notify,
    "last_event_id": last_event_id,
    "sse": sse,
    "segments": segments,
    "history": history,
}


def write_seeds(root: Path = CORPUS) -> dict[str, int]:
    counts: dict[str, int] = {}
    for target, make in SEEDS.items():
        directory = root / target
        directory.mkdir(parents=True, exist_ok=True)
        for old in directory.glob("seed-*"):
            old.unlink()
        seeds = list(make())
        for number, seed in enumerate(seeds):
            (directory / f"seed-{number:02d}").write_bytes(seed)
        counts[target] = len(seeds)
    return counts


if __name__ == "__main__":
    for target, count in write_seeds().items():
        print(f"{target}: {count} seeds")
