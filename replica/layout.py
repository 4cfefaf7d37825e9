"""Where a session lives on a shard: ``<shard_root>/<tenant>/sessions/<session_id>/``.

The names come from the contract's strict parser (:mod:`wire.names`), so nothing a client sends
can name a path outside the shard root; the checks here are a second line behind it.
"""

from __future__ import annotations

from pathlib import Path

from wire.errors import InvalidName
from wire.names import SessionId, parse_tenant


def tenant_dir(shard_root: Path, tenant: str) -> Path:
    """``<shard_root>/<tenant>/sessions``, for a tenant that has already been parsed."""
    return _inside(shard_root, shard_root / parse_tenant(tenant) / "sessions")


def session_dir(shard_root: Path, tenant: str, session: SessionId) -> Path:
    """``<shard_root>/<tenant>/sessions/<session_id>``; the root must be absolute."""
    if not shard_root.is_absolute():
        raise InvalidName("shard root must be an absolute path")
    return _inside(shard_root, tenant_dir(shard_root, tenant) / str(session))


def _inside(root: Path, path: Path) -> Path:
    # The parser already makes escape impossible; this is the belt to its braces.
    if root not in path.parents:
        raise InvalidName("name resolves outside the shard root")
    return path
