from __future__ import annotations

import aiohttp
import pytest

from edge.core.classify import Kind
from edge.core.errors import ConfigError
from edge.core.metrics import EdgeMetrics, Outcome, parse_listen, require_loopback
from edge.server import start_edge
from tests.edge.fakes import FAST, FakeReplica, edge_config, refuse


def test_every_child_exists_at_zero() -> None:
    metrics = EdgeMetrics()
    text = metrics.render().decode()
    for kind in Kind:
        for outcome in Outcome:
            line = f'edge_requests_total{{kind="{kind}",outcome="{outcome}"}} 0.0'
            assert line in text
    assert 'edge_open_streams{kind="websocket"} 0.0' in text
    assert 'edge_callbacks_rate_limited_total{scope="session"} 0.0' in text
    assert metrics.check_vocabulary() == []


def test_a_label_outside_the_vocabulary_is_caught() -> None:
    metrics = EdgeMetrics()
    metrics._retries.labels("a07-s1.leak").inc()
    assert metrics.check_vocabulary() == ["kind='a07-s1.leak'"]


def test_per_request_tallies_are_exposed_as_counters_and_histograms() -> None:
    metrics = EdgeMetrics()
    metrics.requests[(Kind.COMMAND, Outcome.DELIVERED)] += 3
    latency = metrics.placement[Kind.COMMAND]
    for seconds in (0.0004, 0.0005, 0.003, 500.0):
        latency.observe(seconds)
    text = metrics.render().decode()
    assert 'edge_requests_total{kind="command",outcome="delivered"} 3.0' in text
    assert 'edge_placement_seconds_bucket{kind="command",le="0.0005"} 2.0' in text  # le: <=
    assert 'edge_placement_seconds_bucket{kind="command",le="0.001"} 2.0' in text
    assert 'edge_placement_seconds_bucket{kind="command",le="0.005"} 3.0' in text
    assert 'edge_placement_seconds_bucket{kind="command",le="120.0"} 3.0' in text
    assert 'edge_placement_seconds_bucket{kind="command",le="+Inf"} 4.0' in text
    assert 'edge_placement_seconds_count{kind="command"} 4.0' in text
    assert 'edge_placement_seconds_sum{kind="command"} 500.0039' in text
    assert metrics.check_vocabulary() == []


@pytest.mark.parametrize("host", ["127.0.0.1", "127.9.9.9", "::1", "localhost"])
def test_loopback_hosts_are_accepted(host: str) -> None:
    require_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.1", "::", "example.com", "192.168.1.2"])
def test_routable_hosts_are_refused(host: str) -> None:
    with pytest.raises(ConfigError, match="loopback"):
        require_loopback(host)


def test_parse_listen() -> None:
    assert parse_listen("127.0.0.1:9100", "--x") == ("127.0.0.1", 9100)
    assert parse_listen("[::1]:0", "--x") == ("::1", 0)
    for bad in ("9100", "127.0.0.1", "127.0.0.1:http", "h:70000", ":80"):
        with pytest.raises(ConfigError, match="--x"):
            parse_listen(bad, "--x")


@pytest.mark.anyio
async def test_the_scrape_serves_no_session_or_shard_values() -> None:
    r1 = FakeReplica("r1", refuse(503, "busy"))
    await r1.start()
    edge = await start_edge(
        edge_config(
            [r1], retry_budget_s=0.1, **{k: v for k, v in FAST.items() if k != "retry_budget_s"}
        ),
        metrics_host="127.0.0.1",
    )
    try:
        async with aiohttp.ClientSession() as client:
            for sid in ("a07-s1.secret1", "a07-s2.secret2"):
                async with client.post(
                    f"{edge.url}/_beyond/agent?session_id={sid}&tenant=acme", data=b"{}"
                ) as r:
                    assert r.status == 503
            async with client.get(f"http://127.0.0.1:{edge.metrics_port}/metrics") as resp:
                assert resp.status == 200
                text = await resp.text()
    finally:
        await edge.drain(0.5)
        await r1.close()
    assert 'edge_requests_total{kind="command",outcome="exhausted"} 2.0' in text
    for value in ("secret", "a07", "acme", "r1", "127.0.0.1"):
        assert value not in text
    assert edge.metrics.check_vocabulary() == []
