"""Where the shards of a simulated fleet live, and the storage faults each place can suffer.

- ``local-dir``: plain directories shared by every replica; only process faults apply.
- ``leasefs``: one backing directory and, per replica host, its own leasefs mount of it, so
  locks conflict across hosts as on NFSv4, and a host can be partitioned, hung, made read-only.
- ``juicefs``: a real distributed file system (``fleet_sim.juicefs``): a Redis metadata engine the
  fleet owns, one JuiceFS mount per host; a frozen or partitioned host's locks go when its
  session expires (5 heartbeats), and the engine itself can be restarted.
- ``attached``: an external fleet (real NFS or EFS) described by a state file and driven through
  a fault command; shards are read from the paths its state names.
"""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Protocol

from fleet_sim.leasefs.mount import LeaseFsMount, mount_leasefs


class NotApplicable(Exception):
    """The substrate cannot produce this fault; the scenario does not run on it."""


class Substrate(Protocol):
    name: str

    def shard_path(self, replica: str, shard: str) -> Path: ...

    def backing(self, shard: str) -> Path: ...

    def prepare(self, replicas: list[str], shards: list[str]) -> None: ...

    def mount_dir(self, replica: str) -> Path | None: ...  # that host's mount; None: no mount

    def fs_pids(self, replica: str) -> list[int]: ...  # that host's file-system client processes

    def freeze(self, replica: str) -> None: ...  # the host's storage side of a stopped host

    def thaw(self, replica: str) -> None: ...

    def partition(self, replica: str) -> None: ...

    def heal(self, replica: str) -> None: ...

    def hang(self, replica: str) -> None: ...

    def unhang(self, replica: str) -> None: ...

    def close(self) -> None: ...


class NoHostClient:
    """Storage with no file-system client of its own on the replica's host to name or stop."""

    def mount_dir(self, replica: str) -> Path | None:
        return None

    def fs_pids(self, replica: str) -> list[int]:
        return []


class LocalDir(NoHostClient):
    name = "local-dir"

    def __init__(self, root: Path) -> None:
        self.root = root / "shards"

    def shard_path(self, replica: str, shard: str) -> Path:
        return self.root / shard

    def backing(self, shard: str) -> Path:
        return self.root / shard

    def prepare(self, replicas: list[str], shards: list[str]) -> None:
        for shard in shards:
            (self.root / shard).mkdir(parents=True, exist_ok=True)

    def freeze(self, replica: str) -> None:
        """Nothing but the replica process stops: its descriptors, and so its locks, stay."""

    thaw = freeze

    def partition(self, replica: str) -> None:
        raise NotApplicable("a local directory cannot be partitioned")

    heal = partition
    hang = partition
    unhang = partition

    def close(self) -> None:
        pass


class LeaseFs:
    name = "leasefs"

    def __init__(self, root: Path, lease_s: float = 3.0) -> None:
        self.root = root
        self.lease_s = lease_s
        self.mounts: dict[str, LeaseFsMount] = {}

    def shard_path(self, replica: str, shard: str) -> Path:
        return self.root / "mnt" / replica / shard

    def backing(self, shard: str) -> Path:
        return self.root / "backing" / shard

    def prepare(self, replicas: list[str], shards: list[str]) -> None:
        for shard in shards:
            self.backing(shard).mkdir(parents=True, exist_ok=True)
        for replica in replicas:
            self.mount(replica)

    def mount(self, replica: str) -> None:
        if replica in self.mounts:
            return
        mountpoint = self.root / "mnt" / replica
        mountpoint.mkdir(parents=True, exist_ok=True)
        mount = mount_leasefs(
            str(self.root / "backing"),
            str(mountpoint),
            replica,
            self.lease_s,
            log_path=str(self.root / f"leasefs-{replica}.log"),
        )
        mount.start()
        self.mounts[replica] = mount

    def mount_dir(self, replica: str) -> Path | None:
        return self.root / "mnt" / replica

    def fs_pids(self, replica: str) -> list[int]:
        mount = self.mounts.get(replica)
        pid = mount.pid if mount is not None else None
        return [pid] if pid is not None else []

    def freeze(self, replica: str) -> None:
        # A host that stops stops renewing its NFSv4 lease: the server revokes its locks after the
        # lease time. Stopping the leasefs daemon would instead keep them forever (it holds them
        # on the backing files), so the host's side of a freeze is a partition of its mount.
        self.partition(replica)

    def thaw(self, replica: str) -> None:
        self.heal(replica)

    def partition(self, replica: str) -> None:
        self.mounts[replica].control.partition()

    def heal(self, replica: str) -> None:
        self.mounts[replica].control.heal()

    def hang(self, replica: str) -> None:
        self.mounts[replica].control.hang()

    def unhang(self, replica: str) -> None:
        self.mounts[replica].control.ok()

    def close(self) -> None:
        for mount in self.mounts.values():
            with contextlib.suppress(Exception):
                mount.stop()
        self.mounts.clear()


# A fault command's exit status for "this fault does not apply to this fleet's storage" (a
# partition on bind mounts, a pause on a managed container service).
NOT_APPLICABLE_EXIT = 3


def run_fault_command(command: str, verb: str, replica: str, timeout_s: float = 300.0) -> None:
    """``COMMAND VERB REPLICA``; exit 3 becomes :class:`NotApplicable`, any other failure a
    ``RuntimeError`` carrying what the command said."""
    try:
        done = subprocess.run(
            [command, verb, replica], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"fault command {command} {verb} {replica}: {exc}") from None
    said = (done.stderr or done.stdout).strip().splitlines()
    last = said[-1] if said else ""
    if done.returncode == NOT_APPLICABLE_EXIT:
        raise NotApplicable(f"{verb} does not apply to this fleet: {last}")
    if done.returncode != 0:
        raise RuntimeError(f"{command} {verb} {replica} exited {done.returncode}: {last}")


class Attached(NoHostClient):
    """An external fleet's storage: faults go to ``fault_cmd`` (e.g.
    deploy/attached-local/fault.sh) and shards are read where its state file says the export
    is, so a grader never waits on a partitioned replica's mount."""

    name = "attached"

    def __init__(self, fault_cmd: str, shard_paths: dict[str, Path], lease_s: float = 0.0) -> None:
        self.fault_cmd = fault_cmd
        self.paths = shard_paths
        self.lease_s = lease_s

    def shard_path(self, replica: str, shard: str) -> Path:
        return self.paths[shard]

    def backing(self, shard: str) -> Path:
        return self.paths[shard]

    def prepare(self, replicas: list[str], shards: list[str]) -> None:
        missing = [s for s in shards if s not in self.paths]
        if missing:
            raise NotApplicable(f"the attached fleet has no shard {', '.join(missing)}")

    def freeze(self, replica: str) -> None:
        """The fault command's pause stops the whole host (its container or VM)."""

    thaw = freeze

    def partition(self, replica: str) -> None:
        run_fault_command(self.fault_cmd, "partition", replica)

    def heal(self, replica: str) -> None:
        run_fault_command(self.fault_cmd, "heal", replica)

    def hang(self, replica: str) -> None:
        run_fault_command(self.fault_cmd, "hang", replica)

    def unhang(self, replica: str) -> None:
        run_fault_command(self.fault_cmd, "unhang", replica)

    def close(self) -> None:
        pass
