from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from replica.agent import TurnBudget
from replica.coalescing import DEFAULT_COALESCING, Coalescing
from replica.config import (
    SERVICE_IDLE_TIMEOUT_S,
    ServeConfig,
    build_config,
    parse_hostport,
    parse_origin,
)
from replica.errors import ConfigError
from replica.keyfiles import b64url_encode, write_key_file
from replica.model import MockSpec, StubSpec
from wire.names import Shard


def grant_key(kid: str) -> str:
    public = Ed25519PrivateKey.generate().public_key()
    return f"{kid}=" + b64url_encode(public.public_bytes(Encoding.Raw, PublicFormat.Raw))


@pytest.fixture
def flags(tmp_path: Path) -> dict[str, Any]:
    seal, notify = tmp_path / "seal.key", tmp_path / "notify.key"
    write_key_file(seal, secrets.token_bytes(32))
    write_key_file(notify, secrets.token_bytes(32))
    return {
        "service": True,
        "listen": "127.0.0.1:9101",
        "shards": [f"a07-s1={tmp_path}/s1", f"a07-s2={tmp_path}/s2"],
        "grant_keys": [grant_key("k1"), grant_key("k2")],
        "seal_key": seal,
        "notify_key": notify,
        "notify_origin": "http://10.0.0.5:8080",
        "lifecycle_url": "http://127.0.0.1:9000/events",
        "model": "stub:ttft=10ms,per_token=1ms,tokens=5",
        "max_live_sessions": 100,
        "session_idle_timeout": None,
        "drain_grace": 30.0,
        "metrics_listen": "127.0.0.1:9201",
        "name": "r1",
        "budget": TurnBudget(max_steps=4),
    }


def refused(flags: dict[str, Any], match: str, **change: Any) -> str:
    with pytest.raises(ConfigError, match=match) as info:
        build_config(**{**flags, **change})
    return str(info.value)


def test_a_good_config(flags: dict[str, Any], tmp_path: Path) -> None:
    config = build_config(**flags)
    assert isinstance(config, ServeConfig)
    assert config.listen == ("127.0.0.1", 9101)
    assert dict(config.shards) == {
        Shard("a07", "s1"): tmp_path / "s1",
        Shard("a07", "s2"): tmp_path / "s2",
    }
    assert sorted(config.grant_keys) == ["k1", "k2"]
    assert len(config.notify_key) == 32
    assert config.notify_origin == "http://10.0.0.5:8080"
    assert config.model == StubSpec(0.01, 0.001, 5)
    assert config.metrics_listen == ("127.0.0.1", 9201)
    assert config.session_idle_timeout_s == SERVICE_IDLE_TIMEOUT_S
    assert (config.drain_grace_s, config.max_live_sessions, config.name) == (30.0, 100, "r1")
    assert config.budget.max_steps == 4
    # Secrets stay out of the repr.
    shown = repr(config)
    assert config.notify_key.hex() not in shown and "seal_key" not in shown
    assert "notify_key" not in shown and "grant_keys" not in shown
    with pytest.raises(AttributeError):
        config.name = "r2"  # type: ignore[misc]
    minimal = build_config(
        **{**flags, "metrics_listen": None, "lifecycle_url": None, "model": "mock"}
    )
    assert minimal.metrics_listen is None and minimal.lifecycle_url is None
    assert minimal.model == MockSpec()
    assert build_config(**{**flags, "metrics_listen": "[::1]:9201"}).metrics_listen == ("::1", 9201)
    assert build_config(**{**flags, "metrics_listen": "localhost:1"}).metrics_listen
    assert build_config(
        **{**flags, "notify_origin": "https://edge.example:443/"}
    ).notify_origin == ("https://edge.example:443")


def test_shard_refusals(flags: dict[str, Any], tmp_path: Path) -> None:
    assert "absolute" in refused(flags, "--shard", shards=["a07-s1=relative/dir"])
    refused(flags, "given twice", shards=[f"a07-s1={tmp_path}/x", f"a07-s1={tmp_path}/y"])
    refused(flags, "--shard", shards=[f"{tmp_path}/x"])
    refused(flags, "--shard", shards=[f"s1={tmp_path}/x"])  # not slice-qualified
    refused(flags, "--shard", shards=[f"a07-s1.x={tmp_path}/x"])
    refused(flags, "at least one --shard", shards=[])


def test_key_refusals(flags: dict[str, Any], tmp_path: Path) -> None:
    refused(flags, "--grant-key k1 is given twice", grant_keys=[grant_key("k1"), grant_key("k1")])
    refused(flags, "at least one --grant-key", grant_keys=[])
    refused(flags, "--grant-key", grant_keys=["k1"])
    refused(flags, "--grant-key k1", grant_keys=["k1=notakey"])
    refused(flags, "--seal-key", seal_key=None)
    refused(flags, "--notify-key", notify_key=None)
    refused(flags, "does not exist", notify_key=tmp_path / "absent.key")
    short = tmp_path / "short.key"
    short.write_text(b64url_encode(b"x" * 16) + "\n")
    refused(flags, "notify key", notify_key=short)


def test_service_and_notify_origin(flags: dict[str, Any]) -> None:
    refused(flags, "--service", service=False)
    refused(flags, "--notify-origin", notify_origin=None)
    for bad in (
        "10.0.0.5:8080",
        "ftp://10.0.0.5",
        "http://",
        "http://10.0.0.5/callback",
        "http://10.0.0.5?x=1",
        "http://10.0.0.5#frag",
        "http://user@10.0.0.5",
        "not a url",
    ):
        refused(flags, "--notify-origin", notify_origin=bad)


@pytest.mark.parametrize(
    "origin",
    [
        pytest.param("http://[::1"),
        pytest.param("http://10.0.0.5:99999"),
        pytest.param("http://:secret@10.0.0.5"),
    ],
)
def test_origin_edge_cases_are_config_errors(origin: str) -> None:
    with pytest.raises(ConfigError, match="--notify-origin"):
        parse_origin(origin, "--notify-origin")


def test_bad_lifecycle_url_ipv6_is_a_config_error(flags: dict[str, Any]) -> None:
    refused(flags, "--lifecycle-url", lifecycle_url="http://[::1/events")


def test_metrics_listen_must_be_loopback(flags: dict[str, Any]) -> None:
    for bind in ("0.0.0.0:9201", "10.0.0.1:9201", "[::]:9201", "192.168.1.4:9201"):
        message = refused(flags, "--metrics-listen", metrics_listen=bind)
        assert "loopback" in message
    refused(flags, "not an IP address", metrics_listen="metrics.internal:9201")
    for bad in ("127.0.0.1", "127.0.0.1:", ":9201", "127.0.0.1:70000", "127.0.0.1:x"):
        refused(flags, "--metrics-listen must be HOST:PORT", metrics_listen=bad)


def test_numbers_model_listen_and_lifecycle(flags: dict[str, Any]) -> None:
    refused(flags, "--drain-grace", drain_grace=-1.0)
    assert build_config(**{**flags, "drain_grace": 0.0}).drain_grace_s == 0.0
    refused(flags, "--max-live-sessions", max_live_sessions=0)
    refused(flags, "--sse-keepalive", keepalive_s=0.0)
    refused(flags, "--stream-queue-frames", stream_queue_frames=0)
    tuned = build_config(**{**flags, "keepalive_s": 0.5, "stream_queue_frames": 8})
    assert (tuned.keepalive_s, tuned.stream_queue_frames) == (0.5, 8)
    refused(flags, "--session-idle-timeout", session_idle_timeout=0.0)
    assert build_config(**{**flags, "session_idle_timeout": 5.0}).session_idle_timeout_s == 5.0
    for model in ("gpt", "mock:x", "stub:ttft=fast", "stub:tokens=0", "openai:ftp://x"):
        refused(flags, "--model", model=model)
    refused(flags, "--listen", listen="9101")
    refused(flags, "--lifecycle-url", lifecycle_url="ftp://cp/events")
    refused(flags, "--lifecycle-url", lifecycle_url="/events")


def test_coalescing_flags(flags: dict[str, Any]) -> None:
    assert build_config(**flags).coalescing == DEFAULT_COALESCING
    off = build_config(**{**flags, "coalesce_ms": 0.0}).coalescing
    assert off == Coalescing(0.0, 4096) and not off.enabled
    tuned = build_config(**{**flags, "coalesce_ms": 12.5, "coalesce_max_chars": 64})
    assert tuned.coalescing == Coalescing(0.0125, 64)
    assert build_config(**{**flags, "coalesce_ms": 1000.0}).coalescing.window_s == 1.0
    for window in (-1.0, -0.0001, float("nan"), float("inf"), float("-inf"), 1000.5):
        message = refused(flags, "--coalesce-ms", coalesce_ms=window)
        assert "from 0 (off) to 1000" in message
    for chars in (0, -5, 65_537):
        refused(flags, "--coalesce-max-chars must be 1-65536", coalesce_max_chars=chars)
    assert build_config(**{**flags, "coalesce_max_chars": 1}).coalescing.max_chars == 1


def test_storage_probe_deadline_flag(flags: dict[str, Any]) -> None:
    assert build_config(**flags).probe_deadline_s == 1.0
    assert build_config(**{**flags, "probe_deadline": 30.0}).probe_deadline_s == 30.0
    for bad in (0.0, -1.0, float("nan"), float("inf"), 600.5):
        refused(flags, "--storage-probe-deadline must be", probe_deadline=bad)


def test_parse_hostport() -> None:
    assert parse_hostport("[::1]:80", "--listen") == ("::1", 80)
    assert parse_hostport("0.0.0.0:0", "--listen") == ("0.0.0.0", 0)
    with pytest.raises(ConfigError, match="--listen"):
        parse_hostport("host:65536", "--listen")
