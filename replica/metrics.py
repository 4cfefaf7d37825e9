"""The replica's Prometheus metrics, on a loopback-only listener.

The scrape describes every tenant on the replica, so it is served only on loopback, and no label
carries a tenant, session, shard or workspace value: every label has a closed vocabulary declared
here, every child is created at zero, and each scrape re-checks that nothing outside the
vocabulary slipped in (a scrape that finds one is refused with 500 and logged).
"""

from __future__ import annotations

import ipaddress
import logging
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from replica.errors import ConfigError

log = logging.getLogger("replica.metrics")

REFUSAL_REASONS = (
    "auth",
    "forbidden",
    "bad_request",
    "misdirected",
    "unavailable",
    "capacity",
    "draining",
    "exiting",
    "storage",
    "corrupt",
    "too_large",
    "length_required",
)
TURN_OUTCOMES = ("succeeded", "failed", "aborted")
STREAM_KINDS = ("ws", "sse")
DROP_REASONS = ("queue_full", "rejected", "undeliverable")
CALLBACK_OUTCOMES = ("reconciled", "handed_off", "refused", "unavailable", "bad_request")
VOCABULARY: dict[str, frozenset[str]] = {
    "reason": frozenset(REFUSAL_REASONS) | frozenset(DROP_REASONS),
    "outcome": frozenset(TURN_OUTCOMES) | frozenset(CALLBACK_OUTCOMES),
    "kind": frozenset(STREAM_KINDS),
}


def require_loopback(host: str) -> None:
    """Refuse a metrics bind that is reachable from anywhere but this host."""
    if host == "localhost":
        return
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(f"--metrics-listen host {host!r} is not an IP address") from None
    if not address.is_loopback:
        raise ConfigError(
            f"--metrics-listen {host} is routable; the scrape describes every tenant on this "
            "replica, so it is served on loopback only (use 127.0.0.1)"
        )


class ReplicaMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.refusals = Counter(
            "agent_refusals_total", "Requests refused, by reason", ["reason"], registry=r
        )
        for reason in REFUSAL_REASONS:
            self.refusals.labels(reason)
        self.lock_wait = Histogram(
            "agent_lock_wait_seconds",
            "Time to take (or give up on) a session lock",
            registry=r,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
        )
        self.sessions_live = Gauge(
            "agent_sessions_live", "Sessions open on this replica", registry=r
        )
        self.runs_in_flight = Gauge("agent_runs_in_flight", "Agent turns running", registry=r)
        self.threads = Gauge("agent_threads", "Threads in the replica process", registry=r)
        self.threads.set_function(threading.active_count)
        self.ready_probe = Histogram(
            "agent_ready_probe_seconds",
            "Duration of a shard readiness probe",
            registry=r,
            buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0),
        )
        self.superseded = Counter(
            "agent_sessions_superseded_total", "Owners that found they were fenced", registry=r
        )
        self.turns = Counter(
            "agent_turns_total", "Agent turns ended, by outcome", ["outcome"], registry=r
        )
        for outcome in TURN_OUTCOMES:
            self.turns.labels(outcome)
        self.commit_seconds = Histogram(
            "agent_commit_seconds",
            "Append, fsync and fence check of one batch",
            registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0),
        )
        self.streams_open = Gauge(
            "agent_streams_open", "Open WebSocket and SSE streams", ["kind"], registry=r
        )
        self.streams_lagged = Counter(
            "agent_streams_lagged_total", "Readers closed for falling behind", ["kind"], registry=r
        )
        for kind in STREAM_KINDS:
            self.streams_open.labels(kind)
            self.streams_lagged.labels(kind)
        self.text_deltas = Counter(
            "agent_text_deltas_total", "Text deltas streamed by the model", registry=r
        )
        self.text_frames = Counter(
            "agent_text_frames_total",
            "text_delta frames published to a session's readers; each holds one or more deltas",
            registry=r,
        )
        self.reaped = Counter("agent_sessions_reaped_total", "Idle sessions closed", registry=r)
        self.lifecycle_dropped = Counter(
            "agent_lifecycle_dropped_total",
            "Lifecycle events not delivered",
            ["reason"],
            registry=r,
        )
        for reason in DROP_REASONS:
            self.lifecycle_dropped.labels(reason)
        self.callbacks = Counter(
            "agent_job_callbacks_total", "Job-end callbacks, by outcome", ["outcome"], registry=r
        )
        for outcome in CALLBACK_OUTCOMES:
            self.callbacks.labels(outcome)

    def refuse(self, reason: str) -> None:
        self.refusals.labels(reason).inc()

    def text_frame(self, deltas: int) -> None:
        """One coalesced frame published, holding ``deltas`` of the model's deltas."""
        self.text_frames.inc()
        self.text_deltas.inc(deltas)

    def stray_labels(self) -> list[str]:
        """Label values outside the closed vocabulary; must always be empty."""
        stray = []
        for family in self.registry.collect():
            for sample in family.samples:
                for name, value in sample.labels.items():
                    if name == "le" or name == "quantile":
                        continue
                    if value not in VOCABULARY.get(name, frozenset()):
                        stray.append(f"{sample.name}{{{name}}}")
        return stray

    def render(self) -> bytes:
        return generate_latest(self.registry)
