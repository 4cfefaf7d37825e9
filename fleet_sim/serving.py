"""Running one of the simulator's aiohttp services as a process: print where it listens as one
JSON line (what ``fleet_sim.local`` reads), serve until SIGTERM or SIGINT, then clean up."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
from collections.abc import Awaitable, Callable

from aiohttp import web

from replica.config import parse_hostport
from replica.errors import ConfigError


def listen_arg(value: str) -> tuple[str, int]:
    """``--listen HOST:PORT`` for argparse, parsed as every other command of the project does."""
    try:
        return parse_hostport(value, "--listen")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def serve_until_signalled(start: Callable[[], Awaitable[tuple[web.AppRunner, str]]]) -> None:
    async def serve() -> None:
        runner, url = await start()
        print(json.dumps({"event": "listening", "url": url}), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    import uvloop

    uvloop.run(serve())
