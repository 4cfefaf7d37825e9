"""A stand-in replica and a second edge in front of it, for the rules that need a replica that
misbehaves on purpose: :class:`Backend` records the exact bytes of each request and answers as
its script says (a chosen status, or never); :func:`edge_in_front_of` starts a real edge process
whose one slice is that backend, next to the real fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

from fleet_sim.ports import free_port
from fleet_sim.sim.job_queries import SetupFailed
from fleet_sim.sim.rawhttp import Wire, read_wire
from fleet_sim.sim.scenario import Context


@dataclass(slots=True)
class Received:
    wire: Wire
    at: float
    cancelled_at: float | None = None  # the edge went away while the request was unanswered


Script = Callable[[Wire], "tuple[int, bytes] | None"]  # None: never answer


class Backend:
    """A replica stand-in on 127.0.0.1 that records each request's exact head and body and
    answers as ``script`` says. It runs its own event loop in a thread, so the scenario's
    blocking code and the edge process can both talk to it."""

    HANG_S: Final = 60.0

    def __init__(self, script: Script) -> None:
        self.script = script
        self._received: list[Received] = []
        self._mutex = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="backend", daemon=True)
        self._ready = threading.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._server: asyncio.Server | None = None
        self.url = ""

    @property
    def received(self) -> list[Received]:
        with self._mutex:
            return list(self._received)

    def start(self) -> str:
        self._thread.start()
        if not self._ready.wait(10) or self._server is None:
            raise SetupFailed("the stand-in replica did not start")
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0)
        )
        self._ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        if not self._thread.is_alive():
            return

        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            for _ in range(10_000):  # the edge keeps connections alive across requests
                try:
                    wire = await read_wire(reader, response=False)
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                seen = Received(wire, time.time())
                with self._mutex:
                    self._received.append(seen)
                answer = self.script(wire)
                if answer is None:
                    await self._hold(reader, seen)
                    return
                status, body = answer
                retry = b"Retry-After: 1\r\n" if status == 503 else b""
                writer.write(
                    b"HTTP/1.1 %d %s\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n%s\r\n%s"
                    % (status, http.HTTPStatus(status).phrase.encode(), len(body), retry, body)
                )
                await writer.drain()
        except ConnectionError:
            return
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _hold(self, reader: asyncio.StreamReader, seen: Received) -> None:
        """Never answer; note when the edge gives up on the request (its end of the socket)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.HANG_S):
                with contextlib.suppress(ConnectionError):
                    await reader.read(1)
                seen.cancelled_at = time.time()


@contextlib.contextmanager
def edge_in_front_of(
    ctx: Context, backend: Backend, **options: float
) -> Iterator[tuple[str, str | None]]:
    """A second, real edge process whose slice a07 is just ``backend``: (url, metrics url)."""
    url = backend.start()
    lines = ["[edge]", *(f"{k} = {float(v)!r}" for k, v in options.items()), ""]
    lines += ["[[slice]]", 'name = "a07"', f'replicas = [{{ name = "rec", url = "{url}" }}]', ""]
    path = ctx.out_dir / "edge-rec.toml"
    path.write_text("\n".join(lines))
    edge = None
    try:
        edge = ctx.local.fleet.edge(
            path, name="edge-rec", metrics=f"127.0.0.1:{free_port()}", listen="127.0.0.1:0"
        )
        yield edge.url, edge.metrics_url
    finally:
        if edge is not None:
            edge.proc.signal(signal.SIGTERM)
            with contextlib.suppress(Exception):
                edge.proc.wait(10)
        backend.stop()


__all__ = ["Backend", "Received", "Script", "edge_in_front_of"]
