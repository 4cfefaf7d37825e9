"""``fleet-replica serve`` configuration, parsed and checked once at start-up.

Every flag is validated before anything listens: a relative shard path, a shard named twice, a
grant key id given twice, ``--service`` without ``--notify-origin``, a routable
``--metrics-listen``, a ``--coalesce-ms`` that is not a number of milliseconds (negative, NaN,
above a second): each is refused with a message naming the flag, and a non-zero exit.
"""

from __future__ import annotations

import math
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from replica.agent import TurnBudget
from replica.coalescing import (
    DEFAULT_MAX_CHARS,
    DEFAULT_WINDOW_MS,
    MAX_CHARS_CAP,
    MAX_WINDOW_MS,
    Coalescing,
)
from replica.errors import ConfigError
from replica.keyfiles import parse_grant_key_arg, read_key_file, read_seal_key
from replica.metrics import require_loopback
from replica.model import ModelSpec, parse_model_spec
from replica.probes import DEADLINE_S as PROBE_DEADLINE_S
from replica.probes import MAX_DEADLINE_S as MAX_PROBE_DEADLINE_S
from wire.errors import InvalidName
from wire.names import Shard, parse_replica_name, parse_shard

SERVICE_IDLE_TIMEOUT_S = 60.0
DAEMON_IDLE_TIMEOUT_S = 3600.0


def parse_hostport(value: str, flag: str) -> tuple[str, int]:
    host, sep, port_text = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"{flag} must be HOST:PORT, got {value!r}")
    return host, int(port_text)


def parse_origin(value: str, flag: str) -> str:
    try:
        parts = urllib.parse.urlsplit(value)
        port = parts.port
    except ValueError:
        raise ConfigError(f"{flag} is not a valid URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{flag} must be an http(s) origin like http://10.0.0.5:8080")
    if parts.path not in ("", "/") or parts.query or parts.fragment or "@" in parts.netloc:
        raise ConfigError(f"{flag} must be an origin: scheme, host and port only")
    del port  # read only so an out-of-range port is refused above
    return f"{parts.scheme}://{parts.netloc}"


def parse_shard_args(values: Sequence[str]) -> dict[Shard, Path]:
    shards: dict[Shard, Path] = {}
    for value in values:
        name, sep, path_text = value.partition("=")
        if not sep:
            raise ConfigError(f"--shard must be NAME=/abs/path, got {value!r}")
        try:
            shard = parse_shard(name)
        except InvalidName as exc:
            raise ConfigError(f"--shard {name!r}: {exc}") from None
        path = Path(path_text)
        if not path.is_absolute():
            raise ConfigError(f"--shard {name}: path {path_text!r} must be absolute")
        if shard in shards:
            raise ConfigError(f"--shard {name} is given twice")
        shards[shard] = path
    if not shards:
        raise ConfigError("at least one --shard NAME=/abs/path is required")
    return shards


@dataclass(frozen=True, slots=True)
class ServeConfig:
    listen: tuple[str, int]
    shards: Mapping[Shard, Path]
    grant_keys: Mapping[str, Ed25519PublicKey] = field(repr=False)
    seal_key: X25519PrivateKey = field(repr=False)
    notify_key: bytes = field(repr=False)
    notify_origin: str
    lifecycle_url: str | None = None
    model: ModelSpec = field(default_factory=lambda: parse_model_spec("mock"))
    max_live_sessions: int = 20_000
    session_idle_timeout_s: float = SERVICE_IDLE_TIMEOUT_S
    drain_grace_s: float = 0.0
    metrics_listen: tuple[str, int] | None = None
    name: str = "replica"
    lock_wait_s: float = 0.25
    budget: TurnBudget = field(default_factory=TurnBudget)
    keepalive_s: float = 15.0
    stream_queue_frames: int = 2048
    coalescing: Coalescing = field(default_factory=Coalescing)
    probe_deadline_s: float = PROBE_DEADLINE_S
    audience: str = "beyond-fleet"
    issuer: str = "beyond-control-plane"


def _replica_name(value: str) -> str:
    try:
        return parse_replica_name(value)
    except InvalidName as exc:
        raise ConfigError(f"--name: {exc}") from None


def parse_coalescing(window_ms: float, max_chars: int) -> Coalescing:
    # NaN compares false with everything, so a plain range check would let it through.
    if not math.isfinite(window_ms) or not 0 <= window_ms <= MAX_WINDOW_MS:
        raise ConfigError(
            f"--coalesce-ms must be a number of milliseconds from 0 (off) to {MAX_WINDOW_MS:g}, "
            f"got {window_ms}"
        )
    if not 1 <= max_chars <= MAX_CHARS_CAP:
        raise ConfigError(f"--coalesce-max-chars must be 1-{MAX_CHARS_CAP}, got {max_chars}")
    return Coalescing(window_ms / 1000, max_chars)


def build_config(
    *,
    service: bool,
    listen: str,
    shards: Sequence[str],
    grant_keys: Sequence[str],
    seal_key: Path | None,
    notify_key: Path | None,
    notify_origin: str | None,
    lifecycle_url: str | None,
    model: str,
    max_live_sessions: int,
    session_idle_timeout: float | None,
    drain_grace: float,
    metrics_listen: str | None,
    name: str,
    budget: TurnBudget,
    keepalive_s: float = 15.0,
    stream_queue_frames: int = 2048,
    coalesce_ms: float = DEFAULT_WINDOW_MS,
    coalesce_max_chars: int = DEFAULT_MAX_CHARS,
    probe_deadline: float = PROBE_DEADLINE_S,
) -> ServeConfig:
    if not service:
        raise ConfigError("serve needs --service: the replica runs only as a fleet member")
    if notify_origin is None:
        raise ConfigError(
            "--service needs --notify-origin URL: the address sandboxes reach the fleet at, "
            "where job-end callbacks are sent (without it a reaped session's jobs end unheard)"
        )
    keys: dict[str, Ed25519PublicKey] = {}
    for arg in grant_keys:
        kid, key = parse_grant_key_arg(arg)
        if kid in keys:
            raise ConfigError(f"--grant-key {kid} is given twice")
        keys[kid] = key
    if not keys:
        raise ConfigError("at least one --grant-key KID=PUBKEY is required")
    if seal_key is None:
        raise ConfigError("--seal-key FILE is required (the fleet's X25519 key)")
    if notify_key is None:
        raise ConfigError("--notify-key FILE is required (the key of job-end notify tokens)")
    if max_live_sessions < 1:
        raise ConfigError("--max-live-sessions must be at least 1")
    idle = SERVICE_IDLE_TIMEOUT_S if session_idle_timeout is None else session_idle_timeout
    if idle <= 0:
        raise ConfigError("--session-idle-timeout must be positive")
    if keepalive_s <= 0:
        raise ConfigError("--sse-keepalive must be positive")
    if stream_queue_frames < 1:
        raise ConfigError("--stream-queue-frames must be at least 1")
    if drain_grace < 0:
        raise ConfigError("--drain-grace must not be negative")
    coalescing = parse_coalescing(coalesce_ms, coalesce_max_chars)
    if not math.isfinite(probe_deadline) or not 0 < probe_deadline <= MAX_PROBE_DEADLINE_S:
        raise ConfigError(
            f"--storage-probe-deadline must be a number of seconds above 0 and at most "
            f"{MAX_PROBE_DEADLINE_S:g}, got {probe_deadline}"
        )
    metrics = None
    if metrics_listen is not None:
        metrics = parse_hostport(metrics_listen, "--metrics-listen")
        require_loopback(metrics[0])
    if lifecycle_url is not None:
        try:
            parts = urllib.parse.urlsplit(lifecycle_url)
            _ = parts.port
        except ValueError:
            raise ConfigError("--lifecycle-url is not a valid URL") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError("--lifecycle-url must be an http(s) URL")
    return ServeConfig(
        listen=parse_hostport(listen, "--listen"),
        shards=parse_shard_args(shards),
        grant_keys=keys,
        seal_key=read_seal_key(seal_key),
        notify_key=read_key_file(notify_key, what="notify key"),
        notify_origin=parse_origin(notify_origin, "--notify-origin"),
        lifecycle_url=lifecycle_url,
        model=parse_model_spec(model),
        max_live_sessions=max_live_sessions,
        session_idle_timeout_s=idle,
        drain_grace_s=drain_grace,
        metrics_listen=metrics,
        name=_replica_name(name),
        budget=budget,
        keepalive_s=keepalive_s,
        stream_queue_frames=stream_queue_frames,
        coalescing=coalescing,
        probe_deadline_s=probe_deadline,
    )
