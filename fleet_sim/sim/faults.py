"""The fault package: what can be done to a running fleet's processes, behind one interface, so
a scenario reads the same on a local fleet and on an attached one (NFS, EFS); and the two faults
that span a process and its storage: a frozen host, and an orchestrator taking a replica that
stops answering its readiness probe out of the edge's rotation."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Protocol

import httpx

from fleet_sim.juicefs import JuiceFs
from fleet_sim.sim.substrates import Attached, LeaseFs, NotApplicable, Substrate, run_fault_command
from fleet_sim.up import SLICES, LocalFleet

# An orchestrator's readiness probe: a replica that does not answer within this is unready.
PROBE_TIMEOUT_S = 1.0
RELOAD_WAIT_S = 10.0
# A thawed replica's turns in flight reach their commits within this (the model's remaining
# tokens were due while it was stopped).
THAWED_SETTLE_S = 2.0


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


def freeze_host(faults: Faults, substrate: Substrate, replica: str) -> None:
    """The replica's host stops: the replica (SIGSTOP) and then its file-system client, so
    nothing renews the host's storage session. A stopped replica's kernel still accepts
    connections: to the edge it looks slow, not gone."""
    faults.pause(replica)
    substrate.freeze(replica)


def thaw_host(faults: Faults, substrate: Substrate, replica: str) -> None:
    """The host runs again, its client first so that the replica wakes to a mount that answers
    (and finds, at its next commit, whatever a successor did meanwhile)."""
    substrate.thaw(replica)
    faults.resume(replica)


def storage_expiry_s(substrate: Substrate) -> float:
    """How long a stopped or cut-off host keeps its locks: leasefs's lease, 5 heartbeats of a
    JuiceFS client, an attached fleet's declared lease (0 when it declares none)."""
    if isinstance(substrate, JuiceFs):
        return 5 * substrate.config.heartbeat_s
    if isinstance(substrate, LeaseFs | Attached):
        return substrate.lease_s
    return 0.0


def wait_unready(url: str, timeout_s: float = 30.0) -> float:
    """Probe ``url``'s /readyz until it does not answer ready in time (it answers 503, or not at
    all); how long that took."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            if httpx.get(f"{url}/readyz", timeout=PROBE_TIMEOUT_S).status_code != 200:
                break
        except httpx.HTTPError:
            break
        time.sleep(0.1)
    return time.monotonic() - started


class Rotation:
    """What an orchestrator does for the edge: a replica whose ``/readyz`` stops answering is
    taken out of the ring the edge serves, and put back once it answers ready again."""

    def __init__(self, fleet: LocalFleet) -> None:
        self.fleet = fleet
        self.out: set[str] = set()

    def wait_unanswered(self, replica: str, timeout_s: float = 30.0) -> float:
        return wait_unready(self.fleet.replicas[replica][1].url, timeout_s)

    def take_out(self, replica: str) -> None:
        self.out.add(replica)
        self._reload()

    def put_back(self, replica: str) -> None:
        self.out.discard(replica)
        self._reload()

    def _reload(self) -> None:
        members = {
            sl: [n for n, (s, _) in self.fleet.replicas.items() if s == sl and n not in self.out]
            for sl in SLICES
        }
        before = self._reloads()
        self.fleet.reload_edge(members)
        # The edge reloads on SIGHUP, asynchronously: wait until it says it has.
        deadline = time.monotonic() + RELOAD_WAIT_S
        while self._reloads() <= before:
            if time.monotonic() > deadline:
                raise TimeoutError("the edge did not reload its ring")
            time.sleep(0.05)

    def _reloads(self) -> float:
        url = self.fleet.edge_metrics_url
        if url is None:
            raise NotApplicable("the edge's metrics are not reachable from here")
        text = httpx.get(url, timeout=5).text
        match = re.search(r'^edge_config_reloads_total\{result="ok"\} (\S+)$', text, re.M)
        return float(match.group(1)) if match else 0.0


def superseded_count(fleet: LocalFleet, replica: str) -> float:
    """The replica's ``agent_sessions_superseded_total``: how often it found itself fenced."""
    url = fleet.replicas[replica][1].metrics_url
    if url is None:
        raise NotApplicable("the replica's metrics are not reachable from here")
    match = re.search(
        r"^agent_sessions_superseded_total (\S+)$", httpx.get(url, timeout=5).text, re.M
    )
    return float(match.group(1)) if match else 0.0


def frozen_host(
    faults: Faults,
    substrate: Substrate,
    rotation: Rotation,
    replica: str,
    hold: Callable[[float], object],
) -> dict[str, float]:
    """A host's freeze as an orchestrator lives it: the host stops; its /readyz stops answering
    and the replica leaves the ring; ``hold(frozen_at)`` returns when the host is to run again;
    it is thawed, answers ready, and its turns in flight reach their commits (and find the
    successors' segments). It is then restarted before it rejoins the ring: its storage session
    lapsed while it was stopped, yet, thawed, it still holds in memory the sessions it had and
    answers their readers from there until a commit finds it fenced (an idle one never does),
    which a client that saw the successor's newer messages is refused 409 for. Returns when each
    step happened, in seconds from the freeze, and how many fences it met once thawed."""
    fenced_before = superseded_count(rotation.fleet, replica)
    freeze_host(faults, substrate, replica)
    frozen = time.time()
    marks = {"frozen_at": frozen}
    rotation.wait_unanswered(replica)
    rotation.take_out(replica)
    marks["out_of_ring_after_s"] = round(time.time() - frozen, 2)
    hold(frozen)
    thaw_host(faults, substrate, replica)
    marks["frozen_for_s"] = round(time.time() - frozen, 2)
    faults.wait_ready(replica)
    time.sleep(THAWED_SETTLE_S)
    marks["fenced_once_thawed"] = superseded_count(rotation.fleet, replica) - fenced_before
    faults.kill(replica)
    faults.restart(replica)
    faults.wait_ready(replica)
    rotation.put_back(replica)
    marks["back_in_ring_after_s"] = round(time.time() - frozen, 2)
    return marks
