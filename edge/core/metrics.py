"""The edge's Prometheus metrics and their loopback-only listener.

Every label has a closed vocabulary declared here and every child exists from the start at
zero, so a dashboard never sees a series appear out of nowhere and no session, tenant, shard or
replica value can reach a label: the scrape re-checks each sample against the vocabulary and
refuses to serve (500, logged) if anything outside it slipped in.

The hot path never calls ``labels()``: children are resolved once into dictionaries keyed by
the enums the proxy already holds. The two figures every request touches (requests by kind and
outcome, placement latency) are kept as plain numbers and turned into samples at scrape time: a
client-library child's ``inc`` or ``observe`` costs several Python calls and a lock per request,
a dictionary update costs none.
"""

from __future__ import annotations

import enum
import ipaddress
import logging
from bisect import bisect_left
from collections.abc import Callable, Iterator

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from edge.core.classify import Kind
from edge.core.errors import ConfigError

log = logging.getLogger("edge.core.metrics")


class Outcome(enum.StrEnum):
    """How a request ended, from the edge's point of view."""

    DELIVERED = enum.auto()  # a replica's answer (any status) went to the client
    EXHAUSTED = enum.auto()  # the retry budget ran out: 503 from the edge
    MISROUTED = enum.auto()  # every replica of the slice answered 421: 502 from the edge
    REJECTED = enum.auto()  # refused by the edge itself (400/403/404/411/413)
    RATE_LIMITED = enum.auto()  # 429 from the edge
    TIMED_OUT = enum.auto()  # no answer in time: 503 (callbacks, E4) or 504
    UPSTREAM_ERROR = enum.auto()  # unusable or cut-off replica response: 502 or a closed stream
    CLIENT_GONE = enum.auto()  # the client left before it had an answer
    SHED = enum.auto()  # over the concurrency limit: 503 from the edge


class LimitScope(enum.StrEnum):
    SESSION = enum.auto()
    SOURCE = enum.auto()


STREAM_KINDS = (Kind.WEBSOCKET, Kind.SSE)
RELOAD_RESULTS = ("ok", "failed")
PLACEMENT_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    25.0,
    60.0,
    120.0,
)
VOCABULARY: dict[str, frozenset[str]] = {
    "kind": frozenset(k.value for k in Kind),
    "outcome": frozenset(o.value for o in Outcome),
    "scope": frozenset(s.value for s in LimitScope),
    "result": frozenset(RELOAD_RESULTS),
    # Added by the client library itself to histogram buckets.
    "le": frozenset(),
}


class Latency:
    """One kind's placement latency: bucket counts (the last is +Inf) and their sum."""

    __slots__ = ("buckets", "total")

    def __init__(self) -> None:
        self.buckets = [0] * (len(PLACEMENT_BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.buckets[bisect_left(PLACEMENT_BUCKETS, seconds)] += 1
        self.total += seconds


class _Tallies(Collector):
    """``edge_requests_total``, ``edge_placement_seconds`` and
    ``edge_connections_accepted_total`` from plain numbers."""

    def __init__(self) -> None:
        self.requests = {(k, o): 0 for k in Kind for o in Outcome}
        self.placement = {k: Latency() for k in Kind}
        self.connections: Callable[[], int] = lambda: 0

    def collect(self) -> Iterator[Metric]:
        accepted = CounterMetricFamily(
            "edge_connections_accepted", "Client connections the edge accepted."
        )
        accepted.add_metric((), self.connections())
        yield accepted
        requests = CounterMetricFamily(
            "edge_requests", "Requests by kind and how they ended.", labels=("kind", "outcome")
        )
        for (kind, outcome), count in self.requests.items():
            requests.add_metric((kind.value, outcome.value), count)
        yield requests
        placement = HistogramMetricFamily(
            "edge_placement_seconds",
            "From a request's arrival to the answer the edge delivers from a replica.",
            labels=("kind",),
        )
        bounds = [str(float(b)) for b in PLACEMENT_BUCKETS] + ["+Inf"]
        for kind, latency in self.placement.items():
            cumulative, running = [], 0
            for bound, count in zip(bounds, latency.buckets, strict=True):
                running += count
                cumulative.append((bound, float(running)))
            placement.add_metric((kind.value,), cumulative, latency.total)
        yield placement


class EdgeMetrics:
    """One registry per edge (tests run several edges in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._tallies = _Tallies()
        r.register(self._tallies)
        self._retries = Counter(
            "edge_retries",
            "Same-replica retries after a 503 or an unreachable replica, before any walk.",
            ("kind",),
            registry=r,
        )
        self._walk_steps = Counter(
            "edge_walk_steps",
            "Attempts made while walking the ring past the hashed replica.",
            ("kind",),
            registry=r,
        )
        self._exhausted = Counter(
            "edge_budget_exhaustions",
            "Requests whose retry budget ran out before any replica would serve them.",
            ("kind",),
            registry=r,
        )
        self._misdirected = Counter(
            "edge_misdirected",
            "421 answers: a replica does not mount the shard the edge sent it (should be zero).",
            ("kind",),
            registry=r,
        )
        self._unreachable = Counter(
            "edge_upstream_unreachable",
            "Attempts that found a replica refusing or dropping the connection before answering.",
            ("kind",),
            registry=r,
        )
        self._streams = Gauge(
            "edge_open_streams",
            "WebSocket sessions and SSE streams being relayed now.",
            ("kind",),
            registry=r,
        )
        self._rate_limited = Counter(
            "edge_callbacks_rate_limited",
            "Job-end callbacks answered 429, by the limit that refused them.",
            ("scope",),
            registry=r,
        )
        self._reloads = Counter(
            "edge_config_reloads", "SIGHUP config reloads by result.", ("result",), registry=r
        )
        self._in_flight = Gauge(
            "edge_requests_in_flight", "Requests being handled now.", registry=r
        )
        # Requests by (kind, outcome): add to them in place.
        self.requests = self._tallies.requests
        self.retries = {k: self._retries.labels(k.value) for k in Kind}
        self.walk_steps = {k: self._walk_steps.labels(k.value) for k in Kind}
        self.exhausted = {k: self._exhausted.labels(k.value) for k in Kind}
        self.misdirected = {k: self._misdirected.labels(k.value) for k in Kind}
        self.unreachable = {k: self._unreachable.labels(k.value) for k in Kind}
        self.placement = self._tallies.placement
        self.streams = {k: self._streams.labels(k.value) for k in STREAM_KINDS}
        self.rate_limited = {s: self._rate_limited.labels(s.value) for s in LimitScope}
        self.reloads = {name: self._reloads.labels(name) for name in RELOAD_RESULTS}
        self.in_flight = self._in_flight

    def count_connections(self, accepted: Callable[[], int]) -> None:
        """Read the client connections accepted so far from ``accepted`` at scrape time."""
        self._tallies.connections = accepted

    def label_values(self) -> set[tuple[str, str]]:
        """Every ``(label, value)`` pair currently exposed."""
        pairs: set[tuple[str, str]] = set()
        for family in self.registry.collect():
            for sample in family.samples:
                pairs.update(sample.labels.items())
        return pairs

    def check_vocabulary(self) -> list[str]:
        """Labels outside the closed vocabulary (empty when all is well)."""
        bad: list[str] = []
        for name, value in sorted(self.label_values()):
            allowed = VOCABULARY.get(name)
            if allowed is None or (name != "le" and value not in allowed):
                bad.append(f"{name}={value!r}")
        return bad

    def render(self) -> bytes:
        return generate_latest(self.registry)


def parse_listen(text: str, flag: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) into its parts; port 0 picks a free one."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ConfigError(f"{flag} must be HOST:PORT, got {text!r}")
    port = int(port_text)
    if port > 65535:
        raise ConfigError(f"{flag} port must be 0-65535, got {port}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


def require_loopback(host: str) -> None:
    """Refuse a metrics bind that anything but this host could reach."""
    if host == "localhost":
        return
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(
            f"--metrics-listen host {host!r} must be a loopback IP address such as 127.0.0.1"
        ) from None
    if not address.is_loopback:
        raise ConfigError(
            f"--metrics-listen {host} is routable; edge metrics are served on loopback only "
            "(use 127.0.0.1 and scrape from the same host)"
        )


async def start_metrics_server(
    metrics: EdgeMetrics, host: str, port: int, *, logger: logging.Logger | None = None
) -> web.AppRunner:
    """Serve ``GET /metrics`` on a loopback address; returns the started runner. ``logger``
    is what aiohttp logs request errors through (the edge passes its ``RequestErrors``)."""
    require_loopback(host)

    async def scrape(request: web.Request) -> web.Response:
        bad = metrics.check_vocabulary()
        if bad:
            log.error("refusing to serve metrics: labels outside the vocabulary: %s", bad)
            return web.Response(status=500, text="metrics carry an unexpected label value\n")
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", scrape)
    runner = web.AppRunner(
        app, access_log=None, logger=logger or logging.getLogger("aiohttp.server")
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
