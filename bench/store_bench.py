"""Session store figures: bytes on disk per turn, commit latency, CPU per commit, replay time.

A "typical turn" is a user message of about 100 characters, one tool call (the assistant's call
and the tool's result) and an assistant reply of about 600 characters, built from varied English
sentences so compression is neither flattered by repetition nor defeated by random bytes.

    python -m bench.store_bench [--turns 200] [--replays 30] [--dir PATH] [--json FILE]
    python -m bench.store_bench --substrate local-dir --substrate leasefs --substrate juicefs

``--dir`` picks the filesystem measured (default: a temporary directory); run it on an NFS
mount to see what fsync costs there. ``--substrate`` (repeatable) measures the simulator's
storage substrates one after the other in the same run, each through a replica host's own mount
(leasefs: the NFSv4-like FUSE mount; juicefs: JuiceFS on a Redis this run starts), and prints
them side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from replica.history import read_history
from replica.sealing import RecordSealer
from replica.store import Committed, SessionStore
from replica.transcript import Message, new_message_id
from wire.names import parse_session_id

_SENTENCES = [
    "The failing test expects three tokens but the tokenizer returns two.",
    "I traced it to the loop bound in src/parser.py, which stops one character early.",
    "Changing the range to include the final index fixes the off-by-one.",
    "I also added a regression test covering a trailing operator.",
    "The build passes locally and the linter reports no new warnings.",
    "Next I will look at why the cache is invalidated on every request.",
    "The configuration loader reads the environment before the file, so overrides win.",
    "There is a race between the writer thread and the flush timer.",
    "Holding the lock while calling back into user code can deadlock.",
    "I moved the callback outside the critical section and kept the counter update inside.",
    "Run the integration suite again once the database container is up.",
    "The migration adds a nullable column first and backfills it in batches.",
    "Please review the error message; it now names the missing key.",
    "The benchmark shows the new path is about twice as fast for small inputs.",
]


def _text(rng: random.Random, target: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < target:
        words.append(rng.choice(_SENTENCES))
    return " ".join(words)[:target]


def typical_turn(rng: random.Random) -> list[Message]:
    now = time.time()
    call_id = "call_" + new_message_id()[1:]
    command = rng.choice(["pytest -x tests/test_parser.py", "git diff --stat", "ls -la src"])
    return [
        Message(new_message_id(), None, "user", _text(rng, 100), now),
        Message(
            new_message_id(),
            None,
            "assistant",
            "",
            now,
            {
                "tool_calls": [
                    {"id": call_id, "name": "bash", "arguments": json.dumps({"command": command})}
                ]
            },
        ),
        Message(
            new_message_id(),
            None,
            "tool",
            f"$ {command}\n" + _text(rng, 160) + "\nexit status 1",
            now,
            {"tool_call_id": call_id},
        ),
        Message(new_message_id(), None, "assistant", _text(rng, 600), now),
    ]


def run(turns: int, replays: int, directory: Path) -> dict[str, float]:
    rng = random.Random(7)
    dek = os.urandom(32)
    sid = parse_session_id("a07-s1.bench" + os.urandom(4).hex())
    store = SessionStore(directory)
    owner = store.open("bench", sid, dek)
    header_end = owner._size
    batches = [typical_turn(rng) for _ in range(turns)]
    walls: list[float] = []
    cpu_start = time.process_time()
    for batch in batches:
        started = time.perf_counter()
        outcome = owner.commit(batch)
        walls.append(time.perf_counter() - started)
        assert isinstance(outcome, Committed)
    cpu = time.process_time() - cpu_start
    size = owner._size
    owner.release()
    sealer = RecordSealer.for_session(dek, "bench", str(sid))
    session_dir = store.directory("bench", sid)
    replay: list[float] = []
    for _ in range(replays):
        started = time.perf_counter()
        history = read_history(session_dir, sealer)
        replay.append(time.perf_counter() - started)
        assert len(history.transcript) == 4 * turns
    plain = sum(len(json.dumps([m.to_wire() for m in b], separators=(",", ":"))) for b in batches)
    return {
        "turns": turns,
        "bytes_per_turn": (size - header_end) / turns,
        "plaintext_json_bytes_per_turn": plain / turns,
        "segment_header_bytes": header_end,
        "commit_p50_ms": statistics.median(walls) * 1e3,
        "commit_p99_ms": sorted(walls)[int(len(walls) * 0.99) - 1] * 1e3,
        "cpu_per_commit_ms": cpu / turns * 1e3,
        "replay_p50_ms": statistics.median(replay) * 1e3,
        "replay_max_ms": max(replay) * 1e3,
    }


SUBSTRATES = ("local-dir", "leasefs", "juicefs")


def on_substrate(name: str, turns: int, replays: int) -> dict[str, float]:
    """The figures through one replica host's mount of a fresh ``name`` substrate."""
    from fleet_sim.sim.scenario import make_substrate

    with tempfile.TemporaryDirectory() as tmp:
        substrate = make_substrate(name, Path(tmp))
        try:
            substrate.prepare(["bench"], ["a07-s1"])
            return run(turns, replays, substrate.shard_path("bench", "a07-s1"))
        finally:
            substrate.close()


def side_by_side(figures: dict[str, dict[str, float]]) -> str:
    names = list(figures)
    lines = [f"{'':32}" + "".join(f"{n:>14}" for n in names)]
    for key in figures[names[0]]:
        cells = "".join(f"{figures[n][key]:14.3f}" for n in names)
        lines.append(f"{key:32}{cells}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--dir", type=Path, help="directory to measure (default: a temp dir)")
    parser.add_argument(
        "--substrate",
        action="append",
        choices=SUBSTRATES,
        help="measure this simulator substrate (repeatable; side by side in one run)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    if args.substrate:
        if args.dir is not None:
            parser.error("--dir and --substrate measure different things: give one")
        each = {n: on_substrate(n, args.turns, args.replays) for n in dict.fromkeys(args.substrate)}
        print(side_by_side(each))
        if args.json:
            args.json.write_text(json.dumps({"substrates": each}, indent=2) + "\n")
        return 0
    if args.dir is not None:
        figures = run(args.turns, args.replays, args.dir.resolve())
    else:
        with tempfile.TemporaryDirectory() as tmp:
            figures = run(args.turns, args.replays, Path(tmp))
    for key, value in figures.items():
        print(f"{key:32} {value:10.3f}" if isinstance(value, float) else f"{key:32} {value:10}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
