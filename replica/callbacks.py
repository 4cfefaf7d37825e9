"""Job-end callbacks from sandboxes, as the replica answers them.

A request is classified on its raw ``Authorization`` bytes exactly as the edge classifies it
(``wire.auth``, rule N21/E1): a look-alike is refused 400 and never treated as a user
request. A callback's token is verified before any session is looked up, so a forged one costs a
MAC and nothing else. Then:

- this replica holds the session: reconcile (``replica.jobs``) and answer 200;
- it does not: hand a ``job_ended`` lifecycle event to the control plane, which wakes the
  session, and answer 202 once it has taken it; without a lifecycle URL, or while the control
  plane does not answer, 503 (the sandbox retries, and the walk moves on to the holder).

A callback never opens a session itself, and is answered within 20 s. The token is never logged.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from replica.errors import Unavailable
from replica.jobs import Reconciler
from replica.lifecycle import Lifecycle
from replica.live import LiveSession, LiveState
from replica.metrics import ReplicaMetrics
from replica.notify import NotifyKey, NotifyTokenError
from replica.registry import Registry
from wire.auth import NOTIFY_TOKEN_PREFIX, AuthClass, classify_authorization
from wire.http import (
    GRANT_REFUSED,
    MALFORMED,
    NOT_PERMITTED,
    RETRY_LATER,
    SESSION_ID_PARAM,
    TENANT_PARAM,
    retry_after_headers,
)

ANSWER_WITHIN_S = 20.0
MAX_CALLBACK_BYTES = 64 * 1024


def auth_class(request: Request) -> AuthClass:
    return classify_authorization(request.headers.raw)


def _token(request: Request) -> str:
    value = request.headers["authorization"]
    return value[value.index(NOTIFY_TOKEN_PREFIX) :].strip()


class CallbackHandler:
    def __init__(
        self,
        *,
        registry: Registry,
        notify_key: NotifyKey,
        lifecycle: Lifecycle,
        reconciler: Callable[[LiveSession], Reconciler],
        metrics: ReplicaMetrics,
        answer_within_s: float = ANSWER_WITHIN_S,
    ) -> None:
        self.registry = registry
        self.notify_key = notify_key
        self.lifecycle = lifecycle
        self.reconciler = reconciler
        self.metrics = metrics
        self.answer_within_s = answer_within_s

    def _answer(self, status: int, message: str, outcome: str) -> Response:
        self.metrics.callbacks.labels(outcome).inc()
        headers = retry_after_headers() if status == RETRY_LATER else {}
        return PlainTextResponse(message + "\n", status, headers=headers)

    async def handle(self, request: Request) -> Response:
        try:
            async with asyncio.timeout(self.answer_within_s):
                return await self._handle(request)
        except TimeoutError:
            return self._answer(
                RETRY_LATER, "the job's end could not be handled in time; retry", "unavailable"
            )

    async def _handle(self, request: Request) -> Response:
        try:
            claims = self.notify_key.verify(_token(request))
        except (NotifyTokenError, ValueError):
            return self._answer(GRANT_REFUSED, "the notify token does not verify", "refused")
        ids = request.query_params.getlist(SESSION_ID_PARAM)
        tenants = request.query_params.getlist(TENANT_PARAM)
        if len(ids) != 1 or len(tenants) > 1:
            return self._answer(
                MALFORMED, "name session_id exactly once (and tenant at most once)", "bad_request"
            )
        if ids[0] != claims.session_id or (tenants and tenants[0] != claims.tenant):
            return self._answer(NOT_PERMITTED, "the token is for another session", "refused")
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_CALLBACK_BYTES):
            return self._answer(413, "the callback body is too large", "bad_request")
        body = await request.body()
        if len(body) > MAX_CALLBACK_BYTES:
            return self._answer(413, "the callback body is too large", "bad_request")
        try:
            event = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            event = None
        if not isinstance(event, dict) or event.get("type") != "job_ended":
            return self._answer(
                MALFORMED, 'a callback body is {"type": "job_ended", ...}', "bad_request"
            )
        live = self.registry.sessions.get(claims.session_id)
        if live is not None and live.tenant == claims.tenant and live.state is LiveState.OPEN:
            try:
                await self.reconciler(live).request()
            except Unavailable as exc:
                return self._answer(RETRY_LATER, str(exc), "unavailable")
            self.metrics.callbacks.labels("reconciled").inc()
            return JSONResponse({"reconciled": True})
        report = {
            "type": "job_ended",
            "session_id": claims.session_id,
            "tenant": claims.tenant,
            "job_id": event.get("job_id"),
            "status": event.get("status"),
            "exit_code": event.get("exit_code"),
        }
        if await self.lifecycle.hand_off(report, self.answer_within_s - 1.0):
            self.metrics.callbacks.labels("handed_off").inc()
            return JSONResponse({"handed_off": True}, status_code=202)
        return self._answer(
            RETRY_LATER, "this replica does not hold the session; retry", "unavailable"
        )
