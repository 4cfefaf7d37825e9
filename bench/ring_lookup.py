"""Time ring lookups: nanoseconds per ``Ring.owner`` and ``Ring.walk`` over random session ids.

    python bench/ring_lookup.py [--ids 100000] [--replicas 3] [--vnodes 64] [--seed 1]

A sanity check that routing stays in microseconds, not a test: timings vary by machine, so
nothing here asserts a number.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable, Sequence

from edge.core.ring import Ring
from wire.ring_hash import ring_hash

MAX_IDS = 2_000_000
MAX_REPLICAS = 1000


def _bounded(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be within {low}-{high}")
        return value

    return parse


def _ns_per_call(fn: Callable[[str], object], ids: Sequence[str]) -> float:
    start = time.perf_counter_ns()
    for sid in ids:
        fn(sid)
    return (time.perf_counter_ns() - start) / len(ids)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ids", type=_bounded(1, MAX_IDS), default=100_000)
    parser.add_argument("--replicas", type=_bounded(1, MAX_REPLICAS), default=3)
    parser.add_argument("--vnodes", type=_bounded(1, 4096), default=64)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    ids = [f"a07-s{rng.randrange(8)}.{rng.getrandbits(96):024x}" for _ in range(args.ids)]
    names = tuple(f"r{i + 1}" for i in range(args.replicas))

    start = time.perf_counter()
    ring = Ring(names, args.vnodes)
    build_ms = (time.perf_counter() - start) * 1000

    results = {
        "hash": _ns_per_call(lambda sid: ring_hash(sid.encode()), ids),
        "owner": _ns_per_call(ring.owner, ids),
        "walk": _ns_per_call(ring.walk, ids),
    }
    print(f"ring: {args.replicas} replicas x {args.vnodes} vnodes, built in {build_ms:.1f} ms")
    print(f"ids:  {args.ids} (python {sys.version.split()[0]})")
    for name, ns in results.items():
        print(f"{name:>6}: {ns:10.0f} ns per lookup")
    return 0


if __name__ == "__main__":
    sys.exit(main())
