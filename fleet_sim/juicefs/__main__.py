"""``python -m fleet_sim.juicefs relay|warden ...``: the substrate's helper processes (a host's
relay, see ``relay.py``; the warden, see ``warden.py``)."""

from __future__ import annotations

import sys

from fleet_sim.juicefs import relay, warden

USAGE = "usage: python -m fleet_sim.juicefs relay --target HOST:PORT | warden"


def main(argv: list[str]) -> int:
    if argv[:1] == ["relay"]:
        return relay.main(argv[1:])
    if argv[:1] == ["warden"]:
        return warden.main(argv[1:])
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
