"""Fuzz job-end notify token verification (``replica.notify.NotifyKey.verify``).

Two input shapes: ``{...`` is a payload JSON that the harness MACs with the real key into a
``bjn_v1.`` token, so mutations reach the claim checks behind the MAC; anything else is the raw
token text (invalid UTF-8 kept as lone surrogates). The documented error is
:class:`~replica.notify.NotifyTokenError`; accepted claims must name a valid tenant and session.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fuzz.common import instrument

    instrument("replica.notify", "replica.keyfiles", "wire.names")

import hashlib
import hmac

from fuzz.common import Harness, main
from fuzz.known import Mismatch
from replica.keyfiles import b64url_encode
from replica.notify import NotifyKey, NotifyTokenError
from wire.auth import NOTIFY_TOKEN_PREFIX as PREFIX
from wire.names import parse_session_id, parse_tenant

KEY = NotifyKey(bytes(range(32)))


def token_for(payload: bytes) -> str:
    body = PREFIX + b64url_encode(payload)
    mac = hmac.new(KEY.key, body.encode(), hashlib.sha256).digest()
    return body + "." + b64url_encode(mac)


def check(data: bytes) -> None:
    token = token_for(data) if data.startswith(b"{") else data.decode("utf-8", "surrogateescape")
    try:
        claims = KEY.verify(token)
    except NotifyTokenError:
        return
    if parse_tenant(claims.tenant) != claims.tenant:
        raise Mismatch("claims", f"accepted {claims!r}")
    if str(parse_session_id(claims.session_id)) != claims.session_id:
        raise Mismatch("claims", f"accepted {claims!r}")


HARNESS = Harness(
    target="notify",
    test=check,
    tokens=(b"bjn_v1.", b'"t":"acme"', b'"s":"a07-s1.abc"', b'"n":"x"', b"eyJ", b".", b"=="),
    max_len=2048,
)

if __name__ == "__main__":
    main(HARNESS)
