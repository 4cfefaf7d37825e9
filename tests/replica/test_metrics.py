from __future__ import annotations

import threading

import pytest

from replica.errors import ConfigError
from replica.metrics import (
    CALLBACK_OUTCOMES,
    DROP_REASONS,
    REFUSAL_REASONS,
    STREAM_KINDS,
    TURN_OUTCOMES,
    VOCABULARY,
    ReplicaMetrics,
    require_loopback,
)

LABELLED = [
    ("agent_refusals_total", "reason", REFUSAL_REASONS),
    ("agent_turns_total", "outcome", TURN_OUTCOMES),
    ("agent_streams_open", "kind", STREAM_KINDS),
    ("agent_streams_lagged_total", "kind", STREAM_KINDS),
    ("agent_lifecycle_dropped_total", "reason", DROP_REASONS),
    ("agent_job_callbacks_total", "outcome", CALLBACK_OUTCOMES),
]
UNLABELLED = [
    "agent_sessions_live",
    "agent_runs_in_flight",
    "agent_sessions_superseded_total",
    "agent_sessions_reaped_total",
    "agent_text_deltas_total",
    "agent_text_frames_total",
    "agent_lock_wait_seconds_count",
    "agent_ready_probe_seconds_count",
    "agent_commit_seconds_count",
]


def test_every_child_exists_at_zero() -> None:
    metrics = ReplicaMetrics()
    get = metrics.registry.get_sample_value
    for name, label, values in LABELLED:
        for value in values:
            assert get(name, {label: value}) == 0.0, (name, value)
    for name in UNLABELLED:
        assert get(name) == 0.0, name
    assert get("agent_threads") == threading.active_count()
    text = metrics.render().decode()
    assert 'agent_refusals_total{reason="storage"} 0.0' in text
    assert 'agent_streams_open{kind="sse"} 0.0' in text


def test_counting_moves_only_the_named_child() -> None:
    metrics = ReplicaMetrics()
    metrics.refuse("capacity")
    metrics.refuse("capacity")
    metrics.turns.labels("aborted").inc()
    get = metrics.registry.get_sample_value
    assert get("agent_refusals_total", {"reason": "capacity"}) == 2.0
    assert get("agent_refusals_total", {"reason": "draining"}) == 0.0
    assert get("agent_turns_total", {"outcome": "aborted"}) == 1.0
    metrics.text_frame(5)
    metrics.text_frame(1)
    assert (get("agent_text_frames_total"), get("agent_text_deltas_total")) == (2.0, 6.0)
    assert metrics.stray_labels() == []


def test_stray_labels_catch_an_injected_value() -> None:
    metrics = ReplicaMetrics()
    assert metrics.stray_labels() == []
    metrics.refuse("tenant-acme")
    metrics.streams_open.labels("a07-s1.sess1").inc()
    stray = metrics.stray_labels()
    assert "agent_refusals_total{reason}" in stray
    assert "agent_streams_open{kind}" in stray
    # The report names the metric and label, never the value that slipped in.
    assert not any("acme" in s or "sess1" in s for s in stray)


def test_fresh_registries_are_independent() -> None:
    first, second = ReplicaMetrics(), ReplicaMetrics()
    first.refuse("auth")
    assert second.registry.get_sample_value("agent_refusals_total", {"reason": "auth"}) == 0.0


def test_vocabulary_is_closed_over_declared_values() -> None:
    assert set(VOCABULARY) == {"reason", "outcome", "kind"}
    assert set(REFUSAL_REASONS) <= VOCABULARY["reason"]
    assert set(DROP_REASONS) <= VOCABULARY["reason"]


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.53", "::1", "localhost"])
def test_loopback_binds_are_accepted(host: str) -> None:
    require_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.1", "::", "192.168.0.2", "fe80::1", "8.8.8.8"])
def test_routable_binds_are_refused(host: str) -> None:
    with pytest.raises(ConfigError, match="loopback"):
        require_loopback(host)


def test_names_are_refused() -> None:
    with pytest.raises(ConfigError, match="not an IP address"):
        require_loopback("metrics.internal")
