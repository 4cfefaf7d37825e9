"""Job-end notify tokens (``bjn_v1.``): minted by a replica when it starts a background job.

A sandbox presents the token when it calls back to say a job ended. Only replicas hold the notify
key, so only they can mint or verify one; the edge treats the token as opaque bytes. A token binds
the tenant and the session it may notify, never expires (a job may outlive any grant), and is never
written to a log, a metric, an error message or the shard.

Format: ``bjn_v1.<payload>.<mac>``, both parts unpadded base64url; the payload is JSON
``{"t": tenant, "s": session id, "n": nonce}`` and the mac is HMAC-SHA256 over
``bjn_v1.<payload>`` with the notify key. The prefix is the contract's
(``wire.auth.NOTIFY_TOKEN_PREFIX``): it is how the edge and the replica tell a callback from a
user request; the rest of the token is this module's.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass, field

from replica.errors import ReplicaError
from replica.keyfiles import b64url_decode, b64url_encode
from wire.auth import NOTIFY_TOKEN_PREFIX
from wire.errors import InvalidName
from wire.names import parse_session_id, parse_tenant

MAX_TOKEN_CHARS = 1024


class NotifyTokenError(ReplicaError):
    """The token is malformed or its mac does not verify; the service answers 401."""


@dataclass(frozen=True, slots=True)
class NotifyClaims:
    tenant: str
    session_id: str


@dataclass(frozen=True, slots=True)
class NotifyKey:
    key: bytes = field(repr=False)

    def mint(self, tenant: str, session_id: str) -> str:
        payload = json.dumps(
            {"t": tenant, "s": session_id, "n": secrets.token_urlsafe(8)}, separators=(",", ":")
        )
        body = NOTIFY_TOKEN_PREFIX + b64url_encode(payload.encode())
        return body + "." + b64url_encode(self._mac(body))

    def verify(self, token: str) -> NotifyClaims:
        if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS:
            raise NotifyTokenError("notify token is malformed")
        if not token.startswith(NOTIFY_TOKEN_PREFIX) or token.count(".") != 2:
            raise NotifyTokenError("notify token is malformed")
        body, _, mac_text = token.rpartition(".")
        try:
            mac = b64url_decode(mac_text)
            payload = json.loads(b64url_decode(body[len(NOTIFY_TOKEN_PREFIX) :]))
        except ValueError:
            raise NotifyTokenError("notify token is malformed") from None
        if not hmac.compare_digest(mac, self._mac(body)):
            raise NotifyTokenError("notify token does not verify")
        if not isinstance(payload, dict):
            raise NotifyTokenError("notify token is malformed")
        try:
            return NotifyClaims(
                parse_tenant(payload.get("t")), str(parse_session_id(payload.get("s")))
            )
        except InvalidName:
            raise NotifyTokenError("notify token names no valid session") from None

    def _mac(self, body: str) -> bytes:
        return hmac.new(self.key, body.encode(), hashlib.sha256).digest()
