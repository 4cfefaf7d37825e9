"""Grants the page server holds on behalf of browsers.

A browser never needs the grant itself: it gets an opaque client id in an ``HttpOnly`` cookie,
and the server keeps, per client, the grant of each session that browser opened or attached. The
store lives in memory only (a restart forgets everything, which is the safe direction), and is
bounded in clients and in sessions per client; the least recently used entry goes first.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass, field

MAX_CLIENTS = 64
MAX_SESSIONS_PER_CLIENT = 32


@dataclass(frozen=True, slots=True)
class Held:
    """One session a browser may use, with the grant that the server adds to its requests."""

    session_id: str
    grant: str = field(repr=False)
    tenant: str | None = None
    """Known when the session was minted here, so its grant can be refreshed when it expires."""


class GrantStore:
    def __init__(
        self, max_clients: int = MAX_CLIENTS, max_sessions: int = MAX_SESSIONS_PER_CLIENT
    ) -> None:
        if max_clients < 1 or max_sessions < 1:
            raise ValueError("the store must hold at least one client and one session")
        self.max_clients = max_clients
        self.max_sessions = max_sessions
        self._clients: OrderedDict[str, OrderedDict[str, Held]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._clients)

    def __contains__(self, client: object) -> bool:
        return client in self._clients

    @staticmethod
    def new_client_id() -> str:
        return secrets.token_urlsafe(32)

    def put(self, client: str, held: Held) -> None:
        sessions = self._clients.get(client)
        if sessions is None:
            sessions = self._clients[client] = OrderedDict()
            while len(self._clients) > self.max_clients:
                self._clients.popitem(last=False)
        self._clients.move_to_end(client)
        sessions[held.session_id] = held
        sessions.move_to_end(held.session_id)
        while len(sessions) > self.max_sessions:
            sessions.popitem(last=False)

    def get(self, client: str | None, session_id: str) -> Held | None:
        sessions = self._clients.get(client) if client else None
        held = sessions.get(session_id) if sessions is not None else None
        if held is not None and sessions is not None and client is not None:
            self._clients.move_to_end(client)
            sessions.move_to_end(session_id)
        return held

    def sessions(self, client: str | None) -> list[Held]:
        """The client's sessions, oldest first (the order the page lists them in)."""
        sessions = self._clients.get(client) if client else None
        return list(sessions.values()) if sessions is not None else []

    def forget(self, client: str | None, session_id: str) -> bool:
        sessions = self._clients.get(client) if client else None
        return sessions is not None and sessions.pop(session_id, None) is not None
