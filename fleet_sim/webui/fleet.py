"""The session page's fleet view: every process of a running ``fleet-sim up``, sampled a few
times a second, and the faults the page's buttons send.

Everything comes from the state file ``up`` keeps (read again for every sample: a process started
again has a new pid, and a replica a new metrics port) and from three loopback sources: the up
process's control endpoint (each process's state), each replica's ``/readyz``, and the
``/sessions`` list on its metrics listener. Each replica gets :data:`REPLICA_TIMEOUT_S`, so one
that is frozen or whose storage hangs shows as not answering instead of stalling the view.

One sampler serves every tab, and samples only while some page asks: it stops
:data:`IDLE_STOP_S` after the last request. Takeovers are detected from its samples
(:mod:`fleet_sim.webui.takeovers`) for each session a page has open.

What leaves this module for the browser is built field by field: never the control endpoint's
token, a grant, a key or a log path, and other sessions' ids only shortened to their shard and
a few characters. Faults go through :func:`fleet_sim.upctl.fault`, the same call as ``fleet-sim
fault``; the page server can send them because it can read the state file, and it answers only
on loopback, to its own pages (:mod:`fleet_sim.webui.guard`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp

from fleet_sim import upctl
from fleet_sim.webui.takeovers import Fault, Holding, Seen, Takeover, Watch

log = logging.getLogger("fleet_sim.webui")

SAMPLE_EVERY_S: Final = 0.25
REPLICA_TIMEOUT_S: Final = 0.3
CONTROL_TIMEOUT_S: Final = 0.5
IDLE_STOP_S: Final = 30.0
FRESH_S: Final = 1.0
"""A request finding a sample older than this waits for the next one."""
WAIT_FOR_SAMPLE_S: Final = 3.0
WATCH_FOR_S: Final = 600.0
MAX_WATCHES: Final = 256
MAX_OWNED_SHOWN: Final = 6
MAX_READINESS_CHARS: Final = 160
FAULT_VERBS: Final = ("kill", "freeze", "thaw", "drain", "restart")
STORAGE_FAULT_VERBS: Final = ("partition", "heal")
PARTITION_SUBSTRATES: Final = frozenset({"leasefs", "juicefs"})
PROCESSES: Final = {
    "edge": "edge_pid",
    "control-plane": "control_plane_pid",
    "sandbox": "sandbox_pid",
    "model": "model_pid",
    "page": "web_pid",
}
"""The processes beside the replicas, by the name a fault takes, with their pid in the state."""
_DONE: Final = {
    "kill": "killed",
    "freeze": "frozen",
    "drain": "drained",
    "restart": "restarted",
    "partition": "partitioned",
}
"""Faults that can take a session away from its replica, and how a takeover's cause says them."""


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """A replica as the state file names it."""

    name: str
    slice: str
    url: str
    sessions_url: str | None
    pid: int | None


@dataclass(frozen=True, slots=True)
class Listed:
    session_id: str
    epoch: int
    running: bool
    attached: int


@dataclass(frozen=True, slots=True)
class ReplicaProbe:
    spec: ReplicaSpec
    reach: str
    """``answering``, ``not listening`` (refused: its process is gone) or ``not answering``."""
    ready: bool | None
    """``/readyz``: 200 or 503; None when it did not answer in time."""
    readiness: str
    sessions: tuple[Listed, ...] | None
    """``/sessions``; None when it did not answer in time."""


@dataclass(frozen=True, slots=True)
class Sample:
    at: float
    done: float
    wall: float
    substrate: str = "local-dir"
    replicas: tuple[ReplicaProbe, ...] = ()
    processes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """The control endpoint's status, by process name (empty when it did not answer)."""
    pids: Mapping[str, int] = field(default_factory=dict)
    """The other processes' pids as the state file names them."""
    control_error: str | None = None
    state_error: str | None = None


# -- pure: what the state allows, and what the page is shown -----------------------------------


def fault_verbs(substrate: str) -> tuple[str, ...]:
    extra = STORAGE_FAULT_VERBS if substrate in PARTITION_SUBSTRATES else ()
    return FAULT_VERBS + extra


def replica_specs(state: Mapping[str, Any]) -> tuple[ReplicaSpec, ...]:
    found = []
    for entry in state.get("replicas") or ():
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            continue
        metrics = entry.get("metrics_url")
        sessions = None
        if isinstance(metrics, str):
            sessions = f"{metrics.removesuffix('/metrics')}/sessions"
        pid = entry.get("pid")
        found.append(
            ReplicaSpec(
                entry["name"],
                str(entry.get("slice", "")),
                str(entry.get("url", "")),
                sessions,
                pid if isinstance(pid, int) else None,
            )
        )
    return tuple(found)


def other_pids(state: Mapping[str, Any]) -> dict[str, int]:
    return {name: pid for name, key in PROCESSES.items() if isinstance(pid := state.get(key), int)}


def fault_targets(state: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(r.name for r in replica_specs(state)) + tuple(other_pids(state))


def check_fault(state: Mapping[str, Any], verb: object, target: object) -> tuple[int, str] | None:
    """Why the page must not send this fault (status, sentence), or None when it may."""
    verbs = fault_verbs(str(state.get("substrate", "local-dir")))
    if not isinstance(verb, str) or verb not in verbs:
        return 400, f"unknown fault {verb!r}: one of {', '.join(verbs)}"
    targets = fault_targets(state)
    if not isinstance(target, str) or target not in targets:
        return 404, f"no process named {target!r} in this fleet: one of {', '.join(targets)}"
    return None


def short_id(session_id: str) -> str:
    """``a07-s2.ZX9SibveZBdZe2Ih`` -> ``a07-s2.ZX9S…``: enough to tell sessions apart."""
    shard, _, opaque = session_id.partition(".")
    return f"{shard}.{opaque[:4]}…" if len(opaque) > 4 else session_id


def badge(state: str | None, reach: str, ready: bool | None) -> tuple[str, str]:
    """The replica's badge: (kind, label). The supervisor's word wins over what probes saw: a
    frozen process also does not answer, and it is frozen that a person needs to read."""
    if state == "down":
        return "down", "down"
    if state == "waiting":
        return "down", "down · restarting"
    if state == "starting":
        return "starting", "starting"
    if state == "frozen":
        return "frozen", "frozen"
    if reach == "not listening":
        return "down", "not listening"
    if ready is True:
        return "ready", "ready"
    if ready is False:
        return "unready", "not ready"
    return "silent", "not answering"


def condition(probe: ReplicaProbe, process: Mapping[str, Any] | None) -> str:
    """What would explain this replica dropping a session now, for a takeover's cause."""
    state = process.get("state") if process else None
    if state in ("waiting", "starting", "down") or probe.reach == "not listening":
        return "exited"
    if state == "frozen":
        return "frozen"
    if probe.reach == "not answering":
        return "stopped answering"
    if probe.ready is False:
        return "stopped being ready"
    return "let it go"


def seen_by(sample: Sample, session_id: str, faults: Mapping[str, Fault]) -> Seen:
    holdings = tuple(
        Holding(probe.spec.name, listed.epoch, listed.running, listed.attached)
        for probe in sample.replicas
        for listed in probe.sessions or ()
        if listed.session_id == session_id
    )
    conditions = {
        probe.spec.name: condition(probe, sample.processes.get(probe.spec.name))
        for probe in sample.replicas
    }
    return Seen(sample.at, sample.done, sample.wall, holdings, conditions, faults)


def takeover_json(t: Takeover) -> dict[str, Any]:
    return {
        "seq": t.seq,
        "from": t.previous,
        "to": t.owner,
        "from_epoch": t.previous_epoch,
        "to_epoch": t.epoch,
        "at": t.at,
        "unavailable_s": t.unavailable_s,
        "cause": t.cause,
    }


def session_json(watch: Watch, now: float) -> dict[str, Any]:
    holding = watch.holding
    if holding is None:
        status = "closed"
    elif watch.missing_since is None:
        status = "held"
    elif watch.missing_cause == "let it go":
        status = "released"
    else:
        status = "moving"
    held = status == "held" and holding is not None
    return {
        "session_id": watch.session_id,
        "status": status,
        "owner": holding.replica if held and holding else None,
        "previous": holding.replica if not held and holding else None,
        "epoch": holding.epoch if holding else None,
        "running": bool(held and holding and holding.running),
        "attached": holding.attached if held and holding else 0,
        "held_for_s": round(now - watch.since, 1) if held and watch.since is not None else None,
        "missing_for_s": (
            round(now - watch.missing_since, 1) if watch.missing_since is not None else None
        ),
        "cause": watch.missing_cause,
        "takeovers": [takeover_json(t) for t in reversed(watch.takeovers)],
    }


def replica_json(
    probe: ReplicaProbe, process: Mapping[str, Any] | None, open_id: str | None
) -> dict[str, Any]:
    state = process.get("state") if process else None
    kind, label = badge(state, probe.reach, probe.ready)
    listed = sorted(
        probe.sessions or (),
        key=lambda s: (s.session_id != open_id, not s.running, s.session_id),
    )
    pid = process.get("pid") if process else probe.spec.pid
    return {
        "name": probe.spec.name,
        "slice": probe.spec.slice,
        "pid": pid if isinstance(pid, int) else None,
        "state": state,
        "restarts": int(process.get("restarts", 0)) if process else None,
        "storage": [str(s) for s in process.get("storage", ())] if process else [],
        "ready": probe.ready,
        "readiness": probe.readiness,
        "answering": probe.reach == "answering",
        "reach": probe.reach,
        "badge": kind,
        "label": label,
        "live": len(probe.sessions) if probe.sessions is not None else None,
        "running": sum(s.running for s in probe.sessions) if probe.sessions is not None else None,
        "owned": [
            {"id": short_id(s.session_id), "open": s.session_id == open_id, "running": s.running}
            for s in listed[:MAX_OWNED_SHOWN]
        ],
        "owned_more": max(0, len(listed) - MAX_OWNED_SHOWN),
        "owns_open": open_id is not None and any(s.session_id == open_id for s in listed),
    }


def render(sample: Sample, watch: Watch | None, open_id: str | None, now: float) -> dict[str, Any]:
    """The JSON the page polls."""
    others = []
    for name, pid in sample.pids.items():
        process = sample.processes.get(name)
        others.append(
            {
                "name": name,
                "state": process.get("state") if process else None,
                "pid": process.get("pid", pid) if process else pid,
                "restarts": process.get("restarts") if process else None,
            }
        )
    return {
        "substrate": sample.substrate,
        "verbs": list(fault_verbs(sample.substrate)),
        "sample_every_s": SAMPLE_EVERY_S,
        "sampled_at": sample.wall,
        "age_s": round(max(0.0, now - sample.done), 3),
        "state_error": sample.state_error,
        "control_error": sample.control_error,
        "replicas": [
            replica_json(p, sample.processes.get(p.spec.name), open_id) for p in sample.replicas
        ],
        "processes": others,
        "session": session_json(watch, now) if watch is not None else None,
    }


def _listed(body: object) -> tuple[Listed, ...]:
    entries = body.get("sessions") if isinstance(body, dict) else None
    found = []
    for entry in entries if isinstance(entries, list) else ():
        if not isinstance(entry, dict):
            continue
        sid, epoch = entry.get("session_id"), entry.get("epoch")
        if isinstance(sid, str) and isinstance(epoch, int):
            attached = entry.get("attached")
            found.append(
                Listed(
                    sid,
                    epoch,
                    bool(entry.get("running")),
                    attached if isinstance(attached, int) else 0,
                )
            )
    return tuple(found)


def _failure(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "not listening"
    return "not answering"


# -- the sampler ----------------------------------------------------------------------------


class FleetView:
    """Samples one fleet while pages ask, follows the sessions they have open, sends faults."""

    def __init__(
        self,
        state_file: Path,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.state_file = state_file
        self.clock = clock
        self.wall = wall
        self.latest: Sample | None = None
        self._http: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._asked_at = 0.0
        self._wake = asyncio.Event()
        self._sampled = asyncio.Event()
        self._watches: OrderedDict[str, tuple[Watch, float]] = OrderedDict()
        self._faults: dict[str, Fault] = {}

    async def start(self) -> None:
        # Pooled: a few requests a second to the same dozen loopback listeners.
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REPLICA_TIMEOUT_S))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._http is not None:
            await self._http.close()

    # -- what the page asks

    async def view(self, open_id: str | None) -> dict[str, Any]:
        self._asked_at = self.clock()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="fleet-sampler")
        if self.latest is None or self.clock() - self.latest.done > FRESH_S:
            self._sampled.clear()
            self._wake.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(WAIT_FOR_SAMPLE_S):
                    await self._sampled.wait()
        sample = self.latest or Sample(
            self.clock(), self.clock(), self.wall(), state_error="the fleet has not answered yet"
        )
        watch = self._watch(open_id, sample) if open_id is not None else None
        return render(sample, watch, open_id, self.clock())

    async def fault(self, verb: object, target: object) -> tuple[int, dict[str, str]]:
        try:
            state = await asyncio.to_thread(upctl.read_state, self.state_file)
        except upctl.ControlError as exc:
            return 503, {"error": str(exc)}
        refused = check_fault(state, verb, target)
        if refused is not None:
            return refused[0], {"error": refused[1]}
        assert isinstance(verb, str) and isinstance(target, str)
        before = self._faults.get(target)
        if verb in _DONE:
            # Timed before it is sent: the session was served at least until then.
            self._faults[target] = Fault(_DONE[verb], self.clock())
        try:
            message = await asyncio.to_thread(upctl.fault, self.state_file, verb, target)
        except upctl.ControlError as exc:
            if before is None:
                self._faults.pop(target, None)
            else:
                self._faults[target] = before
            return exc.status or 503, {"error": str(exc)}
        fault = self._faults.get(target)
        if verb in _DONE and fault is not None:
            self._faults[target] = dataclasses.replace(fault, answered=self.clock())
        self._wake.set()
        log.info("fault sent from the page: %s %s", verb, target)
        return 200, {"message": message}

    def _watch(self, session_id: str, sample: Sample) -> Watch:
        entry = self._watches.pop(session_id, None)
        if entry is None:
            watch = Watch(session_id)
            watch.observe(seen_by(sample, session_id, self._faults))
            while len(self._watches) >= MAX_WATCHES:
                self._watches.popitem(last=False)
        else:
            watch = entry[0]
        self._watches[session_id] = (watch, self.clock())
        return watch

    # -- sampling

    async def _run(self) -> None:
        try:
            while self.clock() - self._asked_at < IDLE_STOP_S:
                started = self.clock()
                self._wake.clear()
                try:
                    sample = await self._sample()
                except Exception as exc:  # one bad sample must not end the view
                    log.warning("fleet sample failed: %s", type(exc).__name__)
                else:
                    self._take(sample)
                rest = SAMPLE_EVERY_S - (self.clock() - started)
                if rest > 0:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(rest):
                            await self._wake.wait()
        finally:
            self._task = None

    def _take(self, sample: Sample) -> None:
        self.latest = sample
        now = self.clock()
        for session_id, (watch, asked) in list(self._watches.items()):
            if now - asked > WATCH_FOR_S:
                del self._watches[session_id]
                continue
            taken = watch.observe(seen_by(sample, session_id, self._faults))
            if taken is not None:
                log.info(
                    "takeover: %s -> %s, epoch %d -> %d, unavailable %s s",
                    taken.previous,
                    taken.owner,
                    taken.previous_epoch,
                    taken.epoch,
                    taken.unavailable_s,
                )
        self._sampled.set()

    async def _sample(self) -> Sample:
        at, wall = self.clock(), self.wall()
        try:
            state = await asyncio.to_thread(upctl.read_state, self.state_file)
        except upctl.ControlError as exc:
            return Sample(at, self.clock(), wall, state_error=str(exc))
        specs = replica_specs(state)
        status, *probes = await asyncio.gather(
            self._status(state), *(self._probe(spec) for spec in specs)
        )
        processes, control_error = status
        return Sample(
            at,
            self.clock(),
            wall,
            substrate=str(state.get("substrate", "local-dir")),
            replicas=tuple(probes),
            processes=processes,
            pids=other_pids(state),
            control_error=control_error,
        )

    @property
    def http(self) -> aiohttp.ClientSession:
        assert self._http is not None, "the fleet view has not started"
        return self._http

    async def _status(
        self, state: Mapping[str, Any]
    ) -> tuple[dict[str, Mapping[str, Any]], str | None]:
        url, token = state.get("supervisor_url"), state.get("supervisor_token")
        try:
            async with self.http.get(
                f"{url}/v1/status",
                headers={"authorization": f"Bearer {token}"},
                timeout=aiohttp.ClientTimeout(total=CONTROL_TIMEOUT_S),
            ) as answer:
                if answer.status != 200:
                    return {}, f"the fleet's control endpoint answered {answer.status}"
                body = await answer.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return {}, "the fleet's control endpoint does not answer (is `fleet-sim up` running?)"
        found = body.get("processes") if isinstance(body, dict) else None
        return {str(p["name"]): p for p in _dicts(found) if isinstance(p.get("name"), str)}, None

    async def _probe(self, spec: ReplicaSpec) -> ReplicaProbe:
        ready, sessions = await asyncio.gather(
            self._get(f"{spec.url}/readyz"),
            self._get(spec.sessions_url) if spec.sessions_url else _absent(),
            return_exceptions=True,
        )
        failures = [_failure(r) for r in (ready, sessions) if isinstance(r, BaseException)]
        if isinstance(ready, BaseException):
            is_ready, readiness = None, _failure(ready)
        else:
            status, text = ready
            is_ready = status == 200
            readiness = text.decode(errors="replace").strip()[:MAX_READINESS_CHARS]
        listed: tuple[Listed, ...] | None = None
        if not isinstance(sessions, BaseException) and sessions[0] == 200:
            with contextlib.suppress(ValueError):
                listed = _listed(json.loads(sessions[1]))
        answered = len(failures) < 2
        reach = "answering" if answered else failures[0]
        return ReplicaProbe(spec, reach, is_ready, readiness, listed)

    async def _get(self, url: str) -> tuple[int, bytes]:
        async with self.http.get(url) as answer:
            return answer.status, await answer.content.read(256 * 1024)


async def _absent() -> tuple[int, bytes]:
    return 404, b""


def _dicts(items: object) -> Iterable[dict[str, Any]]:
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []
