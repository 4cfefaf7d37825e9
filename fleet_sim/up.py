"""``fleet-sim up``: a whole fleet on this machine, from one command.

It starts the sandbox service, a model server, the control plane, two slices of three replicas on
local-directory shards, and one edge in front of them, all under one state directory; prints how
to talk to a session; and on Ctrl-C drains the replicas and stops everything, leaving the data
(and the keys, so the next ``up`` on the same directory reads it back).
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from fleet_sim.control_plane import GRANT_TTL_S
from fleet_sim.keys import KeySet
from fleet_sim.local import Fleet, Proc, Replica, Service
from fleet_sim.ports import free_port
from fleet_sim.sim.substrates import Substrate

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
    state_file: Path | None = None  # where `up` keeps the state (the page's fleet view reads it)
    log_level: str = "info"  # the edge's and the replicas' --log-level


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
    substrate: Substrate | None = None
    edge_listen: tuple[str, str] = ("127.0.0.1:0", "127.0.0.1:0")  # (listen, metrics)
    web_listen: str = "127.0.0.1:0"

    @property
    def edge_url(self) -> str:
        return self.edge.url

    def state(self) -> dict[str, Any]:
        root = self.config.state_dir
        substrate = self.substrate
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
            "model_pid": self.model.proc.proc.pid if self.model else None,
            "web_url": self.web.url if self.web else None,
            "web_pid": self.web.proc.proc.pid if self.web else None,
            "keys_dir": str(self.fleet.keys_dir),
            "state_dir": str(root),
            "substrate": substrate.name if substrate else "local-dir",
            "replicas": [
                {
                    "name": name,
                    "slice": slice_name,
                    "url": r.url,
                    "metrics_url": r.metrics_url,
                    "pid": r.proc.proc.pid,
                    "log": str(r.proc.log),
                    "shards": {s: str(self.shard_path(name, s)) for s in SLICES[slice_name]},
                    **self._storage(name),
                }
                for name, (slice_name, r) in self.replicas.items()
            ],
        }

    def _storage(self, replica: str) -> dict[str, Any]:
        """A replica's mount and file-system client processes, where its substrate has them."""
        if self.substrate is None:
            return {}
        mount = self.substrate.mount_dir(replica)
        found: dict[str, Any] = {"fs_pids": self.substrate.fs_pids(replica)}
        if mount is not None:
            found["mount"] = str(mount)
        return found

    def processes(self) -> dict[str, tuple[str, Proc]]:
        """Every process of the fleet by the name a fault names it: name -> (kind, process)."""
        found: dict[str, tuple[str, Proc]] = {"sandbox": ("sandbox", self.fleet.sandbox.proc)}
        if self.model is not None:
            found["model"] = ("model", self.model.proc)
        found["control-plane"] = ("control-plane", self.control_plane.proc)
        found.update({name: ("replica", r.proc) for name, (_s, r) in self.replicas.items()})
        found["edge"] = ("edge", self.edge.proc)
        if self.web is not None:
            found["page"] = ("page", self.web.proc)
        return found

    def respawn(self, name: str) -> Proc:
        """Start ``name`` again with the same name, address and shards, in place of its
        predecessor (which is killed if it still runs)."""
        kind, old = self.processes()[name]
        self.fleet.retire(old)
        if kind == "replica":
            return self.start_replica(name, self.replicas[name][0]).proc
        if kind == "edge":
            return self.start_edge().proc
        if kind == "page":
            return self.start_page().proc
        if kind == "sandbox":
            return self.fleet.start_sandbox(_listen_of(self.fleet.sandbox.url)).proc
        if kind == "model" and self.model is not None:
            self.model = self.fleet.model_server(listen=_listen_of(self.model.url))
            return self.model.proc
        if kind == "control-plane":
            self.control_plane = self.fleet.control_plane(
                SLICES,
                self.edge.url,
                self.config.grant_ttl_s,
                listen=_listen_of(self.control_plane.url),
            )
            return self.control_plane.proc
        raise KeyError(f"cannot start {name} ({kind}) again")

    def start_edge(self) -> Service:
        listen, metrics = self.edge_listen
        self.edge = self.fleet.edge(
            self.write_edge_config(),
            "--log-level",
            self.config.log_level,
            listen=listen,
            metrics=metrics,
        )
        return self.edge

    def start_page(self) -> Service:
        from fleet_sim.webui.process import spawn

        self.web = spawn(
            self.fleet,
            self.web_listen,
            self.edge.url,
            self.control_plane.url,
            state_file=self.config.state_file,
        )
        self.web_listen = _listen_of(self.web.url)  # port 0 the first time: keep what it got
        return self.web

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
        if name in self.replicas:
            self.fleet.retire(self.replicas[name][1].proc)
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
            "--log-level",
            self.config.log_level,
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
        """Drain replicas (they finish turns in flight), then stop the rest. A frozen process is
        let go on first, or it would sit on its SIGTERM until the drain timeout."""
        for _kind, proc in self.processes().values():
            proc.signal(signal.SIGCONT)
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


def _listen_of(url: str) -> str:
    """``http://127.0.0.1:8123`` -> ``127.0.0.1:8123``: where a restarted process listens."""
    return urlsplit(url).netloc


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


def start(
    config: UpConfig, shard_path: ShardPath | None = None, substrate: Substrate | None = None
) -> LocalFleet:
    """Start a whole fleet. ``shard_path`` says where each replica finds each shard (default:
    one local directory for all); ``substrate``, when given, is where those paths live, named in
    the state and asked for the storage side of faults."""
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
            shard_path or (substrate.shard_path if substrate else local_dirs(root)),
            f"openai:{model.url}" if model else config.model,
            substrate=substrate,
        )
        names = replica_names(config)
        # Started side by side: each waits only for its own "listening" line.
        with ThreadPoolExecutor(len(names)) as pool:
            for future in [pool.submit(local.start_replica, n, s) for n, s in names]:
                future.result()
        local.replicas = dict(sorted(local.replicas.items(), key=lambda kv: int(kv[0][1:])))
        local.edge_listen = (f"{host}:{port}", f"127.0.0.1:{free_port()}")
        local.start_edge()
        if config.web_listen is not None:
            local.web_listen = config.web_listen
            local.start_page()
    except BaseException:
        fleet.close()
        raise
    return local


def instructions(local: LocalFleet, session: dict[str, Any], state_file: Path) -> str:
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
See it survive: find the replica that owns the session (the page's fleet view shows it, and so
does the OWNS column of `fleet-sim fault status`), kill it, and send the next prompt:
  fleet-sim fault status --state {state_file}
  fleet-sim fault kill r1 --state {state_file}
Faults: kill, freeze, thaw, drain, partition, heal, hang, unhang, restart (of any process:
r1..r{len(local.replicas)}, edge, control-plane, sandbox, model, page).

Ctrl-C drains the replicas and stops everything; the data stays.
"""


def replica_names(config: UpConfig) -> list[tuple[str, str]]:
    return [
        (f"r{i * config.replicas_per_slice + n + 1}", slice_name)
        for i, slice_name in enumerate(SLICES)
        for n in range(config.replicas_per_slice)
    ]


def run(
    config: UpConfig,
    state_file: Path | None,
    out: Any,
    *,
    substrate_name: str = "local-dir",
    restart: bool = True,
) -> int:
    """``fleet-sim up``: start, supervise until Ctrl-C (or a process that cannot stay up), stop.
    The state file (default ``<dir>/state.json``) is where ``fleet-sim fault`` finds the fleet."""
    from fleet_sim.sim.scenario import make_substrate
    from fleet_sim.supervisor import Supervisor
    from fleet_sim.upctl import ControlServer

    state_file = state_file or config.state_dir / "state.json"
    config = dataclasses.replace(config, state_file=state_file)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    substrate = make_substrate(substrate_name, config.state_dir)
    control: ControlServer | None = None
    local: LocalFleet | None = None
    supervisor: Supervisor | None = None
    try:
        substrate.prepare(
            [name for name, _slice in replica_names(config)],
            [shard for shards in SLICES.values() for shard in shards],
        )
        local = start(config, substrate=substrate)
        supervisor = Supervisor(
            local,
            out=out,
            state_file=state_file,
            restart=restart,
            extra_state=lambda: control.state() if control else {},
        )
        control = ControlServer(supervisor).start()
        supervisor.write_state()
        print(instructions(local, local.new_session(), state_file), file=out, flush=True)
        while not stop.wait(0.2):
            reason = supervisor.check()
            if reason is not None:
                print(f"fleet-sim up: stopping the fleet: {reason}", file=out, flush=True)
                return 1
        print("draining and stopping...", file=out, flush=True)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if control is not None:
            control.close()
        if supervisor is not None:
            supervisor.release()
        if local is not None:
            local.stop()
        substrate.close()
        with contextlib.suppress(FileNotFoundError):
            if local is not None:
                state_file.unlink()  # no running fleet now: a fault finds none
