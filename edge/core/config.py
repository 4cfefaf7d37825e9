"""The edge's configuration: one TOML file, parsed once at start-up into frozen values.

::

    [edge]
    retry_budget_s = 120          # every option has a default; unknown keys are refused

    [[slice]]
    name = "a07"
    replicas = [
      { name = "r1", url = "http://127.0.0.1:9101" },
      { name = "r2", url = "http://127.0.0.1:9102" },
    ]

Unknown keys are errors rather than warnings: a misspelt ``retry_budget`` silently falling back
to a default is exactly the kind of mistake that only shows during an outage. Every message
names the offending key, so an operator can fix the file without reading this module.

Each slice builds its ring once, here, from replica names; routing a request is then a parse of
the session id, a dictionary lookup and a ring lookup. A replica name is any printable ASCII
without whitespace, 1-255 bytes, hashed as given: ``{ name = "10.0.4.17:9000", url = ... }`` is
a valid entry.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from edge.core.errors import ConfigError, MalformedSessionId, UnknownSlice
from edge.core.retry import CALLBACK_BUDGET_S, DEFAULT_BUDGET_S, RetryPolicy
from edge.core.ring import DEFAULT_VNODES, Ring
from wire.errors import InvalidName
from wire.names import SessionId, parse_replica_name, parse_session_id, parse_slice

MAX_VNODES = 4096


def parse_replica_name_at(value: object, where: str) -> str:
    """A replica's ring name, unchanged: printable ASCII without whitespace, 1-255 bytes;
    a :class:`ConfigError` naming ``where`` otherwise.

    The ring hashes the name's exact bytes, so ``10.0.4.17:9000`` is as good a name as ``r1``;
    the rule is the contract's, shared with the replica's ``--name``
    (``wire.names.parse_replica_name``)."""
    try:
        return parse_replica_name(value)
    except InvalidName as exc:
        raise ConfigError(f"{where}: {exc}") from None


def parse_replica_url(value: object, where: str) -> str:
    """``http(s)://host:port`` with an explicit port and nothing after it; returned normalised."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: url must be a string like http://127.0.0.1:9101")
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"{where}: url {value!r} is not valid: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"{where}: url {value!r} must start with http:// or https://")
    if not parts.hostname:
        raise ConfigError(f"{where}: url {value!r} has no host")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(f"{where}: url {value!r} must not carry credentials")
    if port is None or port == 0:
        raise ConfigError(f"{where}: url {value!r} must name a port (1-65535)")
    if parts.path not in ("", "/") or parts.query or parts.fragment or value.endswith(("?", "#")):
        raise ConfigError(f"{where}: url {value!r} must not have a path, query or fragment")
    host = parts.hostname
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}:{port}"


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    name: str
    url: str


@dataclass(frozen=True, slots=True)
class SliceConfig:
    """One slice's replica group and the ring built over their names."""

    name: str
    replicas: tuple[ReplicaConfig, ...]
    vnodes: int = DEFAULT_VNODES
    ring: Ring = field(init=False, repr=False, compare=False)
    _by_name: Mapping[str, ReplicaConfig] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = [r.name for r in self.replicas]
        object.__setattr__(self, "ring", Ring(tuple(names), self.vnodes))
        object.__setattr__(self, "_by_name", MappingProxyType({r.name: r for r in self.replicas}))

    def replica(self, name: str) -> ReplicaConfig:
        return self._by_name[name]

    def walk(self, session_id: str) -> tuple[ReplicaConfig, ...]:
        """The slice's replicas in the order a request for ``session_id`` tries them."""
        return tuple(self._by_name[n] for n in self.ring.walk(session_id))


@dataclass(frozen=True, slots=True)
class EdgeOptions:
    """The ``[edge]`` table. Times are seconds, sizes bytes, rates per second."""

    # Longer than a storage lease (about 90 s on NFSv4/EFS), or sessions whose owner died are
    # given up on just before a survivor could have taken them over.
    retry_budget_s: float = DEFAULT_BUDGET_S
    # E4 fixes 25 s as the most a callback may take; a lower value is allowed, a higher one not.
    callback_budget_s: float = CALLBACK_BUDGET_S
    same_target_attempts: int = 3
    retry_after_cap_s: float = 2.0
    retry_base_delay_s: float = 0.25
    retry_jitter: float = 0.1
    walk_step_delay_s: float = 0.0
    min_round_delay_s: float = 0.1
    walk_on_misdirected: bool = True
    # The reference ring uses 64; another value gives owners no other edge agrees on.
    vnodes: int = DEFAULT_VNODES
    connect_timeout_s: float = 5.0
    # Time for a replica to send response headers for a command; streams and WebSockets are
    # bounded only by this until they start, never while they run.
    upstream_header_timeout_s: float = 60.0
    max_request_body_bytes: int = 8 * 1024 * 1024
    max_header_bytes: int = 32 * 1024
    max_concurrent_requests: int = 10_000
    # E6 caps callbacks at 20 a second for one session id; the per-source limit stops one
    # sandbox host from flooding the fleet across many session ids.
    callback_rate_per_session: float = 20.0
    callback_rate_per_source: float = 200.0
    drain_grace_s: float = 30.0

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(
            budget_s=self.retry_budget_s,
            same_target_attempts=self.same_target_attempts,
            retry_after_cap_s=self.retry_after_cap_s,
            base_delay_s=self.retry_base_delay_s,
            jitter_fraction=self.retry_jitter,
            walk_step_delay_s=self.walk_step_delay_s,
            min_round_delay_s=self.min_round_delay_s,
            walk_on_misdirected=self.walk_on_misdirected,
        )

    def callback_policy(self) -> RetryPolicy:
        return self.retry_policy().with_budget(self.callback_budget_s)


@dataclass(frozen=True, slots=True)
class EdgeConfig:
    options: EdgeOptions
    slices: tuple[SliceConfig, ...]
    _by_name: Mapping[str, SliceConfig] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", MappingProxyType({s.name: s for s in self.slices}))

    def slice_named(self, name: str) -> SliceConfig:
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownSlice(name) from None

    def route(self, session_id: str) -> tuple[SessionId, SliceConfig]:
        """Parse ``session_id`` and find its slice: the parsed id and the slice config."""
        try:
            sid = parse_session_id(session_id)
        except InvalidName as exc:
            raise MalformedSessionId(str(exc)) from None
        return sid, self.slice_named(sid.slice)

    def slice_for(self, session_id: str) -> SliceConfig:
        """The slice a session id names; MalformedSessionId (400) or UnknownSlice (404)."""
        return self.route(session_id)[1]


# (type, lower bound, lower bound inclusive, upper bound) per [edge] key; bool is its own type.
_Number = tuple[type, float, bool, float]
_OPTION_RULES: dict[str, _Number] = {
    "retry_budget_s": (float, 0.0, False, 3600.0),
    "callback_budget_s": (float, 0.0, False, CALLBACK_BUDGET_S),
    "same_target_attempts": (int, 1, True, 1000),
    "retry_after_cap_s": (float, 0.0, True, 60.0),
    "retry_base_delay_s": (float, 0.0, True, 60.0),
    "retry_jitter": (float, 0.0, True, 1.0),
    "walk_step_delay_s": (float, 0.0, True, 60.0),
    "min_round_delay_s": (float, 0.0, True, 60.0),
    "vnodes": (int, 1, True, MAX_VNODES),
    "connect_timeout_s": (float, 0.0, False, 600.0),
    "upstream_header_timeout_s": (float, 0.0, False, 3600.0),
    "max_request_body_bytes": (int, 1, True, 1 << 32),
    "max_header_bytes": (int, 1024, True, 1 << 20),
    "max_concurrent_requests": (int, 1, True, 1_000_000),
    "callback_rate_per_session": (float, 0.0, False, 20.0),
    "callback_rate_per_source": (float, 0.0, False, 1_000_000.0),
    "drain_grace_s": (float, 0.0, True, 3600.0),
}
_BOOL_OPTIONS = frozenset({"walk_on_misdirected"})


def _option(key: str, value: object) -> object:
    if key in _BOOL_OPTIONS:
        if not isinstance(value, bool):
            raise ConfigError(f"[edge] {key} must be true or false, got {value!r}")
        return value
    kind, low, low_inclusive, high = _OPTION_RULES[key]
    low_text = f">= {low:g}" if low_inclusive else f"> {low:g}"
    noun = "an integer" if kind is int else "a number"
    problem = ConfigError(f"[edge] {key} must be {noun} {low_text} and <= {high:g}, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise problem
    if kind is int and not isinstance(value, int):
        raise problem
    number = float(value)
    in_range = number >= low if low_inclusive else number > low
    if not math.isfinite(number) or not in_range or number > high:
        raise problem
    return value if kind is int else number


def _parse_options(table: object) -> EdgeOptions:
    if table is None:
        return EdgeOptions()
    if not isinstance(table, dict):
        raise ConfigError("[edge] must be a table")
    known = _OPTION_RULES.keys() | _BOOL_OPTIONS
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(
            f"[edge] has unknown key {unknown[0]!r}; known keys: {', '.join(sorted(known))}"
        )
    values: dict[str, Any] = {key: _option(key, value) for key, value in table.items()}
    return EdgeOptions(**values)


def _parse_replica(entry: object, where: str) -> ReplicaConfig:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be a table {{ name = ..., url = ... }}")
    unknown = sorted(set(entry) - {"name", "url"})
    if unknown:
        raise ConfigError(f"{where} has unknown key {unknown[0]!r} (expected name and url)")
    for key in ("name", "url"):
        if key not in entry:
            raise ConfigError(f"{where} is missing {key!r}")
    name = parse_replica_name_at(entry["name"], f"{where}.name")
    return ReplicaConfig(name, parse_replica_url(entry["url"], f"{where}.url"))


def _parse_slice(entry: object, index: int, vnodes: int) -> SliceConfig:
    where = f"[[slice]] #{index + 1}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be a table")
    unknown = sorted(set(entry) - {"name", "replicas"})
    if unknown:
        raise ConfigError(f"{where} has unknown key {unknown[0]!r} (expected name and replicas)")
    if "name" not in entry:
        raise ConfigError(f"{where} is missing 'name'")
    try:
        name = parse_slice(entry["name"])
    except InvalidName as exc:
        raise ConfigError(f"{where}.name: {exc}, got {entry['name']!r}") from None
    where = f"[[slice]] {name!r}"
    raw = entry.get("replicas")
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{where}.replicas must be a non-empty array of {{ name, url }} tables")
    replicas: list[ReplicaConfig] = []
    names: set[str] = set()
    urls: dict[str, str] = {}
    for i, item in enumerate(raw):
        replica = _parse_replica(item, f"{where}.replicas[{i}]")
        if replica.name in names:
            raise ConfigError(f"{where}.replicas[{i}].name: {replica.name!r} appears twice")
        if replica.url in urls:
            raise ConfigError(
                f"{where}.replicas[{i}].url: {replica.url} is already replica "
                f"{urls[replica.url]!r}'s address"
            )
        names.add(replica.name)
        urls[replica.url] = replica.name
        replicas.append(replica)
    return SliceConfig(name, tuple(replicas), vnodes)


def parse_config(data: Mapping[str, object]) -> EdgeConfig:
    """Build the config from an already-decoded TOML document."""
    unknown = sorted(set(data) - {"edge", "slice"})
    if unknown:
        raise ConfigError(f"unknown top-level key {unknown[0]!r} (expected [edge] and [[slice]])")
    options = _parse_options(data.get("edge"))
    raw = data.get("slice")
    if not isinstance(raw, list) or not raw:
        raise ConfigError("at least one [[slice]] with its replicas is required")
    slices: list[SliceConfig] = []
    seen: set[str] = set()
    for i, entry in enumerate(raw):
        parsed = _parse_slice(entry, i, options.vnodes)
        if parsed.name in seen:
            raise ConfigError(f"[[slice]] #{i + 1}.name: slice {parsed.name!r} appears twice")
        seen.add(parsed.name)
        slices.append(parsed)
    return EdgeConfig(options, tuple(slices))


def parse_config_text(text: str) -> EdgeConfig:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not valid TOML: {exc}") from None
    return parse_config(data)


def load_config(path: Path | str) -> EdgeConfig:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config {str(path)!r}: {exc}") from None
    try:
        return parse_config_text(text)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
