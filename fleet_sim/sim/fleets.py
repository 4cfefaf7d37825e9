"""What a scenario sees of the fleet it runs on: a local one it started itself, or an attached
one somebody else started (the NFS harness, the EFS proof) and described in a state file.

Scenarios talk to the fleet only through :class:`FleetView`. What only a local fleet can do
(start a new replica, reload the edge, look inside the sandbox simulator) is reached through
``Context.local``, which answers ``NotApplicable`` on an attached fleet.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from edge.core.config import load_config
from edge.core.errors import ConfigError
from edge.core.retry import DEFAULT_BUDGET_S
from fleet_sim.control_plane import GRANT_TTL_S
from fleet_sim.keys import KeySet, load_keyset
from fleet_sim.sim.substrates import NotApplicable
from fleet_sim.up import request_grant, request_session


class ReplicaView(Protocol):
    @property
    def url(self) -> str: ...

    @property
    def metrics_url(self) -> str | None: ...


class FleetView(Protocol):
    @property
    def edge_url(self) -> str: ...

    @property
    def edge_metrics_url(self) -> str | None: ...

    @property
    def control_plane_url(self) -> str: ...

    @property
    def replicas(self) -> Mapping[str, tuple[str, ReplicaView]]: ...  # name -> (slice, r)

    @property
    def keys(self) -> KeySet: ...

    @property
    def keys_dir(self) -> Path: ...

    @property
    def retry_budget_s(self) -> float: ...

    @property
    def grant_ttl_s(self) -> float: ...

    def new_session(self, tenant: str = "demo") -> dict[str, Any]: ...

    def refresh_grant(self, tenant: str, session_id: str) -> str: ...

    def stop(self, drain_timeout_s: float = 30.0) -> None: ...


@dataclass(frozen=True, slots=True)
class AttachedReplica:
    name: str
    url: str
    metrics_url: str | None


class AttachedFleet:
    """A fleet described by a state file (deploy/attached-local/up.sh, deploy/efs-proof): the
    simulator sends it traffic and reads its shards but never starts or stops it."""

    def __init__(self, state: Mapping[str, Any], state_file: Path) -> None:
        self.state_file = state_file
        try:
            self._edge_url = str(state["edge_url"])
            self._control_plane_url = str(state["control_plane_url"])
            self._keys_dir = Path(state["keys_dir"])
            replicas = state["replicas"]
            shards = state["shards"]
            if not isinstance(replicas, list) or not replicas or not isinstance(shards, dict):
                raise TypeError("needs a list of replicas and a map of shards")
            self._replicas: dict[str, tuple[str, ReplicaView]] = {}
            for entry in replicas:
                name = str(entry["name"])
                metrics = entry.get("metrics_url")
                self._replicas[name] = (
                    str(entry["slice"]),
                    AttachedReplica(name, str(entry["url"]), str(metrics) if metrics else None),
                )
            self.shards = {str(k): Path(v) for k, v in shards.items()}
            self.lease_s = float(state.get("lease_s") or 0.0)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise AttachedError(f"{state_file}: not an attached fleet's state ({exc})") from None
        metrics = state.get("edge_metrics_url")
        self._edge_metrics_url = str(metrics) if metrics else None
        self._retry_budget_s = _edge_budget(state.get("edge_config"))
        self._keys: KeySet | None = None

    @classmethod
    def load(cls, state_file: Path) -> AttachedFleet:
        try:
            state = json.loads(state_file.read_text())
        except OSError as exc:
            raise AttachedError(f"cannot read the state file {state_file}: {exc}") from None
        except json.JSONDecodeError as exc:
            raise AttachedError(f"{state_file} is not JSON: {exc}") from None
        if not isinstance(state, dict):
            raise AttachedError(f"{state_file}: expected a JSON object")
        return cls(state, state_file)

    @property
    def edge_url(self) -> str:
        return self._edge_url

    @property
    def edge_metrics_url(self) -> str | None:
        return self._edge_metrics_url

    @property
    def control_plane_url(self) -> str:
        return self._control_plane_url

    @property
    def replicas(self) -> Mapping[str, tuple[str, ReplicaView]]:
        return self._replicas

    @property
    def keys(self) -> KeySet:
        if self._keys is None:
            self._keys = load_keyset(self._keys_dir)
        return self._keys

    @property
    def keys_dir(self) -> Path:
        return self._keys_dir

    @property
    def retry_budget_s(self) -> float:
        return self._retry_budget_s

    @property
    def grant_ttl_s(self) -> float:
        # The harnesses start the simulator's control plane with its default lifetime.
        return float(GRANT_TTL_S)

    def new_session(self, tenant: str = "demo") -> dict[str, Any]:
        return request_session(self._control_plane_url, tenant)

    def refresh_grant(self, tenant: str, session_id: str) -> str:
        return request_grant(self._control_plane_url, tenant, session_id)

    def stop(self, drain_timeout_s: float = 30.0) -> None:
        """An attached fleet outlives the run: nothing to stop."""


class AttachedError(NotApplicable):
    """The attached fleet's state file cannot be used."""


def _edge_budget(config: object) -> float:
    """The edge's retry budget from its config when the state names a readable one (on the
    EFS proof it lives in the task definition instead: the default is assumed)."""
    if not config:
        return DEFAULT_BUDGET_S
    try:
        return load_config(str(config)).options.retry_budget_s
    except ConfigError:
        return DEFAULT_BUDGET_S
