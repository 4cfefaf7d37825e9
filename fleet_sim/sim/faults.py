"""The fault package: what can be done to a running fleet's processes, behind one interface, so
a scenario reads the same on a local fleet and on an attached one (NFS, EFS)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import Protocol

import httpx

from fleet_sim.sim.substrates import NotApplicable, run_fault_command
from fleet_sim.up import LocalFleet


class Faults(Protocol):
    def kill(self, replica: str) -> None: ...  # SIGKILL: an ungraceful loss

    def drain(self, replica: str, *, wait_s: float = 60.0) -> int: ...  # SIGTERM, wait exit

    def pause(self, replica: str) -> None: ...  # SIGSTOP

    def resume(self, replica: str) -> None: ...  # SIGCONT

    def restart(self, replica: str) -> None: ...  # start again where it was

    def wait_ready(self, replica: str, timeout_s: float = 30.0) -> None: ...


class LocalFaults:
    def __init__(self, fleet: LocalFleet) -> None:
        self.fleet = fleet

    def _proc(self, replica: str) -> subprocess.Popen[str]:
        return self.fleet.replicas[replica][1].proc.proc

    def kill(self, replica: str) -> None:
        proc = self._proc(replica)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def drain(self, replica: str, *, wait_s: float = 60.0) -> int:
        proc = self._proc(replica)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        return proc.wait(wait_s)

    def pause(self, replica: str) -> None:
        os.kill(self._proc(replica).pid, signal.SIGSTOP)

    def resume(self, replica: str) -> None:
        os.kill(self._proc(replica).pid, signal.SIGCONT)

    def restart(self, replica: str) -> None:
        slice_name, old = self.fleet.replicas[replica]
        if old.proc.proc.poll() is None:
            raise RuntimeError(f"{replica} is still running")
        self.fleet.start_replica(replica, slice_name)

    def wait_ready(self, replica: str, timeout_s: float = 30.0) -> None:
        url = self.fleet.replicas[replica][1].url
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    return
            time.sleep(0.05)
        raise TimeoutError(f"{replica} did not become ready")


class CommandFaults:
    """An attached fleet: each fault is ``FAULT_CMD VERB REPLICA`` (see deploy/*/fault.sh)."""

    def __init__(self, command: str, replica_urls: dict[str, str]) -> None:
        self.command = command
        self.urls = replica_urls

    def _run(self, verb: str, replica: str) -> None:
        run_fault_command(self.command, verb, replica)

    def kill(self, replica: str) -> None:
        self._run("kill", replica)

    def drain(self, replica: str, *, wait_s: float = 60.0) -> int:
        self._run("term", replica)
        return 0

    def pause(self, replica: str) -> None:
        self._run("pause", replica)

    def resume(self, replica: str) -> None:
        self._run("resume", replica)

    def restart(self, replica: str) -> None:
        self._run("restart", replica)

    def wait_ready(self, replica: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._ready(replica):
                return
            time.sleep(0.5)
        raise TimeoutError(f"{replica} did not become ready")

    def _ready(self, replica: str) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.urls[replica]}/readyz", timeout=2).status_code == 200
        return False

    def restore(self) -> list[str]:
        """Make the fleet whole again between scenarios (an attached fleet outlives each one):
        a replica that does not answer ready is healed and resumed, or started again if it is
        gone. Returns the replicas it had to start again."""
        restarted = []
        for replica in self.urls:
            if self._ready(replica):
                continue
            with contextlib.suppress(RuntimeError, NotApplicable):
                self._run("heal", replica)  # a scenario that failed may leave a partition
            with contextlib.suppress(RuntimeError):
                self._run("resume", replica)  # fails when it is not running: then restart
            if self._ready(replica):
                continue
            with contextlib.suppress(RuntimeError):
                self._run("restart", replica)
                restarted.append(replica)
            self.wait_ready(replica)
        return restarted
