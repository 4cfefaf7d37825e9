"""``python -m fleet_sim.juicefs relay ...``: a host's relay process (see ``relay.py``)."""

from __future__ import annotations

import sys

from fleet_sim.juicefs import relay


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "relay":
        print("usage: python -m fleet_sim.juicefs relay --target HOST:PORT", file=sys.stderr)
        return 2
    return relay.main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
