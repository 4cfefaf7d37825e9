"""Scenarios = workload x faults x checkers, and the runner that turns one into results.

A scenario is a function of a :class:`Context` (a fresh fleet on a substrate, its fault package,
a journal) returning claim results. The runner builds the fleet, runs the scenario, grades, and
writes ``<results>/<run>/<scenario>.json`` plus a readable summary; every process and mount it
started is gone when it returns, whatever happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from edge.core.ring import Ring
from fleet_sim.juicefs import JuiceFs
from fleet_sim.keys import derive_tenant_dek
from fleet_sim.sim import checkers
from fleet_sim.sim.checkers import ClaimResult
from fleet_sim.sim.faults import CommandFaults, Faults, LocalFaults
from fleet_sim.sim.fleets import AttachedFleet, FleetView
from fleet_sim.sim.journal import Journal, Op, load
from fleet_sim.sim.substrates import Attached, LeaseFs, LocalDir, NotApplicable, Substrate
from fleet_sim.sim.workload import Session, reachable
from fleet_sim.up import SLICES, LocalFleet, UpConfig, start
from replica.errors import StoreError
from replica.history import History
from replica.store import SessionStore
from wire.names import parse_session_id

T = TypeVar("T")
SUBSTRATES = ("local-dir", "leasefs", "juicefs", "attached")


@dataclass(frozen=True, slots=True)
class AttachedTarget:
    """An external fleet: its state file and the command that injects faults into it."""

    state_file: Path
    fault_cmd: str


@dataclass
class Context:
    name: str
    substrate: Substrate
    fleet: FleetView
    faults: Faults
    journal: Journal
    out_dir: Path
    quick: bool
    seed: int
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def edge(self) -> str:
        return self.fleet.edge_url

    @property
    def local(self) -> LocalFleet:
        """The fleet, for what only a fleet the simulator started can do (add a replica,
        reload the edge, look inside the sandbox simulator)."""
        if not isinstance(self.fleet, LocalFleet):
            raise NotApplicable("needs a fleet the simulator started itself")
        return self.fleet

    def run(self, coroutine: Any) -> Any:
        return asyncio.run(coroutine)

    def tenant_on(self, slice_name: str) -> str:
        """A tenant the control plane places on ``slice_name``."""
        for n in range(1000):
            tenant = f"t{n}-{self.name[:12]}"
            made = self.fleet.new_session(tenant)
            if made["slice"] == slice_name:
                return tenant
        raise RuntimeError(f"no tenant lands on slice {slice_name}")

    def sessions(
        self, count: int, *, tenant: str | None = None, slice_name: str = "a07"
    ) -> list[Session]:
        tenant = tenant or self.tenant_on(slice_name)
        out = []
        for _ in range(count):
            made = self.fleet.new_session(tenant)
            out.append(Session(made["session_id"], tenant, made["grant"]))
        return out

    def refreshed(self, session: Session) -> Session:
        """``session`` with a freshly minted grant (grants expire; sessions do not)."""
        return replace(session, grant=self.fleet.refresh_grant(session.tenant, session.session_id))

    async def fresh_grant(self, session: Session) -> Session:
        return await asyncio.to_thread(self.refreshed, session)

    def members(self, slice_name: str) -> list[str]:
        return [n for n, (s, _) in self.fleet.replicas.items() if s == slice_name]

    def owner(self, session_id: str, members: Sequence[str] | None = None) -> str:
        slice_name = parse_session_id(session_id).slice
        return Ring(tuple(members or self.members(slice_name))).owner(session_id)

    def histories(self, sessions: Sequence[Session]) -> tuple[dict[str, History], dict[str, str]]:
        found: dict[str, History] = {}
        failures: dict[str, str] = {}
        for s in sessions:
            sid = parse_session_id(s.session_id)
            store = SessionStore(self.substrate.backing(str(sid.shard)))
            try:
                found[s.session_id] = store.read(
                    s.tenant, sid, derive_tenant_dek(self.fleet.keys, s.tenant)
                )
            except StoreError as exc:
                failures[s.session_id] = str(exc)
        return found, failures

    def ops(self) -> list[Op]:
        return load(self.journal.path)

    def standard_claims(
        self, sessions: Sequence[Session], *, reach_timeout_s: float = 150.0
    ) -> list[ClaimResult]:
        ops = self.ops()
        histories, failures = self.histories(sessions)
        # With grants of their own: a long run outlives the ones its sessions started with.
        current = [self.refreshed(s) for s in sessions]
        reached = self.run(reachable(self.edge, current, reach_timeout_s))
        return [
            checkers.no_acknowledged_turn_lost_or_duplicated(ops, histories),
            checkers.one_writer_per_epoch(histories),
            checkers.every_transcript_verifies(
                [s.session_id for s in sessions], histories, failures
            ),
            checkers.nobody_gave_up(ops),
            checkers.sessions_reachable(reached),
        ]


ScenarioFn = Callable[[Context], list[ClaimResult]]


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    claims: tuple[str, ...]
    substrates: tuple[str, ...]
    description: str
    run: ScenarioFn
    fleet: dict[str, Any] = field(default_factory=dict)  # UpConfig overrides


CATALOGUE: dict[str, Scenario] = {}


def scenario(
    name: str, *, claims: Sequence[str], substrates: Sequence[str] = SUBSTRATES, **fleet: Any
) -> Callable[[ScenarioFn], ScenarioFn]:
    # A scenario that starts its fleet with other settings (a slow model, a session cap) cannot
    # run on an attached fleet, which was started by somebody else with its own.
    where = tuple(s for s in substrates if not (fleet and s == "attached"))

    def register(fn: ScenarioFn) -> ScenarioFn:
        CATALOGUE[name] = Scenario(
            name,
            tuple(claims),
            where,
            " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split()),
            fn,
            fleet,
        )
        return fn

    return register


def make_substrate(name: str, root: Path) -> Substrate:
    if name == "local-dir":
        return LocalDir(root)
    if name == "leasefs":
        return LeaseFs(root)
    if name == "juicefs":
        return JuiceFs(root)
    raise NotApplicable(f"substrate {name} needs an attached fleet (--state, --fault-cmd)")


def run_scenario(
    item: Scenario,
    substrate_name: str,
    out_dir: Path,
    *,
    quick: bool = False,
    seed: int = 0,
    attached: AttachedTarget | None = None,
) -> dict[str, Any]:
    """Build a fleet (or, with ``attached``, use the one its state file describes), run one
    scenario on it, grade, tear down what was started; the result dict."""
    started = time.time()
    root = out_dir / f"{item.name}.{substrate_name}"
    root.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "scenario": item.name,
        "substrate": substrate_name,
        "started": started,
        "claims": [],
    }
    substrate: Substrate | None = None
    fleet: FleetView | None = None
    journal = Journal(root / "journal.jsonl")
    faults: Faults | None = None
    try:
        shards = [s for shards in SLICES.values() for s in shards]
        if attached is not None:
            outside = AttachedFleet.load(attached.state_file)
            substrate = Attached(attached.fault_cmd, outside.shards, outside.lease_s)
            substrate.prepare([], shards)
            commands = CommandFaults(
                attached.fault_cmd, {name: r.url for name, (_, r) in outside.replicas.items()}
            )
            commands.restore()  # whatever an earlier run left down comes back first
            fleet, faults = outside, commands
        else:
            substrate = make_substrate(substrate_name, root)
            substrate.prepare([], shards)
            overrides = {
                "model": "mock",
                "drain_grace_s": 10.0,
                "idle_timeout_s": 60.0,
                **item.fleet,
            }
            config = UpConfig(state_dir=root / "fleet", listen="127.0.0.1:0", **overrides)
            local = start(config, _mounting(substrate))
            fleet, faults = local, LocalFaults(local)
        context = Context(item.name, substrate, fleet, faults, journal, root, quick, seed)
        claims = item.run(context)
        result["claims"] = [c.as_dict() for c in claims]
        result["notes"] = context.notes
        verdicts = {c.verdict for c in claims}
        result["verdict"] = (
            "fail"
            if "fail" in verdicts or not claims
            else "unknown"
            if "unknown" in verdicts
            else "pass"
        )
    except NotApplicable as exc:
        result["verdict"], result["error"] = "skipped", str(exc)
    except Exception as exc:
        result["verdict"] = "fail"
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
    finally:
        journal.close()
        if fleet is not None:
            fleet.stop(drain_timeout_s=20)
        if isinstance(faults, CommandFaults):
            with contextlib.suppress(Exception):
                result["restarted_after"] = faults.restore()
        if substrate is not None:
            substrate.close()
    result["seconds"] = round(time.time() - started, 2)
    (out_dir / f"{item.name}.{substrate_name}.json").write_text(json.dumps(result, indent=2))
    return result


def _mounting(substrate: Substrate) -> Callable[[str, str], Path]:
    def shard_path(replica: str, shard: str) -> Path:
        if isinstance(substrate, LeaseFs | JuiceFs):
            substrate.mount(replica)
        return substrate.shard_path(replica, shard)

    return shard_path


def new_run_dir(results: Path, label: str) -> Path:
    run = results / f"{time.strftime('%Y%m%d-%H%M%S')}-{label}-{secrets.token_hex(2)}"
    run.mkdir(parents=True, exist_ok=True)
    return run


def summary_table(results: Sequence[dict[str, Any]]) -> str:
    lines = ["| scenario | substrate | verdict | seconds | claims |", "|---|---|---|---|---|"]
    for r in results:
        claims = ", ".join(f"{c['claim']}={c['verdict']}" for c in r.get("claims", []))
        extra = f" ({r['error']})" if r.get("error") else ""
        lines.append(
            f"| {r['scenario']} | {r['substrate']} | {r['verdict']}{extra} | "
            f"{r.get('seconds', '')} | {claims} |"
        )
    return "\n".join(lines) + "\n"


def write_summary(run_dir: Path, results: Sequence[dict[str, Any]]) -> str:
    table = summary_table(results)
    (run_dir / "summary.md").write_text(table)
    (run_dir / "results.json").write_text(json.dumps(list(results), indent=2))
    return table
