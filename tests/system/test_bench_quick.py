"""``bench.run_all --quick`` produces every figure of every benchmark, each a finite number.

Benchmarks measure; this checks only that each figure is there and numeric, never how fast
anything is (a timing assertion would fail on a busy machine and prove nothing).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.run_all import REPO, markdown

STORE = (
    "bytes_per_turn",
    "plaintext_json_bytes_per_turn",
    "commit_p50_ms",
    "commit_p99_ms",
    "cpu_per_commit_ms",
    "replay_p50_ms",
)
REPLICA = (
    "turns_per_cpu_second",
    "replica_cpu_ms_per_turn",
    "turns_per_cpu_second_100_words",
    "rss_per_idle_session_kib_at_1000",
    "fds_per_idle_session_at_1000",
    "sse_catchup_cold_ms",
    "sse_catchup_warm_p50_ms",
)
_PATHS = ("direct", "edge", "nginx", "pyrelay")
EDGE = (
    *(
        f"{prefix}_{path}_{stat}"
        for prefix in ("post_c1", "post_c8", "fast_c1", "fast_c8")
        for path in _PATHS
        for stat in ("p50_ms", "p99_ms", "rps")
    ),
    *(
        f"{prefix}_{path}_frames_per_s"
        for prefix in ("ws_replica", "sse", "ws_relay_burst", "ws_relay_echo")
        for path in ("direct", "edge")
    ),
    "ws_replica_edge_frames_per_cpu_s",
    "sse_edge_frames_per_cpu_s",
    "ws_relay_burst_edge_frames_per_cpu_s",
    "ws_relay_echo_edge_frames_per_cpu_s",
    "post_c1_edge_added_p50_ms",
    "post_c8_edge_over_nginx_rps",
    "post_c8_edge_over_direct_rps",
    "fast_c8_edge_over_nginx_rps",
    "edge_cpu_ms_per_request",
    "post_c8_nginx_cpu_ms_per_request",
    "post_c8_pyrelay_cpu_ms_per_request",
    "post_c8_edge_over_pyrelay_cpu",
    "post_c1_pyrelay_added_p50_ms",
    "replica_cpu_ms_per_turn",
    "edge_cpu_per_request_over_replica_cpu_per_turn",
    "post_c8_varied_edge_cpu_ms_per_request",
    "post_c1_interleaved_requests",
    *(f"post_c1_{path}_interleaved_p50_ms" for path in _PATHS),
    "fast_c1_edge_added_p50_ms",
    "post_c8_varied_over_post_c8_edge_cpu",
)
RING = ("hash_ns_per_lookup", "owner_ns_per_lookup", "walk_ns_per_lookup")
STREAM = (
    *(
        f"{model}-{window}_{figure}"
        for model in ("stub", "openai")
        for window in ("frame_per_token", "coalesced")
        for figure in ("replica_sessions_per_core", "replica_us_per_token", "frames_per_turn")
    ),
    *(
        f"{window}_delay_{q}_ms"
        for window in ("frame_per_token", "coalesced")
        for q in ("p50", "p99")
    ),
    "coalescing_adds_p50_ms",
    "coalescing_adds_p99_ms",
    *(
        f"edge_{n}w_{figure}"
        for n in (1, 2)
        for figure in (
            "edge_us_per_token",
            "edge_us_per_frame",
            "edge_user_us_per_frame",
            "edge_system_us_per_frame",
            "replica_us_per_token",
        )
    ),
    "edge_1w_edge_over_replica_cpu_per_token",
)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@pytest.mark.slow
@pytest.mark.timeout(560)
def test_quick_run_produces_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.run_all", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["mode"] == "quick"
    assert results["machine"]["nproc"] >= 1
    assert results["machine"]["python"] == sys.version.split()[0]
    assert results["machine"]["kernel"]
    benches = results["benches"]
    assert set(benches) == {"store", "replica", "edge", "ring_lookup", "stream", "takeover"}
    assert benches["takeover"]["status"] == "ok", benches["takeover"]
    (kill,) = benches["takeover"]["figures"]["takeover"]
    assert (kill["substrate"], kill["fault"], kill["passed"]) == ("local-dir", "kill", 1)
    assert _is_number(kill["median_s"]) and _is_number(kill["max_s"])
    expected = {
        "store": STORE,
        "replica": REPLICA,
        "edge": EDGE,
        "ring_lookup": RING,
        "stream": STREAM,
    }
    for name, keys in expected.items():
        assert benches[name]["status"] == "ok", benches[name]
        figures = benches[name]["figures"]
        bad = {k: figures.get(k, "missing") for k in keys if not _is_number(figures.get(k))}
        assert not bad, f"{name}: figures missing or not numeric: {bad}"
    edge = benches["edge"]["figures"]
    # The replica's CPU per turn is the replica bench's own figure, not measured again.
    assert (
        edge["replica_cpu_ms_per_turn"] == benches["replica"]["figures"]["replica_cpu_ms_per_turn"]
    )
    assert edge["post_client"] == "wrk"
    assert [row["figure"] for row in edge["targets"]] == [
        "post_c1_edge_added_p50_ms",
        "post_c8_edge_over_nginx_rps",
        "ws_relay_burst_edge_frames_per_cpu_s",
        "edge_cpu_per_request_over_replica_cpu_per_turn",
    ]
    assert all(_is_number(row["measured"]) for row in edge["targets"])
    stream = benches["stream"]["figures"]
    assert set(stream["edge_2w_connections_per_worker"]) == {"0", "1"}
    assert all(_is_number(row["measured"]) for row in stream["targets"])
    readable = out.with_suffix(".md").read_text()
    assert readable == markdown(results)
    assert "| `post_c8_edge_over_nginx_rps` |" in readable
