"""Session store figures: bytes on disk per turn, commit latency, CPU per commit, replay time.

A "typical turn" is a user message of about 100 characters, one tool call (the assistant's call
and the tool's result) and an assistant reply of about 600 characters, built from varied English
sentences so compression is neither flattered by repetition nor defeated by random bytes.

    python -m bench.store_bench [--turns 200] [--replays 30] [--dir PATH] [--json FILE]

``--dir`` picks the filesystem measured (default: a temporary directory); run it on an NFS or
leasefs mount to see what fsync costs there.
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
from replica.names import parse_session_id
from replica.sealing import RecordSealer
from replica.store import Committed, SessionStore
from replica.transcript import Message, new_message_id

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--dir", type=Path, help="directory to measure (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
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
