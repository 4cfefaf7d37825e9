"""``fleet-sim up``: a whole fleet on this machine, from one command.

It starts the sandbox service, a model server, the control plane, two slices of three replicas on
local-directory shards, and one edge in front of them, all under one state directory; prints how
to talk to a session; and on Ctrl-C drains the replicas and stops everything, leaving the data
(and the keys, so the next ``up`` on the same directory reads it back).
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from fleet_sim.control_plane import GRANT_TTL_S
from fleet_sim.keys import KeySet
from fleet_sim.local import Fleet, Replica, Service
from fleet_sim.ports import free_port

SLICES: dict[str, list[str]] = {"a07": ["a07-s1", "a07-s2"], "a08": ["a08-s1", "a08-s2"]}
REPLICAS_PER_SLICE = 3


def request_session(control_plane_url: str, tenant: str) -> dict[str, Any]:
    """Ask the control plane for a new session of ``tenant``: its id, slice and a grant."""
    response = httpx.post(f"{control_plane_url}/v1/sessions", json={"tenant": tenant}, timeout=10)
    response.raise_for_status()
    made: dict[str, Any] = response.json()
    return made


def request_grant(control_plane_url: str, tenant: str, session_id: str) -> str:
    """A fresh grant for an existing session (a client's refresh before its grant expires)."""
    response = httpx.post(
        f"{control_plane_url}/v1/grants",
        json={"tenant": tenant, "session_id": session_id},
        timeout=10,
    )
    response.raise_for_status()
    grant: str = response.json()["grant"]
    return grant


@dataclass(frozen=True, slots=True)
class UpConfig:
    state_dir: Path
    listen: str = "127.0.0.1:8080"
    model: str = "server"
    replicas_per_slice: int = REPLICAS_PER_SLICE
    drain_grace_s: float = 30.0
    idle_timeout_s: float = 60.0
    extra_replica_args: tuple[str, ...] = ()
    retry_budget_s: float = 120.0
    grant_ttl_s: int = GRANT_TTL_S  # how long the control plane's grants are valid
    web_listen: str | None = None  # where the session page is served; None: no page


ShardPath = Callable[[str, str], Path]  # (replica name, shard) -> where that replica mounts it


@dataclass
class LocalFleet:
    """The processes of one fleet, and what a tool needs to find, fault and restart each."""

    config: UpConfig
    fleet: Fleet
    edge: Service
    control_plane: Service
    model: Service | None
    shard_path: ShardPath
    model_flag: str
    replicas: dict[str, tuple[str, Replica]] = field(default_factory=dict)  # name -> (slice, r)
    ports: dict[str, int] = field(default_factory=dict)  # a replica keeps its port on restart
    web: Service | None = None

    @property
    def edge_url(self) -> str:
        return self.edge.url

    def state(self) -> dict[str, Any]:
        root = self.config.state_dir
        return {
            "edge_url": self.edge.url,
            "edge_pid": self.edge.proc.proc.pid,
            "edge_metrics_url": self.edge.metrics_url,
            "edge_config": str(root / "edge.toml"),
            "control_plane_url": self.control_plane.url,
            "control_plane_pid": self.control_plane.proc.proc.pid,
            "sandbox_url": self.fleet.sandbox.url,
            "sandbox_pid": self.fleet.sandbox.proc.proc.pid,
            "model_url": self.model.url if self.model else None,
            "web_url": self.web.url if self.web else None,
            "keys_dir": str(self.fleet.keys_dir),
            "state_dir": str(root),
            "replicas": [
                {
                    "name": name,
                    "slice": slice_name,
                    "url": r.url,
                    "metrics_url": r.metrics_url,
                    "pid": r.proc.proc.pid,
                    "shards": {s: str(self.shard_path(name, s)) for s in SLICES[slice_name]},
                }
                for name, (slice_name, r) in self.replicas.items()
            ],
        }

    @property
    def edge_metrics_url(self) -> str | None:
        return self.edge.metrics_url

    @property
    def control_plane_url(self) -> str:
        return self.control_plane.url

    @property
    def keys(self) -> KeySet:
        return self.fleet.keys

    @property
    def keys_dir(self) -> Path:
        return self.fleet.keys_dir

    @property
    def retry_budget_s(self) -> float:
        return self.config.retry_budget_s

    @property
    def grant_ttl_s(self) -> float:
        return self.config.grant_ttl_s

    def new_session(self, tenant: str = "demo") -> dict[str, Any]:
        return request_session(self.control_plane.url, tenant)

    def refresh_grant(self, tenant: str, session_id: str) -> str:
        return request_grant(self.control_plane.url, tenant, session_id)

    def start_replica(self, name: str, slice_name: str) -> Replica:
        """Start (or start again, on the same port) one replica of ``slice_name``."""
        port = self.ports.setdefault(name, free_port())
        replica = self.fleet.replica(
            name,
            {s: self.shard_path(name, s) for s in SLICES[slice_name]},
            "--model",
            self.model_flag,
            "--lifecycle-url",
            f"{self.control_plane.url}/v1/lifecycle",
            "--drain-grace",
            str(self.config.drain_grace_s),
            "--session-idle-timeout",
            str(self.config.idle_timeout_s),
            *self.config.extra_replica_args,
            notify_origin=self.edge.url,
            listen=f"127.0.0.1:{port}",
        )
        self.replicas[name] = (slice_name, replica)
        return replica

    def write_edge_config(self, members: dict[str, list[str]] | None = None) -> Path:
        """The edge's TOML for ``members`` (slice -> replica names; default: all replicas)."""
        if members is None:
            members = {sl: [n for n, (s, _) in self.replicas.items() if s == sl] for sl in SLICES}
        path = self.config.state_dir / "edge.toml"
        path.write_text(
            edge_toml(
                {n: self.replicas[n] for names in members.values() for n in names},
                self.config.retry_budget_s,
            )
        )
        return path

    def reload_edge(self, members: dict[str, list[str]] | None = None) -> None:
        self.write_edge_config(members)
        self.edge.proc.signal(signal.SIGHUP)

    def stop(self, drain_timeout_s: float = 60.0) -> None:
        """Drain replicas (they finish turns in flight), then stop the rest."""
        for _name, (_slice, replica) in self.replicas.items():
            replica.drain()
        deadline = time.monotonic() + drain_timeout_s
        for _name, (_slice, replica) in self.replicas.items():
            with contextlib.suppress(Exception):
                replica.proc.wait(max(0.1, deadline - time.monotonic()))
        self.edge.proc.signal(signal.SIGTERM)
        with contextlib.suppress(Exception):
            self.edge.proc.wait(10)
        self.fleet.close()


def local_dirs(root: Path) -> ShardPath:
    """Every replica sees every shard at the same local directory."""
    return lambda replica, shard: root / "shards" / shard


def edge_toml(replicas: dict[str, tuple[str, Replica]], budget_s: float = 120.0) -> str:
    lines = ["[edge]", f"retry_budget_s = {budget_s}", ""]
    for slice_name in SLICES:
        lines += ["[[slice]]", f'name = "{slice_name}"', "replicas = ["]
        lines += [
            f'  {{ name = "{name}", url = "{r.url}" }},'
            for name, (s, r) in replicas.items()
            if s == slice_name
        ]
        lines += ["]", ""]
    return "\n".join(lines)


def start(config: UpConfig, shard_path: ShardPath | None = None) -> LocalFleet:
    root = config.state_dir
    root.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(root)
    try:
        host, _, port_text = config.listen.rpartition(":")
        port = int(port_text) or free_port(host)
        edge_url = f"http://{host}:{port}"
        fleet.sandbox  # noqa: B018 - started first: grants name it
        model = fleet.model_server() if config.model == "server" else None
        control = fleet.control_plane(SLICES, edge_url, config.grant_ttl_s)
        placeholder = Service("edge", edge_url, None, fleet.sandbox.proc)
        local = LocalFleet(
            config,
            fleet,
            placeholder,
            control,
            model,
            shard_path or local_dirs(root),
            f"openai:{model.url}" if model else config.model,
        )
        names = [
            (f"r{i * config.replicas_per_slice + n + 1}", slice_name)
            for i, slice_name in enumerate(SLICES)
            for n in range(config.replicas_per_slice)
        ]
        # Started side by side: each waits only for its own "listening" line.
        with ThreadPoolExecutor(len(names)) as pool:
            for future in [pool.submit(local.start_replica, n, s) for n, s in names]:
                future.result()
        local.replicas = dict(sorted(local.replicas.items(), key=lambda kv: int(kv[0][1:])))
        local.edge = fleet.edge(
            local.write_edge_config(), listen=f"{host}:{port}", metrics=f"127.0.0.1:{free_port()}"
        )
        if config.web_listen is not None:
            from fleet_sim.webui.process import spawn

            local.web = spawn(fleet, config.web_listen, local.edge.url, control.url)
    except BaseException:
        fleet.close()
        raise
    return local


def instructions(local: LocalFleet, session: dict[str, Any]) -> str:
    edge = local.edge.url
    sid, grant = session["session_id"], session["grant"]
    page = f"\nOr open the session page in a browser: {local.web.url}\n" if local.web else ""
    return f"""
A fleet is running: {len(local.replicas)} replicas in {len(SLICES)} slices behind {edge}
State and data: {local.config.state_dir}

A session for tenant "demo" is ready:
  export SID={sid}
  export GRANT={grant}

Follow it as an event stream:
  curl -N -H "x-beyond-grant: $GRANT" "{edge}/_beyond/agent/events?session_id=$SID"
Send it a prompt (from another terminal):
  curl -H "x-beyond-grant: $GRANT" -H 'content-type: application/json' \\
       -d '{{"type":"prompt","message":"hello\\nrun: uname -a"}}' \\
       "{edge}/_beyond/agent?session_id=$SID"
Or chat over a WebSocket:
  fleet-sim chat --edge {edge} --session $SID --grant "$GRANT"
More sessions: curl -d '{{"tenant":"demo"}}' {local.control_plane.url}/v1/sessions
{page}
Ctrl-C drains the replicas and stops everything; the data stays.
"""


def run(config: UpConfig, state_file: Path | None, out: Any) -> int:
    local = start(config)
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if state_file is not None:
            state_file.write_text(json.dumps(local.state(), indent=2) + "\n")
        print(instructions(local, local.new_session()), file=out, flush=True)
        while not stop["now"]:
            dead = [r for r in local.fleet.procs if r.proc.poll() is not None]
            if dead:
                print(
                    f"fleet-sim up: a process exited: {dead[0].argv[2]} (log: {dead[0].log})",
                    file=out,
                    flush=True,
                )
                return 1
            time.sleep(0.2)
        print("draining and stopping...", file=out, flush=True)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        local.stop()
