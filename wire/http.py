"""The HTTP surface both sides agree on: paths, query parameters, header names and the statuses
by which a replica refuses.

A replica answers a session request with one of (the contract's "replica answers"):

======================  =====  ===============================================================
name                    code   meaning and what the edge does with it
======================  =====  ===============================================================
``RETRY_LATER``         503    not now (lock held elsewhere, live-session cap, previous task
                               exiting, draining), with ``Retry-After: 1``: retried, then the
                               ring is walked
``MISDIRECTED``         421    the session's shard is not mounted here: never retried there
``GRANT_REFUSED``       401    the grant (or a notify token) did not verify: to the client
``NOT_PERMITTED``       403    it verified but does not cover this request: to the client
``MALFORMED``           400    a malformed id, query, body or callback: to the client
``UNKNOWN_EVENT_ID``    409    resuming from a message id the session does not have: to the
                               client unchanged
======================  =====  ===============================================================

The edge answers with the same meanings where it refuses a request itself.
"""

from __future__ import annotations

from typing import Final

# Paths. Everything for a session is under AGENT_PATH; the probes are each process's own.
AGENT_PATH: Final = "/_beyond/agent"
EVENTS_PATH: Final = AGENT_PATH + "/events"
LIVEZ_PATH: Final = "/livez"
READYZ_PATH: Final = "/readyz"

# Query parameters of a session request.
SESSION_ID_PARAM: Final = "session_id"
TENANT_PARAM: Final = "tenant"
SINCE_PARAM: Final = "since"

# Header names, in the case they are sent in (compare them case-insensitively).
GRANT_HEADER: Final = "x-beyond-grant"
SESSION_ID_HEADER: Final = "X-Session-Id"
LAST_EVENT_ID_HEADER: Final = "Last-Event-ID"
RETRY_AFTER_HEADER: Final = "Retry-After"
# What a retryable refusal says in Retry-After, in seconds.
RETRY_AFTER_S: Final = 1

# Refusal statuses (see the table above).
RETRY_LATER: Final = 503
MISDIRECTED: Final = 421
GRANT_REFUSED: Final = 401
NOT_PERMITTED: Final = 403
MALFORMED: Final = 400
UNKNOWN_EVENT_ID: Final = 409


def retry_after_headers() -> dict[str, str]:
    """The header a ``RETRY_LATER`` refusal carries, as a fresh dict a caller may add to."""
    return {RETRY_AFTER_HEADER: str(RETRY_AFTER_S)}
