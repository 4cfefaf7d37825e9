"""The simulator's control plane: mints session ids and grants, receives lifecycle events.

It is the only holder of the grant signing key. It places each tenant on one slice (by a stable
hash of the tenant over the configured slices) and each new session on one of that slice's
shards, so placement is written into the id and never changes. Lifecycle events from replicas
are kept (bounded) for graders and appended to a JSON-lines journal. A ``job_ended`` event is
accepted at once and then the session is woken: opened through the edge so the replica that
takes it reads its sandbox's jobs back.

    POST /v1/sessions   {"tenant": T}                    -> 201 {"session_id", "grant", ...}
    POST /v1/grants     {"tenant": T, "session_id": ID}  -> 200 {"grant"}
    POST /v1/lifecycle  one event object                 -> 202
    GET  /v1/lifecycle?type=&session_id=                 -> 200 {"events": [...]}
    GET  /healthz
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import secrets
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from fleet_sim.keys import KeySet, derive_tenant_dek, load_keyset, mint_grant
from fleet_sim.sandbox import sandbox_exec
from fleet_sim.serving import listen_arg, serve_until_signalled
from replica.errors import ReplicaError
from replica.keyfiles import read_key_file
from wire.errors import InvalidName
from wire.http import AGENT_PATH, GRANT_HEADER, SESSION_ID_PARAM
from wire.names import parse_session_id, parse_slice, parse_tenant
from wire.ring_hash import ring_hash

log = logging.getLogger("fleet_sim.control_plane")

GRANT_TTL_S = 3600  # how long a minted grant is valid, unless --grant-ttl says otherwise
MAX_EVENTS = 100_000
WORKSPACE_ROOT = "/workspace"


@dataclass(frozen=True, slots=True)
class SliceShards:
    slice: str
    shards: tuple[str, ...]  # slice-qualified shard names


@dataclass(frozen=True, slots=True)
class ControlPlaneConfig:
    keys_dir: Path
    sandbox_url: str
    sandbox_secret: bytes = field(repr=False)
    slices: tuple[SliceShards, ...]
    edge_url: str | None = None
    journal: Path | None = None
    grant_ttl_s: int = GRANT_TTL_S


def parse_slice_arg(value: str) -> SliceShards:
    """``a07:s1,s2`` -> slice a07 with shards a07-s1 and a07-s2."""
    name, sep, shards = value.partition(":")
    try:
        slice_name = parse_slice(name)
    except InvalidName as exc:
        raise ValueError(f"--slice {value!r}: {exc}") from None
    names = tuple(f"{slice_name}-{s}" for s in shards.split(",") if s) if sep else ()
    if not names:
        raise ValueError(f"--slice {value!r} must be SLICE:SHARD[,SHARD...]")
    try:
        for shard in names:
            parse_session_id(f"{shard}.x")
    except InvalidName as exc:
        raise ValueError(f"--slice {value!r}: {exc}") from None
    return SliceShards(slice_name, names)


class ControlPlane:
    def __init__(self, config: ControlPlaneConfig) -> None:
        self.config = config
        self.keys: KeySet = load_keyset(config.keys_dir)
        self.events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self.wakes: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._http: aiohttp.ClientSession | None = None
        self._journal = open(config.journal, "a") if config.journal else None  # noqa: SIM115

    def place(self, tenant: str) -> SliceShards:
        slices = self.config.slices
        return slices[ring_hash(tenant.encode()) % len(slices)]

    def new_session_id(self, tenant: str) -> str:
        placed = self.place(tenant)
        shard = placed.shards[secrets.randbelow(len(placed.shards))]
        return f"{shard}.{secrets.token_urlsafe(12)}"

    def grant(self, tenant: str, session_id: str) -> str:
        exec_url, headers = sandbox_exec(
            self.config.sandbox_url, self.config.sandbox_secret, session_id
        )
        return mint_grant(
            self.keys,
            tenant=tenant,
            session_id=session_id,
            workspace_root=WORKSPACE_ROOT,
            exec_url=exec_url,
            dek=derive_tenant_dek(self.keys, tenant),
            exec_headers=headers,
            ttl_s=self.config.grant_ttl_s,
        )

    # -- HTTP -------------------------------------------------------------------------------

    async def create_session(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        try:
            tenant = parse_tenant(body.get("tenant"))
        except InvalidName as exc:
            return _error(400, str(exc))
        session_id = self.new_session_id(tenant)
        placed = self.place(tenant)
        return web.json_response(
            {
                "session_id": session_id,
                "tenant": tenant,
                "slice": placed.slice,
                "shard": session_id.partition(".")[0],
                "grant": self.grant(tenant, session_id),
            },
            status=201,
        )

    async def refresh_grant(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        try:
            tenant = parse_tenant(body.get("tenant"))
            session_id = str(parse_session_id(body.get("session_id")))
        except InvalidName as exc:
            return _error(400, str(exc))
        if parse_session_id(session_id).slice != self.place(tenant).slice:
            return _error(403, "that session id is not on the tenant's slice")
        return web.json_response({"grant": self.grant(tenant, session_id)})

    async def lifecycle(self, request: web.Request) -> web.Response:
        event = await _json_body(request)
        if not isinstance(event.get("type"), str):
            return _error(400, "a lifecycle event needs a type")
        event = {**event, "received_at": time.time()}
        self.events.append(event)
        if self._journal is not None:
            self._journal.write(json.dumps(event) + "\n")
            self._journal.flush()
        if event["type"] == "job_ended":
            self._spawn(self._wake(event))
        return web.json_response({"accepted": True}, status=202)

    async def list_events(self, request: web.Request) -> web.Response:
        kind = request.query.get("type")
        sid = request.query.get("session_id")
        found = [
            e
            for e in self.events
            if (kind is None or e.get("type") == kind)
            and (sid is None or e.get("session_id") == sid)
        ]
        return web.json_response({"events": found})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    # -- waking a session for a job's end ----------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _wake(self, event: dict[str, Any]) -> None:
        """Open the session through the edge, so a replica takes it and reconciles its jobs."""
        if self.config.edge_url is None or self._http is None:
            return
        try:
            tenant = parse_tenant(event.get("tenant"))
            session_id = str(parse_session_id(event.get("session_id")))
        except InvalidName:
            return
        grant = self.grant(tenant, session_id)
        url = f"{self.config.edge_url}{AGENT_PATH}"
        for attempt in range(8):
            try:
                async with self._http.post(
                    url,
                    params={SESSION_ID_PARAM: session_id},
                    data=json.dumps({"type": "get_state"}),
                    headers={GRANT_HEADER: grant, "content-type": "application/json"},
                ) as response:
                    if response.status == 200:
                        self.wakes[session_id] = self.wakes.get(session_id, 0) + 1
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(min(5.0, 0.25 * 2**attempt))
        log.warning("could not wake a session for a job's end")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1024 * 1024)
        app.router.add_post("/v1/sessions", self.create_session)
        app.router.add_post("/v1/grants", self.refresh_grant)
        app.router.add_post("/v1/lifecycle", self.lifecycle)
        app.router.add_get("/v1/lifecycle", self.list_events)
        app.router.add_get("/healthz", self.healthz)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))

    async def _stop(self, app: web.Application) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.close()
        if self._journal is not None:
            self._journal.close()


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError):
        raise web.HTTPBadRequest(text="the body must be a JSON object\n") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="the body must be a JSON object\n")
    return body


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def start_control_plane(
    config: ControlPlaneConfig, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, str, ControlPlane]:
    plane = ControlPlane(config)
    runner = web.AppRunner(plane.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0]
    return runner, f"http://{bound[0]}:{bound[1]}", plane


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fleet_sim.control_plane", description="The simulator's control plane."
    )
    parser.add_argument("--listen", type=listen_arg, default="127.0.0.1:0", metavar="HOST:PORT")
    parser.add_argument("--keys", type=Path, required=True, help="keys directory (fleet-sim keys)")
    parser.add_argument("--sandbox-url", required=True, help="the sandbox service's base URL")
    parser.add_argument("--sandbox-secret", type=Path, required=True, help="its secret key file")
    parser.add_argument(
        "--slice",
        action="append",
        default=[],
        metavar="SLICE:SHARD,...",
        help="a slice and its shard names, e.g. a07:s1,s2 (repeatable)",
    )
    parser.add_argument("--edge-url", help="the edge, used to wake sessions for job ends")
    parser.add_argument("--journal", type=Path, help="append lifecycle events here (JSON lines)")
    parser.add_argument(
        "--grant-ttl",
        type=grant_ttl_arg,
        default=GRANT_TTL_S,
        metavar="S",
        help="seconds a minted grant is valid (default 3600; clients refresh at POST /v1/grants)",
    )
    return parser


def grant_ttl_arg(text: str) -> int:
    """``--grant-ttl``: whole seconds, from 10 s to a week."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be whole seconds, got {text!r}") from None
    if not 10 <= value <= 7 * 86400:
        raise argparse.ArgumentTypeError(f"must be within 10-604800 seconds, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        slices = tuple(parse_slice_arg(s) for s in args.slice)
        if not slices:
            raise ValueError("at least one --slice is required")
        host, port = args.listen
        config = ControlPlaneConfig(
            keys_dir=args.keys,
            sandbox_url=args.sandbox_url.rstrip("/"),
            sandbox_secret=read_key_file(args.sandbox_secret, what="sandbox secret"),
            slices=slices,
            edge_url=args.edge_url,
            journal=args.journal,
            grant_ttl_s=args.grant_ttl,
        )
    except (ValueError, ReplicaError) as exc:
        print(f"control plane: {exc}", file=sys.stderr)
        return 2

    async def start() -> tuple[web.AppRunner, str]:
        runner, url, _plane = await start_control_plane(config, host, int(port))
        return runner, url

    serve_until_signalled(start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
