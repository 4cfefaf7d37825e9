"""Wiring and lifecycle of one replica process: build the parts from a ``ServeConfig``, serve, and
drain in ordered stages on SIGTERM.

Drain: (1) refuse new placements and report unready, while owned sessions keep answering;
(2) let runs in flight finish, up to ``--drain-grace``; (3) close every session: cancel what is
still running (it commits what it has), close readers, release locks; (4) stop the listeners.
A second signal skips to (4). Signals are ours to handle, so uvicorn's own handlers stay out.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import signal
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from replica.agent import TurnDeps
from replica.app import ReplicaApp
from replica.callbacks import CallbackHandler
from replica.commands import CommandDeps
from replica.config import ServeConfig
from replica.corking import CorkedHttp
from replica.errors import ReplicaError
from replica.grants import GrantVerifier
from replica.jobs import Reconciler
from replica.lifecycle import Lifecycle, LifecycleConfig
from replica.live import LiveSession
from replica.metrics import ReplicaMetrics
from replica.model import make_provider
from replica.notify import NotifyKey
from replica.probes import Readiness, ShardProbe
from replica.registry import Registry
from replica.sandbox_client import SandboxClient, new_http_client
from replica.store import SessionStore, StoreConfig
from replica.tools import NotifyTarget
from replica.websocket_protocol import ReplicaWebSockets
from wire.http import (
    AGENT_PATH,
    SESSION_ID_PARAM,
    TENANT_PARAM,
)
from wire.names import parse_shard

log = logging.getLogger("replica.service")
RECHECK_S = 2.0  # how often requests to a session with running jobs may re-read them
WS_MAX_BYTES = 8 * 1024 * 1024


class Phase(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class Bound:
    url: str
    metrics_url: str | None


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the service drains in stages, then stops it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bound_url(server: uvicorn.Server) -> str:
    sock = server.servers[0].sockets[0]
    host, port = sock.getsockname()[:2]
    return f"http://{host}:{port}"


class ReplicaService:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.phase = Phase.STARTING
        self.metrics = ReplicaMetrics()
        stores = {
            shard: SessionStore(
                path, StoreConfig(owner=config.name, lock_wait_s=config.lock_wait_s)
            )
            for shard, path in config.shards.items()
        }
        self.registry = Registry(
            stores,
            max_live=config.max_live_sessions,
            idle_timeout_s=config.session_idle_timeout_s,
            metrics=self.metrics,
            queue_frames=config.stream_queue_frames,
            coalescing=config.coalescing,
            on_open=self._on_open,
        )
        self.lifecycle = Lifecycle(
            LifecycleConfig(config.lifecycle_url),
            on_drop=lambda reason: self.metrics.lifecycle_dropped.labels(reason).inc(),
        )
        self.model = make_provider(config.model, read_window_s=config.coalescing.window_s)
        self.notify_key = NotifyKey(config.notify_key)
        self.http_client: httpx.AsyncClient | None = None
        turn = TurnDeps(
            model=self.model,
            sandbox=self._sandbox,
            notify=self._notify_target,
            emit=self.lifecycle.emit,
            budget=config.budget,
        )
        self.deps = CommandDeps(self.registry, turn, self.metrics, self.lifecycle.emit)
        probes = [
            ShardProbe(
                str(shard),
                path,
                config.name,
                deadline_s=config.probe_deadline_s,
                observe=self.metrics.ready_probe.observe,
            )
            for shard, path in config.shards.items()
        ]
        self.readiness = Readiness(probes, lambda: self.registry.draining)
        self.registry.shard_ok = lambda shard: self.readiness.shard_healthy(str(shard))
        verifier = GrantVerifier(
            dict(config.grant_keys), config.seal_key, audience=config.audience, issuer=config.issuer
        )
        callbacks = CallbackHandler(
            registry=self.registry,
            notify_key=self.notify_key,
            lifecycle=self.lifecycle,
            reconciler=self.reconciler,
            metrics=self.metrics,
        )
        self.http = ReplicaApp(
            verifier=verifier,
            deps=self.deps,
            readiness=self.readiness,
            callbacks=callbacks,
            keepalive_s=config.keepalive_s,
        )
        self._background: set[asyncio.Task[None]] = set()
        self._drain_requested = asyncio.Event()
        self._force = asyncio.Event()

    # -- per-session pieces -----------------------------------------------------------------

    def reconciler(self, live: LiveSession) -> Reconciler:
        if live.reconciler is None:
            live.reconciler = Reconciler(live, self._sandbox)
        reconciler: Reconciler = live.reconciler
        return reconciler

    def _shard_unhealthy(self, name: str) -> None:
        shed = self.registry.shed_shard(parse_shard(name))
        log.warning(
            "shard %s is not answering: readers of its sessions told to reconnect (%d)", name, shed
        )

    def _on_open(self, live: LiveSession) -> None:
        """Placed here, opened or already open: a session with background jobs whose end it has
        not been told may have missed it (its holder died, drained or reaped it, or the callback
        went to a replica that handed it to the control plane, whose wake is this request).
        Read them back, at most every few seconds however often the session is used."""
        if not live.owned.transcript.untold_jobs or not self.reconciler(live).due(RECHECK_S):
            return
        task = asyncio.create_task(self._reconcile(live), name="reconcile-on-open")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _reconcile(self, live: LiveSession) -> None:
        try:
            await self.reconciler(live).request()
        except ReplicaError as exc:
            log.warning("reconciling jobs on open failed: %s", exc)

    def _sandbox(self, live: LiveSession) -> SandboxClient:
        assert self.http_client is not None
        return SandboxClient(
            live.context.exec_url, live.context.exec_headers, http=self.http_client
        )

    def _notify_target(self, live: LiveSession) -> NotifyTarget:
        query = urllib.parse.urlencode(
            {SESSION_ID_PARAM: live.session_id, TENANT_PARAM: live.tenant}
        )
        return NotifyTarget(
            f"{self.config.notify_origin}{AGENT_PATH}?{query}",
            self.notify_key.mint(live.tenant, live.session_id),
        )

    # -- metrics listener -------------------------------------------------------------------

    async def _metrics(self, request: Request) -> Response:
        stray = self.metrics.stray_labels()
        if stray:
            log.error("refusing a scrape: labels outside the vocabulary: %s", stray)
            return PlainTextResponse("label vocabulary violated\n", 500)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def _sessions(self, request: Request) -> Response:
        """The sessions this replica owns now, for an operator's fleet view. Served only on the
        loopback metrics listener, beside the counts; ids and epochs, never a tenant, a grant or
        a line of a transcript."""
        owned = [
            {
                "session_id": live.session_id,
                "epoch": live.owned.epoch,
                "running": live.running,
                "attached": live.attached,
            }
            for live in list(self.registry.sessions.values())
        ]
        return JSONResponse({"replica": self.config.name, "sessions": owned})

    # -- running ----------------------------------------------------------------------------

    def request_drain(self) -> None:
        if self._drain_requested.is_set():
            self._force.set()
        self._drain_requested.set()

    async def run(self, on_ready: Callable[[Bound], None] = lambda bound: None) -> None:
        host, port = self.config.listen
        server = _Server(
            uvicorn.Config(
                self.http.app,
                host=host,
                port=port,
                lifespan="off",
                log_level="warning",
                access_log=False,
                http=CorkedHttp,  # a small answer leaves in one write, not head then body
                ws=ReplicaWebSockets,
                ws_max_size=WS_MAX_BYTES,
                # Frames are small JSON on loopback or a LAN: compressing each costs more CPU
                # than it saves bytes.
                ws_per_message_deflate=False,
                ws_ping_interval=None,
                timeout_graceful_shutdown=5,
            )
        )
        servers = [server]
        if self.config.metrics_listen is not None:
            metrics_app = Starlette(
                routes=[Route("/metrics", self._metrics), Route("/sessions", self._sessions)]
            )
            mhost, mport = self.config.metrics_listen
            servers.append(
                _Server(
                    uvicorn.Config(
                        metrics_app,
                        host=mhost,
                        port=mport,
                        lifespan="off",
                        log_level="warning",
                        access_log=False,
                    )
                )
            )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_drain)
        self.http_client = new_http_client()
        await self.lifecycle.start()
        tasks: list[asyncio.Task[Any]] = [
            asyncio.create_task(s.serve(), name="uvicorn") for s in servers
        ]
        reaper = asyncio.create_task(self.registry.reaper(), name="reaper")
        prober = asyncio.create_task(self.readiness.watch(self._shard_unhealthy), name="prober")
        try:
            while not all(s.started for s in servers):
                done = [t for t in tasks if t.done()]
                if done:
                    done[0].result()  # a listener that failed to bind raises here
                    raise RuntimeError("a listener stopped before it started")
                await asyncio.sleep(0.01)
            self.phase = Phase.SERVING
            on_ready(
                Bound(
                    _bound_url(server),
                    _bound_url(servers[1]) + "/metrics" if len(servers) > 1 else None,
                )
            )
            stop = asyncio.create_task(self._drain_requested.wait())
            await asyncio.wait([stop, *tasks, reaper, prober], return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            self.phase = Phase.DRAINING
            await self._drain()
        finally:
            for s in servers:
                s.should_exit = True
            reaper.cancel()
            prober.cancel()
            await asyncio.gather(*tasks, reaper, prober, return_exceptions=True)
            await self.lifecycle.stop()
            await self.model.aclose()
            await self.http_client.aclose()
            self.registry.shutdown()
            self.phase = Phase.STOPPED

    async def _drain(self) -> None:
        log.info("draining: refusing new placements, grace %.1fs", self.config.drain_grace_s)
        drain = asyncio.create_task(self.registry.drain(self.config.drain_grace_s))
        force = asyncio.create_task(self._force.wait())
        await asyncio.wait([drain, force], return_when=asyncio.FIRST_COMPLETED)
        force.cancel()
        if not drain.done():
            log.warning("second signal: stopping without finishing the drain")
            drain.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await drain
