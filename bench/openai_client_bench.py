"""Replica CPU per streamed token through the OpenAI-compatible client, alone.

The OpenAI-compatible, coalesced case of ``bench.stream_bench.capacity`` (the same sizes: the
model server with ``--ttft-ms 100 --per-token-ms 10 --tokens 200``, 80 WebSocket sessions
prompting back to back, a 20 s window after 4 s of warm-up, the replica's CPU read from /proc),
repeated ``--runs`` times with a fresh replica each time; with ``--stub``, each run is followed
by the same workload on the in-process stub model, so the client's own cost is the difference.
Prints each run's ``replica_us_per_token`` (and streaming sessions per replica core) and the
medians.

    python -m bench.openai_client_bench [--runs 3] [--stub] [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.replica_bench import raise_fd_limit
from bench.stream_bench import (
    DEFAULT_WINDOW_MS,
    PER_TOKEN_MS,
    STUB,
    TTFT_MS,
    TURN_TOKENS,
    Sizes,
    _cpu_meter,
    _grants,
    _replica,
    _streaming_run,
)
from fleet_sim.local import Fleet


def _one(fleet: Fleet, root: Path, sizes: Sizes, name: str, spec: str) -> dict[str, Any]:
    replica = _replica(fleet, root, name, spec, DEFAULT_WINDOW_MS)
    try:
        return asyncio.run(
            _streaming_run(
                replica.url,
                _grants(fleet, sizes.sessions),
                sizes.seconds,
                sizes.warmup_s,
                {"replica": _cpu_meter(replica.proc.proc.pid)},
            )
        )
    finally:
        fleet.retire(replica.proc)


def run(runs: int, stub: bool, quick: bool) -> dict[str, Any]:
    sizes = Sizes.of(quick)
    raise_fd_limit()
    per_run: dict[str, list[float]] = {"openai": [], "stub": []} if stub else {"openai": []}
    per_core: dict[str, list[float]] = {label: [] for label in per_run}
    with tempfile.TemporaryDirectory(prefix="openai-client-bench-") as tmp:
        root = Path(tmp)
        (root / "fleet").mkdir()
        fleet = Fleet(root / "fleet")
        try:
            server = fleet.model_server(
                "--ttft-ms", str(TTFT_MS), "--per-token-ms", str(PER_TOKEN_MS),
                "--tokens", str(TURN_TOKENS),
            )  # fmt: skip
            specs = {"openai": f"openai:{server.url}", "stub": STUB}
            for i in range(runs):
                for label in per_run:
                    result = _one(fleet, root, sizes, f"{label}-{i}", specs[label])
                    us = result["replica_us_per_token"]
                    print(
                        f"run {i + 1} {label}: replica_us_per_token={us} "
                        f"sessions_per_core={result['replica_sessions_per_core']} "
                        f"tokens={result['tokens']} cores={result['replica_cores']}",
                        file=sys.stderr,
                        flush=True,
                    )
                    per_run[label].append(us)
                    per_core[label].append(result["replica_sessions_per_core"])
        finally:
            fleet.close()
    out: dict[str, Any] = {"sizes": {"sessions": sizes.sessions, "seconds": sizes.seconds}}
    for label, values in per_run.items():
        out[f"{label}_replica_us_per_token"] = values
        out[f"{label}_replica_us_per_token_median"] = statistics.median(values)
        out[f"{label}_sessions_per_core_median"] = statistics.median(per_core[label])
    if stub:
        out["openai_over_stub_us_per_token_median"] = round(
            out["openai_replica_us_per_token_median"] - out["stub_replica_us_per_token_median"], 1
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.openai_client_bench", description=__doc__
    )
    parser.add_argument("--runs", type=int, default=3, help="runs (a fresh replica each)")
    parser.add_argument("--stub", action="store_true", help="the stub model after each run too")
    parser.add_argument("--quick", action="store_true", help="stream_bench's quick sizes")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the figures here")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    figures = run(args.runs, args.stub, args.quick)
    for key, value in figures.items():
        if key.endswith("_median"):
            print(f"{key}: {value}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
