"""A session's transcript: messages in a tree, rebuilt from committed batches.

Every message has an id and the id of its parent; a committed batch (one turn) hangs off the
session's leaf, and the newest committed message becomes the new leaf. The transcript keeps the
messages in commit order, which for the linear conversations an agent holds is the path from the
root to the leaf. ``since`` answers "what was committed after this message", which is how clients
resume (``get_messages`` with ``since``, SSE ``Last-Event-ID``).
"""

from __future__ import annotations

import base64
import random
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_ROLES = frozenset({"user", "assistant", "tool", "system", "event"})
_CORE_KEYS = frozenset({"id", "parent_id", "role", "content", "ts"})


# Ids need to be unique, not secret: a PRNG seeded once from the OS is as good and far cheaper
# than a getrandom() call per message.
_ids = random.Random(secrets.randbits(128))


def new_id(prefix: str) -> str:
    return prefix + base64.urlsafe_b64encode(_ids.getrandbits(72).to_bytes(9, "big")).decode()


def new_message_id() -> str:
    return new_id("m")


@dataclass(frozen=True, slots=True)
class Message:
    """One message. ``extra`` carries role-specific fields (tool calls, tool call id, job ids)."""

    id: str
    parent_id: str | None
    role: str
    content: str
    ts: float
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.extra)
        out.update(
            id=self.id, parent_id=self.parent_id, role=self.role, content=self.content, ts=self.ts
        )
        return out

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Message:
        get = data.get
        msg_id, parent, role, content, ts = (
            get("id"),
            get("parent_id"),
            get("role"),
            get("content"),
            get("ts"),
        )
        # Replay calls this for every stored message, so the checks are exact-type tests.
        if type(msg_id) is not str or not msg_id:
            raise ValueError("message id must be a non-empty string")
        if parent is not None and type(parent) is not str:
            raise ValueError("parent_id must be a string or null")
        if role not in _ROLES:
            raise ValueError("unknown message role")
        if type(content) is not str:
            raise ValueError("message content must be a string")
        if type(ts) is not float and type(ts) is not int:
            raise ValueError("message ts must be a number")
        extra = {k: v for k, v in data.items() if k not in _CORE_KEYS} if len(data) > 5 else {}
        return cls(msg_id, parent, role, content, float(ts), extra)


class UnknownMessage(LookupError):
    """``since`` named a message this transcript does not have."""


@dataclass(slots=True)
class Transcript:
    """The current conversation of a session, in commit order."""

    messages: list[Message] = field(default_factory=list)
    _index: dict[str, int] = field(default_factory=dict, repr=False)
    resets: int = 0
    # Background jobs whose end the model has been told of (kept across conversations, so an
    # end is told at most once per session), and jobs the model started in this session.
    told_jobs: set[str] = field(default_factory=set)
    started_jobs: set[str] = field(default_factory=set)

    @property
    def leaf_id(self) -> str | None:
        return self.messages[-1].id if self.messages else None

    def __len__(self) -> int:
        return len(self.messages)

    def apply_batch(self, batch: Iterable[Message]) -> None:
        for message in batch:
            self._index[message.id] = len(self.messages)
            self.messages.append(message)
            extra = message.extra
            if extra:
                job_end = extra.get("job_end")
                if isinstance(job_end, dict) and isinstance(job_end.get("job_id"), str):
                    self.told_jobs.add(job_end["job_id"])
                elif extra.get("background") is True and isinstance(extra.get("job_id"), str):
                    self.started_jobs.add(extra["job_id"])

    def reset(self, closed_jobs: Iterable[str] = ()) -> None:
        """A new conversation in the same session id: the old one was archived elsewhere, and
        the jobs it had were ended with it (their ends are not news to the new one)."""
        self.messages = []
        self._index = {}
        self.resets += 1
        self.told_jobs.update(closed_jobs)

    @property
    def untold_jobs(self) -> set[str]:
        return self.started_jobs - self.told_jobs

    def read_offsets(self) -> dict[str, int]:
        """How far the model has read each job's output, from the job_output results."""
        offsets: dict[str, int] = {}
        for message in self.messages:
            if message.role == "tool" and isinstance(message.extra.get("next_offset"), int):
                offsets[str(message.extra.get("job_id"))] = message.extra["next_offset"]
        return offsets

    def since(self, message_id: str | None) -> Sequence[Message]:
        if message_id is None:
            return list(self.messages)
        position = self._index.get(message_id)
        if position is None:
            raise UnknownMessage(message_id)
        return self.messages[position + 1 :]

    def __contains__(self, message_id: object) -> bool:
        return message_id in self._index

    def chain(self, batch: Sequence[Message]) -> list[Message]:
        """Hang a batch off the current leaf: each message's parent is the one before it."""
        parent = self.leaf_id
        out = []
        for message in batch:
            out.append(
                Message(
                    message.id, parent, message.role, message.content, message.ts, message.extra
                )
            )
            parent = message.id
        return out
