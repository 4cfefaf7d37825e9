"""``fleet-edge serve --workers N``: one edge per core, sharing one listening address.

The parent serves no request. It starts N worker processes, each a whole edge
(:func:`edge.server.serve`: its own fast lane, aiohttp lane and replica pools) listening on the
same address with ``SO_REUSEPORT``, so the kernel spreads new connections across them; then it
supervises:

- SIGHUP: the configuration is loaded once here, to report a bad file once, then every worker
  reloads it (each keeps its running one if it fails to load there);
- SIGTERM or SIGINT: every worker drains in its own stages; the parent exits once all have;
- a worker that exits on its own (a crash, an OOM kill) is started again on the same address,
  after 0.5 s doubling up to 4 s while it keeps failing;
- metrics: each worker serves its own on a loopback port of its choosing; the parent's
  ``--metrics-listen`` scrape gathers them all, every sample under a ``worker`` label whose
  values are the closed set ``0`` .. ``N-1``, plus ``edge_workers`` (running now) and
  ``edge_worker_restarts_total``. Per worker rather than summed: a restarted worker's counters
  start again from zero, which a per-worker series shows as the reset it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Final, cast

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from edge.core.accesslog import RequestErrors
from edge.core.config import load_config
from edge.core.errors import ConfigError, EdgeError
from edge.core.metrics import require_loopback

log = logging.getLogger("edge.workers")

MAX_WORKERS: Final = 64
START_TIMEOUT_S: Final = 30.0
FIRST_BACKOFF_S: Final = 0.5
MAX_BACKOFF_S: Final = 4.0
HEALTHY_AFTER_S: Final = 60.0  # a worker up this long starts its backoff afresh
SCRAPE_TIMEOUT_S: Final = 5.0
ORPHAN_POLL_S: Final = 0.5
# How long past its drain grace a worker may take to stop (its cancelled requests get 10 s).
STOP_SLACK_S: Final = 15.0
DRAIN_GRACE_FALLBACK_S: Final = 30.0  # the file no longer loads: the default grace


class WorkerError(EdgeError):
    """A worker could not be started."""


def worker_count(text: str) -> int:
    """``--workers``: a count, or ``auto`` for the CPUs this process may run on."""
    if text == "auto":
        return max(1, len(os.sched_getaffinity(0)))
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"--workers must be a count or auto, got {text!r}") from None
    if not 1 <= value <= MAX_WORKERS:
        raise ConfigError(f"--workers must be within 1-{MAX_WORKERS}, got {value}")
    return value


def restart_delay(failures: int) -> float:
    """How long to wait before starting a worker that has exited ``failures`` times running."""
    return min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2.0 ** max(0, failures - 1))


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker process needs to serve: everything else it reads from the config file."""

    index: int
    config_path: str
    host: str
    port: int
    log_level: str
    parent: int  # the supervising process: a worker outliving it drains and exits


def _orphan_watch(parent: int) -> None:
    """A worker whose parent has gone (SIGKILL leaves no time to stop the workers) drains and
    exits rather than hold the address with nobody to supervise it."""
    while os.getppid() == parent:
        time.sleep(ORPHAN_POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)


def _worker_main(spec: WorkerSpec, ready: Connection) -> None:
    """A worker process: one edge on the shared address; tells the parent its metrics port."""
    import uvloop

    from edge.core.accesslog import AccessSink, use_sink
    from edge.server import Edge, serve
    from wire.redaction import redact_handlers

    logging.basicConfig(
        level=getattr(logging, spec.log_level.upper()),
        format=f"%(asctime)s %(levelname)s %(name)s[w{spec.index}]: %(message)s",
        stream=sys.stderr,
    )
    redact_handlers()
    use_sink(AccessSink(sys.stderr))
    threading.Thread(target=_orphan_watch, args=(spec.parent,), daemon=True).start()

    def announce(edge: Edge) -> None:
        ready.send(edge.metrics_port)
        ready.close()

    try:
        config = load_config(spec.config_path)
        code = uvloop.run(
            serve(
                Path(spec.config_path),
                config,
                spec.host,
                spec.port,
                ("127.0.0.1", 0),
                reuse_port=True,
                announce=announce,
            )
        )
    except ConfigError as exc:
        log.error("worker %d: %s", spec.index, exc)
        code = 2
    finally:
        use_sink(None)
    sys.exit(code)


@dataclass(slots=True)
class _Worker:
    index: int
    process: BaseProcess
    metrics_port: int
    started: float


class Workers:
    """The parent of N edge workers (see the module doc)."""

    def __init__(self, config_path: Path, host: str, port: int, count: int, log_level: str) -> None:
        self.config_path = config_path
        self.host = host
        self.port = port
        self.count = count
        self.log_level = log_level
        self.restarts = 0
        self._context = multiprocessing.get_context("spawn")
        self._workers: dict[int, _Worker] = {}
        self._failures: dict[int, int] = {}
        self._stopping = False
        self._pending: set[asyncio.Task[None]] = set()

    @property
    def running(self) -> int:
        return sum(1 for w in self._workers.values() if w.process.is_alive())

    def metrics_ports(self) -> dict[int, int]:
        return {i: w.metrics_port for i, w in self._workers.items() if w.process.is_alive()}

    async def start(self) -> None:
        """Start every worker; raises :class:`WorkerError` (after stopping those started) if
        one does not come up."""
        try:
            await asyncio.gather(*(self._start(i) for i in range(self.count)))
        except BaseException:
            await self.stop()
            raise

    async def _start(self, index: int) -> None:
        receiving, sending = self._context.Pipe(duplex=False)
        spec = WorkerSpec(
            index, str(self.config_path), self.host, self.port, self.log_level, os.getpid()
        )
        process = self._context.Process(
            target=_worker_main, args=(spec, sending), name=f"fleet-edge-worker-{index}"
        )
        process.start()
        sending.close()  # the child's end: once the child has it, EOF here means it died
        try:
            port = await asyncio.to_thread(_receive_port, receiving, START_TIMEOUT_S)
        except WorkerError as exc:
            process.kill()
            process.join(10)
            raise WorkerError(f"worker {index} did not start: {exc}") from None
        finally:
            receiving.close()
        self._workers[index] = _Worker(index, process, port, time.monotonic())
        asyncio.get_running_loop().add_reader(process.sentinel, self._exited, index)

    def _exited(self, index: int) -> None:
        worker = self._workers[index]
        loop = asyncio.get_running_loop()
        loop.remove_reader(worker.process.sentinel)
        worker.process.join()
        if self._stopping:
            return
        lived = time.monotonic() - worker.started
        failures = 1 if lived >= HEALTHY_AFTER_S else self._failures.get(index, 0) + 1
        self._failures[index] = failures
        delay = restart_delay(failures)
        log.error(
            "worker %d (pid %s) exited with status %s after %.1f s; starting it again in %g s",
            index,
            worker.process.pid,
            worker.process.exitcode,
            lived,
            delay,
        )
        task = loop.create_task(self._restart(index, delay))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _restart(self, index: int, delay: float) -> None:
        await asyncio.sleep(delay)
        if self._stopping:
            return
        try:
            await self._start(index)
        except WorkerError as exc:
            log.error("%s", exc)
            failures = self._failures[index] = self._failures.get(index, 0) + 1
            await self._restart(index, restart_delay(failures))
            return
        self.restarts += 1
        log.info("worker %d started again (pid %s)", index, self._workers[index].process.pid)

    def reload(self) -> None:
        """SIGHUP: check the file once here, then every worker reloads it."""
        try:
            load_config(self.config_path)
        except ConfigError as exc:
            log.error("config reload failed, workers keep the previous config: %s", exc)
            return
        for worker in self._alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.process.pid or 0, signal.SIGHUP)
        log.info("config reload sent to %d workers", self.running)

    async def stop(self) -> None:
        """Drain every worker (each in its own stages) and wait until all have exited."""
        self._stopping = True
        for task in list(self._pending):
            task.cancel()
        alive = list(self._alive())
        for worker in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.process.pid or 0, signal.SIGTERM)
        # A worker drains within its grace, then cancels what is left and waits a bounded
        # time for it: past all that (a stopped worker, say) it is killed.
        try:
            grace = load_config(self.config_path).options.drain_grace_s
        except ConfigError:
            grace = DRAIN_GRACE_FALLBACK_S
        deadline = time.monotonic() + grace + STOP_SLACK_S
        for worker in alive:
            await asyncio.to_thread(worker.process.join, max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                log.error("worker %d did not stop in time; killing it", worker.index)
                worker.process.kill()
                await asyncio.to_thread(worker.process.join, 10)
        loop = asyncio.get_running_loop()
        for worker in self._workers.values():
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(worker.process.sentinel)

    def _alive(self) -> Iterator[_Worker]:
        return (w for w in self._workers.values() if w.process.is_alive() and w.process.pid)


def _receive_port(conn: Connection, timeout_s: float) -> int:
    if not conn.poll(timeout_s):
        raise WorkerError(f"no word from it in {timeout_s:g} s")
    try:
        port = conn.recv()
    except EOFError:
        raise WorkerError("it exited before listening (its log says why)") from None
    if not isinstance(port, int):
        raise WorkerError(f"it sent {port!r} for its metrics port")
    return port


# --- metrics ---------------------------------------------------------------------------------


def per_worker(expositions: dict[int, str]) -> list[Metric]:
    """Each worker's metric families, every sample under a ``worker`` label, merged family by
    family (a family's samples must stay together in the text format)."""
    merged: dict[str, Metric] = {}
    for index in sorted(expositions):
        for family in text_string_to_metric_families(expositions[index]):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type)
            for sample in family.samples:
                labels = {**sample.labels, "worker": str(index)}
                into.add_sample(sample.name, labels, sample.value, sample.timestamp)
    return list(merged.values())


class _Gathered(Collector):
    def __init__(self, workers: Workers, expositions: dict[int, str]) -> None:
        self.workers = workers
        self.expositions = expositions

    def collect(self) -> Iterator[Metric]:
        yield from per_worker(self.expositions)
        running = GaugeMetricFamily("edge_workers", "Edge worker processes running now.")
        running.add_metric((), self.workers.running)
        yield running
        restarts = CounterMetricFamily(
            "edge_worker_restarts", "Edge workers started again after exiting on their own."
        )
        restarts.add_metric((), self.workers.restarts)
        yield restarts


class _Refused(Exception):
    """A worker answered its scrape with an error (its labels failed their check)."""


async def _scrape(session: aiohttp.ClientSession, port: int) -> str:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
        text = await response.text()
        if response.status != 200:
            raise _Refused(response.status)
        return text


async def start_gathering(workers: Workers, host: str, port: int) -> tuple[web.AppRunner, int]:
    """The parent's ``GET /metrics`` on a loopback address: every worker's, gathered."""
    require_loopback(host)
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
    session = aiohttp.ClientSession(timeout=timeout)

    async def scrape(request: web.Request) -> web.Response:
        ports = workers.metrics_ports()
        results = await asyncio.gather(
            *(_scrape(session, p) for p in ports.values()), return_exceptions=True
        )
        expositions: dict[int, str] = {}
        for index, result in zip(ports, results, strict=True):
            if isinstance(result, _Refused):
                log.error("worker %d refused to serve its metrics; so does the edge", index)
                return web.Response(status=500, text="a worker's metrics failed their check\n")
            if isinstance(result, BaseException):
                # One worker restarting or too busy to answer is no reason to lose the rest.
                log.warning("worker %d's metrics: %s", index, type(result).__name__)
                continue
            expositions[index] = result
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Gathered(workers, expositions))
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def close_session(_app: web.Application) -> None:
        await session.close()

    app = web.Application()
    app.router.add_get("/metrics", scrape)
    app.on_cleanup.append(close_session)
    # aiohttp types it as a Logger; it is called only as one (see RequestErrors).
    runner = web.AppRunner(app, access_log=None, logger=cast(logging.Logger, RequestErrors()))
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound: int = runner.addresses[0][1]
    return runner, bound


# --- the parent --------------------------------------------------------------------------------


def _reserve_port(host: str) -> socket.socket:
    """A port for the workers to share when the command line asked for port 0: bound here with
    ``SO_REUSEPORT`` and held, not listened on (only listening sockets take connections), until
    every worker listens on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    held = socket.socket(family, socket.SOCK_STREAM)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    held.bind((host, 0))
    return held


async def run_workers(
    config_path: Path,
    host: str,
    port: int,
    metrics_address: tuple[str, int] | None,
    count: int,
    log_level: str,
) -> int:
    """``fleet-edge serve --workers N`` in a running loop, until SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    held = _reserve_port(host) if port == 0 else None
    if held is not None:
        port = held.getsockname()[1]
    workers = Workers(config_path, host, port, count, log_level)
    gathering: web.AppRunner | None = None
    try:
        try:
            await workers.start()
        except WorkerError as exc:
            log.error("%s", exc)
            return 1
        finally:
            if held is not None:
                held.close()
        metrics_text = ""
        if metrics_address is not None:
            gathering, metrics_port = await start_gathering(workers, *metrics_address)
            metrics_text = f", metrics on http://{metrics_address[0]}:{metrics_port}/metrics"
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGHUP, workers.reload)
        shown = f"[{host}]" if ":" in host else host
        url = f"http://{shown}:{port}"
        log.info("serving on %s with %d workers%s", url, count, metrics_text)
        print(f"fleet-edge listening on {url}", flush=True)
        try:
            await stop.wait()
            log.info("stop requested: draining %d workers", workers.running)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
        await workers.stop()
        log.info("edge stopped")
        return 0
    finally:
        await workers.stop()
        if gathering is not None:
            await gathering.cleanup()
