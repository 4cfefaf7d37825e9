"""Replica figures, measured on a real ``fleet-replica serve`` process:

- turns per CPU-second of the replica with the mock model (CPU read from /proc for the replica
  process alone; the clients run in this process);
- resident memory per live idle session, at two session counts;
- SSE catch-up time for a 200-turn session: cold (the attach opens and replays it) and warm.

    python -m bench.replica_bench [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import secrets
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import websockets

from bench.store_bench import typical_turn
from fleet_sim.local import Fleet, Replica
from replica.store import SessionStore
from wire.names import parse_session_id

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    user, system = cpu_split(pid)
    return user + system


def cpu_seconds_fine(pid: int) -> float:
    """CPU seconds ``pid``'s threads have run, to the nanosecond (the scheduler's own count,
    ``/proc/<pid>/task/*/schedstat``): for runs too short for ``cpu_seconds``'s clock ticks."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e9


def cpu_split(pid: int) -> tuple[float, float]:
    """CPU seconds ``pid`` has used in user space and in the kernel on its behalf."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def raise_fd_limit() -> int:
    """Raise the soft descriptor limit to the hard one (children inherit it); returns it."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


async def _ws_turns(
    replica: Replica, grant: str, sid: str, turns: int, words: int | None = None
) -> None:
    url = replica.url.replace("http", "ws") + f"/_beyond/agent?session_id={sid}"
    async with websockets.connect(
        url, additional_headers={"x-beyond-grant": grant}, max_size=None
    ) as ws:
        await ws.recv()  # catchup
        for n in range(turns):
            prompt = f"turn {n}" + (f"\nwords: {words}" if words else "")
            await ws.send(json.dumps({"type": "prompt", "message": prompt}))
            while True:
                frame = json.loads(await ws.recv())
                if frame.get("type") == "event" and frame["event"]["kind"] == "turn_ended":
                    break


def turns_per_cpu_second(
    fleet: Fleet, replica: Replica, sessions: int, turns: int, words: int | None
) -> dict[str, float]:
    """WebSocket clients each run ``turns`` turns back to back; the mock answers instantly, with
    its short default reply or with ``words`` words (one streamed frame per word)."""
    sids = [f"a07-s1.tp{secrets.token_hex(4)}" for _ in range(sessions)]
    grants = {sid: fleet.grant("bench", sid, sandbox=False) for sid in sids}

    async def run() -> None:
        await asyncio.gather(*(_ws_turns(replica, grants[sid], sid, turns, words) for sid in sids))

    asyncio.run(_ws_turns(replica, grants[sids[0]], sids[0], 2))  # warm up imports and pools
    before, started = cpu_seconds(replica.proc.proc.pid), time.perf_counter()
    asyncio.run(run())
    cpu, wall = cpu_seconds(replica.proc.proc.pid) - before, time.perf_counter() - started
    total = sessions * turns
    tag = f"_{words}_words" if words else ""
    return {
        f"turns{tag}": total,
        f"turns_per_cpu_second{tag}": total / cpu,
        f"replica_cpu_ms_per_turn{tag}": cpu / total * 1e3,
        f"turns_wall_s{tag}": wall,
    }


async def _open_sessions(replica: Replica, fleet: Fleet, count: int, concurrency: int = 16) -> None:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for _ in range(count):
        queue.put_nowait(f"a07-s1.idle{secrets.token_hex(6)}")

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            sid = queue.get_nowait()
            grant = fleet.grant("bench", sid, sandbox=False)
            response = await client.post(
                f"/_beyond/agent?session_id={sid}",
                content=b'{"type":"get_state"}',
                headers={"x-beyond-grant": grant},
            )
            response.raise_for_status()

    async with httpx.AsyncClient(base_url=replica.url, timeout=30) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))


def memory_per_session(fleet: Fleet, root: Path, counts: list[int]) -> dict[str, float]:
    replica = fleet.replica(
        "mem",
        {"a07-s1": root / "mem"},
        "--session-idle-timeout",
        "3600",
        "--max-live-sessions",
        str(max(counts) + 100),
    )
    pid = replica.proc.proc.pid
    # Warm up code paths, pools and first allocations; the base is taken after these 50.
    asyncio.run(_open_sessions(replica, fleet, 50))
    base, opened, out = rss_bytes(pid), 0, {}
    for count in counts:
        asyncio.run(_open_sessions(replica, fleet, count - opened))
        opened = count
        time.sleep(3.0)  # idle sessions park their segment descriptors
        out[f"rss_per_idle_session_kib_at_{count}"] = (rss_bytes(pid) - base) / count / 1024
    out["rss_base_mib"] = base / 2**20
    out[f"fds_per_idle_session_at_{opened}"] = len(os.listdir(f"/proc/{pid}/fd")) / opened
    replica.proc.stop()
    return out


def sse_catchup(fleet: Fleet, root: Path, turns: int, repeats: int) -> dict[str, float]:
    shard = root / "sse"
    shard.mkdir(parents=True, exist_ok=True)
    sid = f"a07-s1.sse{secrets.token_hex(4)}"
    store = SessionStore(shard)
    owner = store.open("bench", parse_session_id(sid), fleet.dek("bench"))
    rng = random.Random(3)
    for _ in range(turns):
        owner.commit(typical_turn(rng))
    owner.release()
    replica = fleet.replica("sse", {"a07-s1": shard})
    grant = fleet.grant("bench", sid, sandbox=False)
    times = []
    with httpx.Client(base_url=replica.url, timeout=30) as client:
        for _ in range(repeats):
            started = time.perf_counter()
            with client.stream(
                "GET", f"/_beyond/agent/events?session_id={sid}", headers={"x-beyond-grant": grant}
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        assert len(json.loads(line[5:])["messages"]) == 4 * turns
                        break
            times.append(time.perf_counter() - started)
    replica.proc.stop()
    return {
        "sse_catchup_turns": turns,
        "sse_catchup_cold_ms": times[0] * 1e3,
        "sse_catchup_warm_p50_ms": statistics.median(times[1:]) * 1e3,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description="Replica benchmarks on a real process.")
    parser.add_argument("--quick", action="store_true", help="small counts: checks every figure")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    counts = [200, 1000] if args.quick else [1000, 10_000]
    limit = raise_fd_limit()
    if max(counts) + 1000 > limit:
        raise SystemExit(f"need about {max(counts) + 1000} descriptors, the limit is {limit}")
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        fleet = Fleet(Path(tmp))
        try:
            replica = fleet.replica("tp", {"a07-s1": Path(tmp) / "tp"})
            turns = 10 if args.quick else 100
            figures.update(turns_per_cpu_second(fleet, replica, 8, turns, None))
            figures.update(turns_per_cpu_second(fleet, replica, 8, turns, 100))
            replica.proc.stop()
            figures.update(memory_per_session(fleet, Path(tmp), counts))
            figures.update(sse_catchup(fleet, Path(tmp), 200, 5 if args.quick else 20))
        finally:
            fleet.close()
    for key, value in figures.items():
        print(f"{key:40} {value:12.3f}" if isinstance(value, float) else f"{key:40} {value:12}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
