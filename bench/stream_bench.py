"""Streaming at scale, measured on real processes in one run:

- **streaming sessions per replica core** at 100 tokens a second (turns of 200 tokens, 100 ms to
  the first): N WebSocket clients straight to one replica, each prompting again as soon as its
  turn ends; the replica's CPU (read from /proc, the replica alone) over a window of the steady
  state. ``sessions_per_core`` is the sessions streaming at a time (N times the share of the
  window they spent inside a turn) over the cores the replica used. Once with the in-process
  declared-latency model (``--model stub:...``) and once through the OpenAI-compatible client
  against the project's model server process, each with coalescing off (``--coalesce-ms 0``:
  a frame per token) and at its default;
- **frames per turn** and replica **CPU per token**, the same runs;
- **the delay coalescing adds** between the model server sending a token and a client receiving
  it, p50 and p99: the model server stamps each token with the machine's monotonic clock
  (``--stamp``), the client reads the clock as each frame arrives; with coalescing off and at
  the default, and the difference;
- **the edge's CPU per relayed frame and per streamed token**, with one worker and with two
  (``fleet-edge serve --workers``), the same stub workload going through it, and how the
  client connections spread across the workers (``edge_connections_accepted_total``); the
  edge's CPU also split into its own code's (``edge_user_*``: Python, the event loop) and the
  kernel's on its behalf (``edge_system_*``: TCP on loopback, wake-ups), which a relay written
  in any language pays alike.

    python -m bench.stream_bench [--quick] [--json FILE]

Targets (issue: streaming at scale): at least 1,000 streaming sessions per replica core with the
stub and 500 through the OpenAI-compatible client; at most 50 ms added at p99 with the default
window; the edge's CPU per streamed token at most a fifth of the replica's. On a 2-core box the
replica, the model server, the edge and the clients share two cores, so N is kept well below
what saturates them, and two edge workers cannot show per-core scaling: that is derived.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx
import websockets
from prometheus_client.parser import text_string_to_metric_families

from bench.edge_bench import target_row
from bench.replica_bench import cpu_split, raise_fd_limit
from fleet_sim.local import Fleet, Replica
from fleet_sim.ports import free_port

TTFT_MS: Final = 100
PER_TOKEN_MS: Final = 10
TURN_TOKENS: Final = 200
STUB: Final = f"stub:ttft={TTFT_MS}ms,per_token={PER_TOKEN_MS}ms,tokens={TURN_TOKENS}"
COALESCE_FLAG: Final = "--coalesce-ms"
DEFAULT_WINDOW_MS: Final = None  # the replica's own default
TARGET_STUB_SESSIONS_PER_CORE: Final = 1000
TARGET_OPENAI_SESSIONS_PER_CORE: Final = 500
TARGET_ADDED_P99_MS: Final = 50.0
TARGET_EDGE_OVER_REPLICA: Final = 0.2
SHARD: Final = "a07-s1"
# Meters named with these suffixes measure a part of a process's CPU (see _cpu_meter). On
# loopback the system part includes the receiving side's TCP processing and wake-up, which a
# network moves to the other host.
CPU_PARTS: Final = ("_user", "_system")


@dataclass(frozen=True, slots=True)
class Sizes:
    sessions: int  # streaming clients in a capacity run
    seconds: float  # the measured window
    warmup_s: float  # before it: every client has started a turn
    delay_sessions: int
    delay_seconds: float

    @classmethod
    def of(cls, quick: bool) -> Sizes:
        if quick:
            return cls(16, 5.0, 2.5, 8, 4.0)
        return cls(80, 20.0, 4.0, 40, 15.0)


@dataclass(slots=True)
class Tally:
    """What one client saw inside the measured window."""

    frames: int = 0
    words: int = 0
    turns: int = 0
    streaming_s: float = 0.0
    delays_ms: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Window:
    start: float  # time.monotonic()
    end: float


async def _client(
    url: str, grant: str, window: Window, tally: Tally, stamped: bool, tag: int
) -> None:
    """One session prompting back to back until the window ends."""
    async with websockets.connect(
        url, additional_headers={"x-beyond-grant": grant}, max_size=None, ping_interval=None
    ) as ws:
        await ws.recv()  # catch-up
        n = 0
        while time.monotonic() < window.end:
            began = time.monotonic()
            await ws.send(json.dumps({"type": "prompt", "message": f"stream {tag}.{n}"}))
            n += 1
            while True:
                raw = await ws.recv()
                now = time.monotonic()
                now_ns = time.monotonic_ns()
                frame = json.loads(raw)
                if frame.get("type") != "event":
                    continue
                event = frame["event"]
                kind = event.get("kind")
                if kind == "text_delta":
                    if window.start <= now < window.end:
                        words = event["text"].split()
                        tally.frames += 1
                        tally.words += len(words)
                        if stamped:
                            tally.delays_ms.extend((now_ns - int(w)) / 1e6 for w in words)
                elif kind == "turn_ended":
                    break
            ended = time.monotonic()
            inside = min(ended, window.end) - max(began, window.start)
            if inside > 0:
                tally.streaming_s += inside
                tally.turns += 1


def _grants(fleet: Fleet, count: int) -> list[tuple[str, str]]:
    sids = [f"{SHARD}.st{secrets.token_hex(6)}" for _ in range(count)]
    return [(sid, fleet.grant("bench", sid, sandbox=False)) for sid in sids]


def _cpu_meter(pid: int, *, children: bool = False, part: str = "") -> Callable[[], float]:
    """CPU seconds used so far by ``pid`` (and, with ``children``, by the processes it
    started: an edge's workers); ``part`` ``"user"`` or ``"system"``: that part alone."""

    def used() -> float:
        total = 0.0
        for each in [pid, *_children(pid)] if children else [pid]:
            try:
                user, system = cpu_split(each)
            except OSError:
                continue  # gone meanwhile
            total += user if part == "user" else system if part == "system" else user + system
        return total

    return used


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


async def _streaming_run(
    base_url: str,
    grants: list[tuple[str, str]],
    sizes_seconds: float,
    warmup_s: float,
    meters: dict[str, Callable[[], float]],
    stamped: bool = False,
) -> dict[str, Any]:
    """Every session streams until the window ends; CPU of each meter over the window."""
    start = time.monotonic() + warmup_s
    window = Window(start, start + sizes_seconds)
    tallies = [Tally() for _ in grants]
    ws_base = base_url.replace("http", "ws", 1)
    tasks = [
        asyncio.ensure_future(
            _client(f"{ws_base}/_beyond/agent?session_id={sid}", grant, window, t, stamped, i)
        )
        for i, ((sid, grant), t) in enumerate(zip(grants, tallies, strict=True))
    ]
    await asyncio.sleep(max(0.0, window.start - time.monotonic()))
    before = {name: meter() for name, meter in meters.items()}
    await asyncio.sleep(max(0.0, window.end - time.monotonic()))
    used = {name: meter() - before[name] for name, meter in meters.items()}
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    seconds = window.end - window.start
    frames = sum(t.frames for t in tallies)
    words = sum(t.words for t in tallies)
    turns = sum(t.turns for t in tallies)
    streaming = sum(t.streaming_s for t in tallies) / seconds  # sessions streaming at a time
    out: dict[str, Any] = {
        "sessions": len(grants),
        "streaming_sessions": round(streaming, 2),
        "frames": frames,
        "tokens": words,
        "frames_per_turn": round(frames / (words / TURN_TOKENS), 1) if words else None,
        "turns": turns,
    }
    for name, cpu_s in used.items():
        if name.endswith(CPU_PARTS):  # a part of a process's CPU: per token and frame only
            out[f"{name}_us_per_token"] = round(cpu_s / words * 1e6, 1) if words else None
            out[f"{name}_us_per_frame"] = round(cpu_s / frames * 1e6, 1) if frames else None
            continue
        cores = cpu_s / seconds
        out[f"{name}_cores"] = round(cores, 3)
        out[f"{name}_us_per_token"] = round(cpu_s / words * 1e6, 1) if words else None
        out[f"{name}_us_per_frame"] = round(cpu_s / frames * 1e6, 1) if frames else None
        out[f"{name}_sessions_per_core"] = round(streaming / cores) if cores else None
    if stamped:
        delays = sorted(d for t in tallies for d in t.delays_ms)
        out["delay_p50_ms"] = round(_quantile(delays, 0.5), 2)
        out["delay_p99_ms"] = round(_quantile(delays, 0.99), 2)
        out["delay_samples"] = len(delays)
    return out


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * len(values)))]


def _coalesce(window_ms: float | None) -> tuple[str, ...]:
    return () if window_ms is None else (COALESCE_FLAG, f"{window_ms:g}")


def _replica(fleet: Fleet, root: Path, name: str, model: str, window_ms: float | None) -> Replica:
    shards = {SHARD: root / name / "shards" / SHARD}
    return fleet.replica(name, shards, "--model", model, *_coalesce(window_ms), metrics=False)


def capacity(fleet: Fleet, root: Path, sizes: Sizes) -> dict[str, Any]:
    """Sessions per replica core, stub and OpenAI-compatible, coalescing off and default."""
    out: dict[str, Any] = {}
    server = fleet.model_server(
        "--ttft-ms", str(TTFT_MS), "--per-token-ms", str(PER_TOKEN_MS), "--tokens", str(TURN_TOKENS)
    )
    models = {"stub": STUB, "openai": f"openai:{server.url}"}
    for label, model in models.items():
        for window_name, window_ms in (("frame_per_token", 0.0), ("coalesced", DEFAULT_WINDOW_MS)):
            name = f"{label}-{window_name}"
            spec = model
            if label == "stub" and window_ms == 0.0:
                spec = f"{STUB},tick=0ms"  # and a timer per token: the stub as it was
            replica = _replica(fleet, root, name, spec, window_ms)
            pid = replica.proc.proc.pid
            grants = _grants(fleet, sizes.sessions)
            result = asyncio.run(
                _streaming_run(
                    replica.url,
                    grants,
                    sizes.seconds,
                    sizes.warmup_s,
                    {
                        "replica": _cpu_meter(pid),
                        "replica_user": _cpu_meter(pid, part="user"),
                        "replica_system": _cpu_meter(pid, part="system"),
                    },
                )
            )
            fleet.retire(replica.proc)
            _show(name, result)
            for key, value in result.items():
                out[f"{name}_{key}"] = value
    fleet.retire(server.proc)
    return out


def delay(fleet: Fleet, root: Path, sizes: Sizes) -> dict[str, Any]:
    """The delay from the model server sending a token to a client receiving it."""
    out: dict[str, Any] = {}
    server = fleet.model_server(
        "--ttft-ms", str(TTFT_MS), "--per-token-ms", str(PER_TOKEN_MS),
        "--tokens", str(TURN_TOKENS), "--stamp",
    )  # fmt: skip
    for window_name, window_ms in (("frame_per_token", 0.0), ("coalesced", DEFAULT_WINDOW_MS)):
        name = f"delay-{window_name}"
        replica = _replica(fleet, root, name, f"openai:{server.url}", window_ms)
        result = asyncio.run(
            _streaming_run(
                replica.url,
                _grants(fleet, sizes.delay_sessions),
                sizes.delay_seconds,
                sizes.warmup_s,
                {},
                stamped=True,
            )
        )
        fleet.retire(replica.proc)
        _show(name, result)
        for key in ("delay_p50_ms", "delay_p99_ms", "delay_samples", "frames_per_turn"):
            out[f"{window_name}_{key}"] = result[key]
    fleet.retire(server.proc)
    for q in ("p50", "p99"):
        out[f"coalescing_adds_{q}_ms"] = round(
            out[f"coalesced_delay_{q}_ms"] - out[f"frame_per_token_delay_{q}_ms"], 2
        )
    return out


def _edge_config(root: Path, replica: Replica) -> Path:
    config = root / "stream-edge.toml"
    config.write_text(
        f'[[slice]]\nname = "a07"\nreplicas = [{{ name = "r1", url = "{replica.url}" }}]\n'
    )
    return config


def _worker_spread(metrics_url: str) -> dict[str, float]:
    text = httpx.get(metrics_url, timeout=10).text
    spread: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "edge_connections_accepted_total":
                spread[sample.labels.get("worker", "0")] = sample.value
    return spread


def through_the_edge(fleet: Fleet, root: Path, sizes: Sizes) -> dict[str, Any]:
    """The stub workload, coalesced, through an edge of one and of two workers: the edge's CPU
    (the parent and its workers) per frame and per token, against the replica's."""
    out: dict[str, Any] = {}
    replica = _replica(fleet, root, "edge-backend", STUB, DEFAULT_WINDOW_MS)
    replica_pid = replica.proc.proc.pid
    config = _edge_config(root, replica)
    for workers in (1, 2):
        metrics = f"127.0.0.1:{free_port()}"
        edge = fleet.edge(
            config, "--workers", str(workers), metrics=metrics, name=f"edge-w{workers}"
        )
        edge_pid = edge.proc.proc.pid
        meters = {
            "edge": _cpu_meter(edge_pid, children=True),
            "edge_user": _cpu_meter(edge_pid, children=True, part="user"),
            "edge_system": _cpu_meter(edge_pid, children=True, part="system"),
            "replica": _cpu_meter(replica_pid),
            "replica_user": _cpu_meter(replica_pid, part="user"),
        }
        result = asyncio.run(
            _streaming_run(
                edge.url, _grants(fleet, sizes.sessions), sizes.seconds, sizes.warmup_s, meters
            )
        )
        spread = _worker_spread(f"http://{metrics}/metrics")
        edge.proc.signal(signal.SIGTERM)  # drained, so its workers go with it
        edge.proc.wait(30)
        fleet.retire(edge.proc)
        name = f"edge_{workers}w"
        _show(name, result)
        for key, value in result.items():
            out[f"{name}_{key}"] = value
        out[f"{name}_connections_per_worker"] = spread
        replica_us = result["replica_us_per_token"]
        edge_us = result["edge_us_per_token"]
        out[f"{name}_edge_over_replica_cpu_per_token"] = (
            round(edge_us / replica_us, 3) if edge_us and replica_us else None
        )
        # The same in user time alone: each process's own code, without the kernel's TCP work
        # (on loopback that includes the receiving side's, which a network moves elsewhere).
        replica_user = result["replica_user_us_per_token"]
        edge_user = result["edge_user_us_per_token"]
        out[f"{name}_edge_over_replica_user_cpu_per_token"] = (
            round(edge_user / replica_user, 3) if edge_user and replica_user else None
        )
    fleet.retire(replica.proc)
    return out


def _show(name: str, result: dict[str, Any]) -> None:
    keys = [k for k in result if k.endswith(("_sessions_per_core", "_us_per_token", "_ms"))]
    shown = ", ".join(f"{k}={result[k]}" for k in ["frames_per_turn", *keys])
    print(f"  {name}: {shown}", file=sys.stderr, flush=True)


def derive(f: dict[str, Any]) -> None:
    """Sizing figures from the measured ones (see FLEET.md)."""
    for label in ("stub", "openai"):
        per_core = f.get(f"{label}-coalesced_replica_sessions_per_core")
        if per_core:
            # A session streaming a share s of its time costs s of a streaming session.
            f[f"{label}_running_sessions_per_core_streaming_a_tenth"] = round(per_core / 0.1)
    edge_us = f.get("edge_1w_edge_us_per_token")
    replica_us = f.get("edge_1w_replica_us_per_token")
    if edge_us and replica_us:
        f["replica_cores_per_edge_worker"] = round(replica_us / edge_us, 1)


def targets(f: dict[str, Any]) -> list[dict[str, Any]]:
    def row(name: str, key: str, bound: float, at_most: bool) -> dict[str, Any]:
        return target_row(f, name, key, bound, at_most)

    return [
        row(
            "streaming sessions per replica core, stub",
            "stub-coalesced_replica_sessions_per_core",
            TARGET_STUB_SESSIONS_PER_CORE,
            False,
        ),
        row(
            "streaming sessions per replica core, OpenAI-compatible client",
            "openai-coalesced_replica_sessions_per_core",
            TARGET_OPENAI_SESSIONS_PER_CORE,
            False,
        ),
        row("delay added at p99 (ms)", "coalescing_adds_p99_ms", TARGET_ADDED_P99_MS, True),
        row(
            "edge CPU per token over the replica's",
            "edge_1w_edge_over_replica_cpu_per_token",
            TARGET_EDGE_OVER_REPLICA,
            True,
        ),
    ]


def run(quick: bool) -> dict[str, Any]:
    sizes = Sizes.of(quick)
    raise_fd_limit()
    figures: dict[str, Any] = {"quick": quick, "sizes": dataclasses.asdict(sizes)}
    with tempfile.TemporaryDirectory(prefix="stream-bench-") as tmp:
        root = Path(tmp)
        (root / "fleet").mkdir()
        fleet = Fleet(root / "fleet")
        try:
            print("capacity (replica alone):", file=sys.stderr, flush=True)
            figures.update(capacity(fleet, root, sizes))
            print("delay:", file=sys.stderr, flush=True)
            figures.update(delay(fleet, root, sizes))
            print("through the edge:", file=sys.stderr, flush=True)
            figures.update(through_the_edge(fleet, root, sizes))
        finally:
            fleet.close()
    derive(figures)
    figures["targets"] = targets(figures)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stream_bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small counts: every figure, fast")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the figures here")
    args = parser.parse_args(argv)
    figures = run(args.quick)
    for row in figures["targets"]:
        verdict = {True: "met", False: "NOT met", None: "n/a"}[row["met"]]
        print(f"{row['target']}: {row['measured']} (bound {row['bound']}) {verdict}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
