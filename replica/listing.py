"""``list_sessions``: a bounded, recency-ordered picker over one tenant's sessions.

Not a catalog (that belongs to the control plane): it scans the tenant's session directories on
the shards this replica mounts, newest first by the time of their last segment write, opens each
with the tenant's key to read its title, preview and working directory, and stops as soon as it
has ``limit`` matches. The response is bounded; the scan of a tenant with very many sessions is
not, and cannot be without an index.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replica.errors import StoreError
from replica.history import read_history
from replica.layout import tenant_dir
from replica.sealing import RecordSealer
from wire.errors import InvalidName
from wire.names import parse_session_id

PREVIEW_CHARS = 120


@dataclass(frozen=True, slots=True)
class Candidate:
    session_id: str
    directory: Path
    updated: float


def candidates(shard_roots: Iterable[Path], tenant: str) -> list[Candidate]:
    found: list[Candidate] = []
    for root in shard_roots:
        base = tenant_dir(root, tenant)
        try:
            entries = list(os.scandir(base))
        except OSError:
            continue
        for entry in entries:
            try:
                parse_session_id(entry.name)
                updated = max(
                    (e.stat().st_mtime for e in os.scandir(entry.path) if e.name.endswith(".seg")),
                    default=None,
                )
            except (InvalidName, OSError):
                continue
            if updated is not None:
                found.append(Candidate(entry.name, Path(entry.path), updated))
    found.sort(key=lambda c: c.updated, reverse=True)
    return found


def describe(candidate: Candidate, tenant: str, dek: bytes) -> dict[str, Any] | None:
    try:
        sealer = RecordSealer.for_session(dek, tenant, candidate.session_id)
        transcript = read_history(candidate.directory, sealer).transcript
    except StoreError:
        return None
    messages = transcript.messages
    title = next((str(m.extra["title"]) for m in messages if "title" in m.extra), "")
    cwd = next((str(m.extra["cwd"]) for m in messages if "cwd" in m.extra), "")
    last_text = next((m.content for m in reversed(messages) if m.content), "")
    return {
        "session_id": candidate.session_id,
        "title": title,
        "preview": last_text[:PREVIEW_CHARS],
        "cwd": cwd,
        "updated": candidate.updated,
        "messages": len(messages),
    }


def list_sessions(
    shard_roots: Iterable[Path], tenant: str, dek: bytes, query: str, limit: int
) -> list[dict[str, Any]]:
    needle = query.casefold()
    out: list[dict[str, Any]] = []
    for candidate in candidates(shard_roots, tenant):
        if len(out) >= limit:
            break
        entry = describe(candidate, tenant, dek)
        if entry is None:
            continue
        haystack = " ".join(str(entry[k]) for k in ("title", "session_id", "preview", "cwd"))
        if needle in haystack.casefold():
            out.append(entry)
    return out
