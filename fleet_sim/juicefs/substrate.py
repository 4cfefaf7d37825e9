"""The ``juicefs`` substrate: the fleet's shards on a real distributed file system.

One Redis server the fleet owns is the metadata engine; one volume is formatted on it with a
local ``file`` bucket; each simulated host (replica) gets its own JuiceFS mount, reaching Redis
through its own relay, and the simulator's graders read through one more mount of their own that
no fault ever touches::

    root/redis/            the engine's AOF, configuration and log
    root/bucket/           the volume's data blocks
    root/mnt/<replica>/    that host's mount; a shard is a directory in it
    root/grader/           the graders' mount (backing())
    root/cache/<host>/     each client's read cache
    root/logs/             each client's and relay's log, the format's and the warden's

A warden process is told of every process and mount; should the simulator die without
``close()``, it ends them (see ``warden.py``).

The faults are real ones:

- ``freeze``: the host's client (supervisor and worker) is stopped with the replica; nothing
  renews its session, so a live client cleans it up, and its locks, 5 heartbeats later;
- ``partition``: the host's relay black-holes its metadata connections while the replica runs
  on; the session expires the same way, and the client carries on once healed;
- ``hang``: the host's worker alone is stopped, so the mount answers nothing while the replica
  runs on (and the session expires as above if the hang outlives 5 heartbeats);
- ``restart_metadata``: Redis is killed and restarted from its AOF on the same port.

JuiceFS fences nothing: a thawed or healed client whose session was cleaned up carries on with
its old descriptors as though it still held its locks. Only the replica's epoch fence stops it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from fleet_sim.juicefs.mount import ClientOptions, JuiceFsMount, format_volume
from fleet_sim.juicefs.redis import RedisConfig, RedisServer, url_for
from fleet_sim.juicefs.relay import RelayProcess
from fleet_sim.juicefs.warden import Warden

GRADER = "grader"


@dataclass(frozen=True, slots=True)
class JuiceFsConfig:
    # 2 s: a stopped or cut-off client's locks go after about 10-12 s, well inside the edge's
    # 120 s retry budget, while a heartbeat every 2 s costs Redis nothing worth measuring.
    heartbeat_s: float = 2.0
    volume: str = "fleet"
    cache_size_mib: int = 256
    redis_start_budget_s: float = 15.0
    format_budget_s: float = 30.0
    start_budget_s: float = 20.0
    stop_budget_s: float = 10.0

    @property
    def client(self) -> ClientOptions:
        return ClientOptions(
            heartbeat_s=self.heartbeat_s,
            cache_size_mib=self.cache_size_mib,
            format_budget_s=self.format_budget_s,
            start_budget_s=self.start_budget_s,
            stop_budget_s=self.stop_budget_s,
        )


class JuiceFs:
    name = "juicefs"

    def __init__(self, root: Path, config: JuiceFsConfig | None = None) -> None:
        self.root = root
        self.config = config or JuiceFsConfig()
        self.redis: RedisServer | None = None
        self.grader: JuiceFsMount | None = None
        self.relays: dict[str, RelayProcess] = {}
        self.mounts: dict[str, JuiceFsMount] = {}
        self.warden: Warden | None = None
        # Replicas are mounted lazily, when the fleet first asks for a shard's path; one lock
        # keeps two first asks from making two mounts of one host.
        self._lock = threading.RLock()

    # -- paths -----------------------------------------------------------------------------

    def shard_path(self, replica: str, shard: str) -> Path:
        return self.root / "mnt" / replica / shard

    def backing(self, shard: str) -> Path:
        return self.root / GRADER / shard

    def mount_dir(self, replica: str) -> Path | None:
        return self.root / "mnt" / replica

    def _log(self, name: str) -> Path:
        logs = self.root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        return logs / f"{name}.log"

    # -- set-up ----------------------------------------------------------------------------

    def prepare(self, replicas: list[str], shards: list[str]) -> None:
        self.volume()
        for shard in shards:
            self.backing(shard).mkdir(parents=True, exist_ok=True)
        for replica in replicas:
            self.mount(replica)

    def volume(self) -> RedisServer:
        """The engine, started and formatted, with the graders' mount; made on first use."""
        with self._lock:
            if self.redis is not None:
                return self.redis
            if self.warden is None:
                self.warden = Warden(self._log("warden"))
                self.warden.start()
            redis = RedisServer(
                RedisConfig(self.root / "redis", start_budget_s=self.config.redis_start_budget_s)
            )
            redis.start()  # stops what it started if it fails
            try:
                self.warden.watch(pid=redis.pid)
                format_volume(
                    redis.url,
                    self.root / "bucket",
                    self.config.volume,
                    self._log("format"),
                    self.config.format_budget_s,
                )
                # Straight to Redis, not through a relay: the graders are never partitioned.
                self.grader = self._start_mount(GRADER, redis.url, self.root / GRADER)
            except BaseException:
                redis.stop()
                raise
            self.redis = redis
            return redis

    def mount(self, replica: str) -> None:
        """``replica``'s host: its relay and its mount, unless it has them already."""
        with self._lock:
            if replica in self.mounts:
                return
            redis = self.volume()
            relay = self.relays.get(replica)
            if relay is None:
                relay = RelayProcess(
                    redis.port, self._log(f"relay-{replica}"), self.config.stop_budget_s
                )
                relay.start()  # stops what it started if it fails
                self.relays[replica] = relay
                self._watch(relay.pid)
            self.mounts[replica] = self._start_mount(
                replica, url_for(relay.port), self.root / "mnt" / replica
            )

    def _start_mount(self, host: str, meta_url: str, mountpoint: Path) -> JuiceFsMount:
        mount = JuiceFsMount(
            meta_url,
            mountpoint,
            self.root / "cache" / host,
            self._log(f"mount-{host}"),
            self.config.client,
        )
        if self.warden is not None:
            self.warden.watch(mount=mountpoint)
        mount.start()  # stops what it started if it fails
        self._watch(mount.supervisor_pid)  # the warden finds the worker as its child
        return mount

    def _watch(self, pid: int | None) -> None:
        if self.warden is not None:
            self.warden.watch(pid=pid)

    # -- processes and faults --------------------------------------------------------------

    def fs_pids(self, replica: str) -> list[int]:
        mount = self.mounts.get(replica)
        return [] if mount is None else mount.pids()

    def pids(self) -> list[int]:
        """Every process the substrate runs now: the warden, Redis, each relay, each client's
        two."""
        found = [] if self.warden is None or self.warden.pid is None else [self.warden.pid]
        found += [] if self.redis is None or self.redis.pid is None else [self.redis.pid]
        found += [r.pid for r in self.relays.values() if r.pid is not None]
        for mount in [*self.mounts.values(), *([self.grader] if self.grader else [])]:
            found += mount.pids()
        return found

    def freeze(self, replica: str) -> None:
        """The host's client stops with its replica (which the caller stops)."""
        self.mounts[replica].freeze()

    def thaw(self, replica: str) -> None:
        self.mounts[replica].thaw()

    def partition(self, replica: str) -> None:
        self.relays[replica].partition()

    def heal(self, replica: str) -> None:
        self.relays[replica].heal()

    def hang(self, replica: str) -> None:
        self.mounts[replica].hang()

    def unhang(self, replica: str) -> None:
        self.mounts[replica].unhang()

    def restart_metadata(self) -> None:
        """Redis is killed outright and started again from its AOF, on the same port."""
        redis = self.volume()
        redis.restart()
        self._watch(redis.pid)

    # -- tear-down -------------------------------------------------------------------------

    def close(self) -> None:
        """Every mount unmounted and every process ended, within the stop budgets; never
        raises."""
        with self._lock:
            # Healed first: a client cut off from Redis could not close its session.
            for relay in self.relays.values():
                with contextlib.suppress(Exception):
                    relay.heal()
            mounts = [*self.mounts.values(), *([self.grader] if self.grader else [])]
            if mounts:
                # In parallel: each stop is bounded, and a fleet has a dozen mounts.
                with ThreadPoolExecutor(max_workers=len(mounts)) as pool:
                    for mount in mounts:
                        pool.submit(_quietly, mount.stop)
            for relay in self.relays.values():
                _quietly(relay.stop)
            if self.redis is not None:
                _quietly(self.redis.stop)
            if self.warden is not None:
                _quietly(self.warden.release)  # all is ended: nothing left for it to do
            self.mounts.clear()
            self.relays.clear()
            self.grader = None
            self.redis = None
            self.warden = None


def _quietly(stop: Callable[[], None]) -> None:
    with contextlib.suppress(Exception):
        stop()
