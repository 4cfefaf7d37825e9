"""``fleet-sim up`` keeps its fleet up: it notices a process that exits, says so in one line,
starts it again with the same name, address and shards (after the backoff of
:mod:`fleet_sim.restarts`), and rewrites the state file; and it carries out the faults a person
asks for (``fleet-sim fault``, the session page's buttons) on the processes it owns.

Faults go through the supervisor rather than straight to a pid because some of them need what
only the ``up`` process holds: the storage substrate (a partition of a leasefs mount, the JuiceFS
client of a frozen host) and the knowledge that an exit was asked for (``restart``), not suffered.

Threads: :meth:`Supervisor.check` runs on the main thread, :meth:`Supervisor.fault` on the
control endpoint's, and each start on a thread of its own (a replica whose storage hangs must not
stall every other restart or fault); one lock covers the bookkeeping, never a start.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import IO, Any, Final

from fleet_sim.local import Proc
from fleet_sim.restarts import GiveUp, History, RestartPolicy, after_exit
from fleet_sim.sim.substrates import NotApplicable
from fleet_sim.up import LocalFleet

# Each verb a fault may be asked by, and what it does; the second names are the ones
# deploy/*/fault.sh use for the same faults, so a person can type either.
VERBS: Final = {
    "kill": "kill",
    "freeze": "freeze",
    "pause": "freeze",
    "thaw": "thaw",
    "resume": "thaw",
    "drain": "drain",
    "term": "drain",
    "partition": "partition",
    "heal": "heal",
    "hang": "hang",
    "unhang": "unhang",
    "restart": "restart",
    "metadata-restart": "metadata-restart",  # juicefs: its metadata engine, target `metadata`
}
STORAGE_VERBS: Final = frozenset({"partition", "heal", "hang", "unhang"})
ALIASES: Final = {"webui": "page", "control": "control-plane"}


class FaultError(Exception):
    """A fault that was not carried out; ``status`` is the HTTP status the endpoint answers."""

    status = 409


class UnknownVerb(FaultError):
    status = 400


class UnknownTarget(FaultError):
    status = 404


class ChildState(Enum):
    UP = "up"
    FROZEN = "frozen"
    WAITING = "waiting"  # exited; starts again when its backoff ends
    STARTING = "starting"
    DOWN = "down"  # exited under --restart never, or the fleet gave up on it


@dataclass(slots=True)
class Child:
    name: str
    kind: str
    proc: Proc
    history: History
    state: ChildState = ChildState.UP
    due: float = 0.0
    planned: bool = False  # its next exit was asked for (restart): start again at once
    restarts: int = 0
    storage: set[str] = field(default_factory=set)  # storage faults now in force (partition...)


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-returncode).name}"
        return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


class Supervisor:
    def __init__(
        self,
        local: LocalFleet,
        *,
        out: IO[str],
        state_file: Path,
        restart: bool = True,
        policy: RestartPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        extra_state: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.local = local
        self.out = out
        self.state_file = state_file
        self.restart = restart
        self.policy = policy or RestartPolicy()
        self.clock = clock
        self.extra_state = extra_state or dict
        self._lock = threading.RLock()
        self._gave_up: str | None = None
        self._closed = False
        now = clock()
        self.children = {
            name: Child(name, kind, proc, History(now))
            for name, (kind, proc) in local.processes().items()
        }

    # --- the main thread's pass ---

    def check(self) -> str | None:
        """Notice exits and start what is due; the reason the fleet must stop, or None."""
        with self._lock:
            now = self.clock()
            for child in self.children.values():
                if child.state in (ChildState.UP, ChildState.FROZEN):
                    code = child.proc.proc.poll()
                    if code is not None:
                        self._exited(child, code, now)
                if child.state is ChildState.WAITING and child.due <= now:
                    self._launch(child)
            return self._gave_up

    def _exited(self, child: Child, code: int, now: float) -> None:
        what = f"{child.name} ({child.kind}) {describe_exit(code)} (log: {child.proc.log})"
        if child.state is ChildState.FROZEN and child.kind == "replica" and self.local.substrate:
            # The host's file-system client was stopped with it; its successor needs it running.
            # (A partition or a hang is the host's, not the process's: it outlives the exit.)
            with contextlib.suppress(Exception):
                self.local.substrate.thaw(child.name)
        if child.planned:
            child.planned = False
            self._say(f"{what}; starting it again now (restart asked for)")
            self._launch(child)
            return
        if not self.restart:
            child.state = ChildState.DOWN
            self._say(f"{what}; left down (--restart never)")
            return
        decision = after_exit(self.policy, child.history, now)
        if isinstance(decision, GiveUp):
            child.state = ChildState.DOWN
            self._gave_up = f"{child.name} ({child.kind}) cannot stay up: {decision.reason}"
            self._say(f"{what}; giving up")
            return
        child.state, child.due = ChildState.WAITING, now + decision.delay_s
        self._say(f"{what}; starting it again in {decision.delay_s:g} s")

    def _launch(self, child: Child) -> None:
        if self._closed:
            return
        child.state = ChildState.STARTING
        child.history.started_at = self.clock()
        threading.Thread(target=self._start, args=(child,), daemon=True).start()

    def _start(self, child: Child) -> None:
        try:
            proc = self.local.respawn(child.name)
        except Exception as exc:
            with self._lock:
                self._failed_start(child, exc)
            return
        with self._lock:
            child.proc, child.state = proc, ChildState.UP
            child.restarts += 1
            if self._closed:  # the fleet began to stop while this one started: it goes too
                proc.stop()
                return
            self.write_state()
        self._say(f"{child.name} ({child.kind}) is up again (pid {proc.proc.pid})")

    def _failed_start(self, child: Child, exc: Exception) -> None:
        said = str(exc).strip().splitlines()
        what = f"{child.name} ({child.kind}) failed to start: {said[-1] if said else exc!r}"
        decision = after_exit(self.policy, child.history, self.clock())
        if isinstance(decision, GiveUp) or not self.restart:
            child.state = ChildState.DOWN
            if isinstance(decision, GiveUp) and self.restart:
                self._gave_up = f"{child.name} ({child.kind}) cannot stay up: {decision.reason}"
            self._say(f"{what}; left down")
            return
        child.state, child.due = ChildState.WAITING, self.clock() + decision.delay_s
        self._say(f"{what}; trying again in {decision.delay_s:g} s")

    def _say(self, line: str) -> None:
        print(f"fleet-sim up: {line}", file=self.out, flush=True)

    def write_state(self) -> None:
        """The state file, replaced whole (a reader never sees half of it), mode 0600: it
        names the endpoint that takes faults and the token it asks for."""
        state = {**self.local.state(), **self.extra_state()}
        tmp = self.state_file.with_name(f".{self.state_file.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(state, indent=2) + "\n")
        os.replace(tmp, self.state_file)

    # --- faults ---

    def fault(self, verb: str, target: str) -> str:
        """Carry out one fault; what was done, as a sentence. Raises :class:`FaultError`."""
        action = VERBS.get(verb)
        if action is None:
            raise UnknownVerb(f"unknown fault {verb!r}; one of: {', '.join(VERBS)}")
        name = ALIASES.get(target, target)
        if action == "metadata-restart":
            return self._metadata_restart(target)
        with self._lock:
            child = self.children.get(name)
            if child is None:
                raise UnknownTarget(
                    f"no process named {target!r} in this fleet; one of: "
                    + ", ".join(self.children)
                )
            if action == "restart":
                return self._restart(child)
            if action in STORAGE_VERBS:
                return self._storage(child, action)
            if child.state not in (ChildState.UP, ChildState.FROZEN):
                raise FaultError(f"{name} is not running ({child.state.value})")
            pid = child.proc.proc.pid
            if action == "kill":
                os.kill(pid, signal.SIGKILL)
                after = "it starts again shortly" if self.restart else "it stays down"
                return f"killed {name} (pid {pid}) with SIGKILL; {after}"
            if action == "drain":
                child.proc.signal(signal.SIGCONT)
                os.kill(pid, signal.SIGTERM)
                return f"sent SIGTERM to {name} (pid {pid}): it drains and exits"
            if action == "freeze":
                return self._freeze(child, pid)
            return self._thaw(child, pid)

    def _freeze(self, child: Child, pid: int) -> str:
        if child.state is ChildState.FROZEN:
            raise FaultError(f"{child.name} is already frozen")
        os.kill(pid, signal.SIGSTOP)
        child.state = ChildState.FROZEN
        said = f"froze {child.name} (pid {pid}) with SIGSTOP"
        substrate = self.local.substrate
        if child.kind != "replica" or substrate is None:
            return said
        fs_pids = substrate.fs_pids(child.name)
        substrate.freeze(child.name)
        if substrate.name == "leasefs":
            return f"{said}, and its leasefs mount stopped answering as a stopped host's would"
        if substrate.name == "local-dir":
            return f"{said}; on local-dir its lock stays held until it is thawed or killed"
        return f"{said}, and its {substrate.name} client (pids {' '.join(map(str, fs_pids))})"

    def _thaw(self, child: Child, pid: int) -> str:
        if child.state is not ChildState.FROZEN:
            raise FaultError(f"{child.name} is not frozen")
        substrate = self.local.substrate
        if child.kind == "replica" and substrate is not None:
            substrate.thaw(child.name)
        os.kill(pid, signal.SIGCONT)
        child.state = ChildState.UP
        return f"thawed {child.name} (pid {pid}) with SIGCONT"

    def _storage(self, child: Child, action: str) -> str:
        substrate = self.local.substrate
        if child.kind != "replica":
            raise FaultError(
                f"{action} applies to a replica's storage; {child.name} is the {child.kind}"
            )
        if substrate is None:
            raise FaultError(f"{action}: this fleet has no storage substrate to fault")
        try:
            getattr(substrate, action)(child.name)
        except NotApplicable as exc:
            raise FaultError(f"{action} is not possible on {substrate.name}: {exc}") from None
        undo = {"heal": "partition", "unhang": "hang"}
        if action in undo:
            child.storage.discard(undo[action])
            was = "cut off" if action == "heal" else "hung"
            return f"{child.name}'s {substrate.name} mount is no longer {was}"
        child.storage.add(action)
        return f"{action} of {child.name}'s {substrate.name} mount is in force"

    def _metadata_restart(self, target: str) -> str:
        substrate = self.local.substrate
        restart = getattr(substrate, "restart_metadata", None)
        if substrate is None or restart is None:
            where = substrate.name if substrate else "this fleet"
            raise FaultError(f"metadata-restart is not possible on {where}: no metadata engine")
        if target != "metadata":
            raise UnknownTarget(f"metadata-restart takes the target `metadata`, not {target!r}")
        restart()  # outside the lock: the engine's restart takes a while, faults may go on
        return f"killed {substrate.name}'s metadata engine and started it again from its log"

    def _restart(self, child: Child) -> str:
        if child.state in (ChildState.DOWN, ChildState.WAITING):
            self._launch(child)
            return f"starting {child.name} again"
        if child.state is ChildState.STARTING:
            raise FaultError(f"{child.name} is already starting")
        child.planned = True
        child.proc.signal(signal.SIGCONT)
        child.proc.signal(signal.SIGTERM)
        pid = child.proc.proc.pid
        return f"sent SIGTERM to {child.name} (pid {pid}); it starts again once it has drained"

    # --- what a tool sees ---

    def status(self) -> list[dict[str, Any]]:
        with self._lock:
            return [
                {
                    "name": c.name,
                    "kind": c.kind,
                    "pid": c.proc.proc.pid,
                    "state": c.state.value,
                    "restarts": c.restarts,
                    "storage": sorted(c.storage),
                    "log": str(c.proc.log),
                }
                for c in self.children.values()
            ]

    def release(self) -> None:
        """Start nothing more, and undo the faults in force (before the fleet stops, so
        nothing waits on them)."""
        with self._lock:
            self._closed = True
            substrate = self.local.substrate
            for child in self.children.values():
                if substrate is not None and child.kind == "replica":
                    with contextlib.suppress(Exception):
                        if child.state is ChildState.FROZEN:
                            substrate.thaw(child.name)
                    undo = {"partition": substrate.heal, "hang": substrate.unhang}
                    for action in sorted(child.storage):
                        with contextlib.suppress(Exception):
                            undo[action](child.name)
                child.proc.signal(signal.SIGCONT)
                if child.state is ChildState.FROZEN:
                    child.state = ChildState.UP
                child.storage.clear()
