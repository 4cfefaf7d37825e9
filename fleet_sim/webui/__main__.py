"""``python -m fleet_sim.webui --edge URL [--control-plane URL] [--state FILE] [--listen ...]``

Serves the page and prints one JSON line naming its URL once listening; SIGTERM or SIGINT stops
it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web

from fleet_sim.serving import serve_until_signalled
from fleet_sim.webui.errors import WebUIError
from fleet_sim.webui.server import WebConfig, check_loopback, start_webui


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fleet_sim.webui", description="Serve the session page for a fleet."
    )
    parser.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT")
    parser.add_argument("--edge", required=True, metavar="URL", help="the edge's base URL")
    parser.add_argument(
        "--control-plane", metavar="URL", help="mint sessions here (without it, attach only)"
    )
    parser.add_argument(
        "--state",
        type=Path,
        metavar="FILE",
        help="a running `fleet-sim up`'s state file: shows the fleet and takes its faults",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    host, _, port_text = args.listen.rpartition(":")
    try:
        if not port_text.isdigit():
            raise WebUIError(f"--listen {args.listen!r}: expected HOST:PORT")
        check_loopback(host)
        config = WebConfig(
            edge_url=args.edge.rstrip("/"),
            control_plane_url=args.control_plane.rstrip("/") if args.control_plane else None,
            state_file=args.state.resolve() if args.state else None,
        )
    except WebUIError as exc:
        print(f"fleet-sim webui: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    async def start() -> tuple[web.AppRunner, str]:
        runner, url, _ = await start_webui(config, host, int(port_text))
        return runner, url

    serve_until_signalled(start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
