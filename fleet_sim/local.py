"""A local fleet of real processes: keys, a sandbox service, a model server, a control plane,
replicas and edges, and grants for them.

Everything listens on 127.0.0.1 with ports the kernel picks; each process prints one JSON line
(or its URL) once listening, which is how the fleet learns where it is. ``Fleet.close`` kills
every process it started, whatever happened; tests and benchmarks build on this.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from fleet_sim.control_plane import GRANT_TTL_S
from fleet_sim.keys import KeySet, generate_keyset, load_keyset, mint_grant
from fleet_sim.sandbox import sandbox_exec
from replica.keyfiles import read_key_file

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 20.0
_UNSAFE_IN_FILE_NAME = re.compile(r"[^A-Za-z0-9_.-]")


def log_name(name: str) -> str:
    """A process's log file name: a ring name may be any printable ASCII (``10.0.4.17:9000``), a
    file name here is kept to a safe set (a leading dot cannot hide it), and a name that had to
    change carries a digest of itself, so ``a:1`` and ``a_1`` keep logs of their own."""
    safe = _UNSAFE_IN_FILE_NAME.sub("_", name).lstrip(".")
    if safe == name:
        return name
    return f"{safe or '_'}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def _python(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def listening(line: str) -> dict[str, Any]:
    """What a process printed once listening: a JSON object, or a line ending in its URL."""
    if line.startswith("{"):
        info: dict[str, Any] = json.loads(line)
        return info
    return {"url": line.split()[-1].rstrip("/")}


@dataclass
class Proc:
    """A child process whose stdout is read line by line; stderr goes to a file."""

    argv: list[str]
    log: Path
    proc: subprocess.Popen[str] = field(init=False)
    _err: IO[str] = field(init=False)

    def start(self) -> Proc:
        # Appended, not truncated: a restarted process must not erase what its predecessor said.
        self._err = open(self.log, "a")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            # A group of its own: Ctrl-C in a terminal reaches the process that started the
            # fleet, which drains in order, and not every process at once (a replica that got
            # the terminal's SIGINT and then the drain's SIGTERM would skip its drain grace).
            process_group=0,
        )
        return self

    def readline(self, timeout: float = START_TIMEOUT_S) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        os.set_blocking(self.proc.stdout.fileno(), False)
        buffer = ""
        while time.monotonic() < deadline:
            chunk = self.proc.stdout.readline()
            if chunk:
                buffer += chunk
                if buffer.endswith("\n"):
                    return buffer
            elif self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv[2]} exited: {self.log.read_text()[-2000:]}")
            else:
                time.sleep(0.01)
        raise TimeoutError(f"{self.argv[2]} printed nothing in {timeout}s")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._err.close()


@dataclass
class Sandbox:
    url: str
    secret: bytes
    proc: Proc

    def exec_for(self, name: str) -> tuple[str, dict[str, str]]:
        return sandbox_exec(self.url, self.secret, name)


@dataclass
class Replica:
    name: str
    url: str
    metrics_url: str | None
    proc: Proc

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10, **kwargs)

    def scrape(self) -> str:
        assert self.metrics_url is not None
        return httpx.get(self.metrics_url, timeout=5).text

    def drain(self) -> None:
        self.proc.signal(signal.SIGTERM)


@dataclass
class Service:
    """Any other process of the fleet (edge, control plane, model server)."""

    name: str
    url: str
    metrics_url: str | None
    proc: Proc


class Fleet:
    """Keys, one sandbox service and any number of replicas, all under one directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.keys_dir = root / "keys"
        # A fleet started again on the same directory keeps its keys, and so its data.
        self.keys: KeySet = (
            load_keyset(self.keys_dir)
            if (self.keys_dir / "grant-keys.txt").exists()
            else generate_keyset(self.keys_dir)
        )
        self.grant_keys = (self.keys_dir / "grant-keys.txt").read_text().split()
        self.procs: list[Proc] = []
        self._sandbox: Sandbox | None = None

    def _spawn(self, name: str, argv: list[str]) -> Proc:
        proc = Proc(argv, self.root / f"{log_name(name)}.log").start()
        self.procs.append(proc)
        return proc

    def retire(self, proc: Proc) -> None:
        """Forget a process that has exited (or kill it first): its successor takes its place."""
        with contextlib.suppress(Exception):
            proc.stop()
        with contextlib.suppress(ValueError):
            self.procs.remove(proc)

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            self.start_sandbox()
        assert self._sandbox is not None
        return self._sandbox

    def start_sandbox(self, listen: str = "127.0.0.1:0") -> Sandbox:
        """Start the sandbox service (again, on ``listen``: its key file outlives it, so grants
        minted before a restart still open their sandboxes)."""
        root = self.root / "sandboxes"
        proc = self._spawn(
            "sandbox", _python("fleet_sim.sandbox", "--listen", listen, "--root", str(root))
        )
        url = listening(proc.readline())["url"]
        secret = read_key_file(root / "@sandbox.key", what="sandbox secret")
        self._sandbox = Sandbox(url.rstrip("/"), secret, proc)
        return self._sandbox

    def replica(
        self,
        name: str,
        shards: dict[str, Path],
        *extra: str,
        notify_origin: str = "http://127.0.0.1:9",
        metrics: bool = True,
        listen: str = "127.0.0.1:0",
    ) -> Replica:
        argv = _python(
            "replica",
            "serve",
            "--service",
            "--listen",
            listen,
            "--name",
            name,
            "--seal-key",
            str(self.keys_dir / "seal.key"),
            "--notify-key",
            str(self.keys_dir / "notify.key"),
            "--notify-origin",
            notify_origin,
        )
        for spec in self.grant_keys:
            argv += ["--grant-key", spec]
        for shard, path in shards.items():
            path.mkdir(parents=True, exist_ok=True)
            argv += ["--shard", f"{shard}={path}"]
        if metrics:
            argv += ["--metrics-listen", "127.0.0.1:0"]
        proc = self._spawn(name, [*argv, *extra])
        info = listening(proc.readline())
        return Replica(name, info["url"], info.get("metrics_url"), proc)

    def model_server(self, *extra: str, listen: str = "127.0.0.1:0") -> Service:
        proc = self._spawn("model", _python("fleet_sim.model_server", "--listen", listen, *extra))
        return Service("model", listening(proc.readline())["url"], None, proc)

    def control_plane(
        self,
        slices: dict[str, list[str]],
        edge_url: str | None,
        grant_ttl_s: int = GRANT_TTL_S,
        listen: str = "127.0.0.1:0",
    ) -> Service:
        argv = _python(
            "fleet_sim.control_plane",
            "--listen",
            listen,
            "--keys",
            str(self.keys_dir),
            "--sandbox-url",
            self.sandbox.url,
            "--sandbox-secret",
            str(self.root / "sandboxes" / "@sandbox.key"),
            "--journal",
            str(self.root / "lifecycle.jsonl"),
        )
        for name, shards in slices.items():
            argv += ["--slice", f"{name}:{','.join(s.partition('-')[2] for s in shards)}"]
        if edge_url:
            argv += ["--edge-url", edge_url]
        argv += ["--grant-ttl", str(grant_ttl_s)]
        proc = self._spawn("control-plane", argv)
        return Service("control-plane", listening(proc.readline())["url"], None, proc)

    def edge(
        self,
        config: Path,
        *extra: str,
        listen: str = "127.0.0.1:0",
        metrics: str | None = None,
        name: str = "edge",
    ) -> Service:
        argv = _python("edge", "serve", "--config", str(config), "--listen", listen, *extra)
        if metrics is not None:
            argv += ["--metrics-listen", metrics]
        proc = self._spawn(name, argv)
        info = listening(proc.readline())
        metrics_url = info.get("metrics_url") or (f"http://{metrics}/metrics" if metrics else None)
        return Service(name, info["url"], metrics_url, proc)

    def grant(
        self,
        tenant: str,
        session_id: str,
        *,
        sandbox: bool = True,
        ttl_s: int = 3600,
        dek: bytes | None = None,
    ) -> str:
        exec_url, headers = (
            self.sandbox.exec_for(session_id.replace(".", "_"))
            if sandbox
            else ("http://127.0.0.1:9/none", {})
        )
        return mint_grant(
            self.keys,
            tenant=tenant,
            session_id=session_id,
            workspace_root="/workspace",
            exec_url=exec_url,
            dek=dek or self.dek(tenant),
            exec_headers=headers,
            ttl_s=ttl_s,
        )

    def dek(self, tenant: str) -> bytes:
        from fleet_sim.keys import derive_tenant_dek

        return derive_tenant_dek(self.keys, tenant)

    def close(self) -> None:
        for proc in reversed(self.procs):
            with contextlib.suppress(Exception):
                proc.stop()


@contextlib.contextmanager
def fleet_at(root: Path) -> Iterator[Fleet]:
    fleet = Fleet(root)
    try:
        yield fleet
    finally:
        fleet.close()
