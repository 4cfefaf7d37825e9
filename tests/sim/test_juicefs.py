"""The juicefs substrate on real processes: a Redis server, a formatted volume, two hosts' mounts
and the graders' mount, and each fault it offers.

The ``juicefs`` tests need redis-server, the juicefs binary of the dev extras and FUSE; where one
is missing they fail (never skip): CI installs all three. Takeover times are printed and recorded
as junit properties.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import pytest

from fleet_sim.juicefs import (
    FormatFailed,
    JuiceFs,
    JuiceFsConfig,
    JuiceFsMount,
    MetadataFailed,
    MountFailed,
    RedisConfig,
    RedisServer,
    format_volume,
)
from fleet_sim.juicefs.binaries import juicefs_binary
from fleet_sim.juicefs.mount import ClientOptions, mount_argv
from fleet_sim.juicefs.procs import alive, state
from fleet_sim.juicefs.redis import config_text, url_for
from fleet_sim.ports import free_port
from tests.harness import eventually

T = TypeVar("T")
HEARTBEAT_S = 1.0
SESSION_S = 5 * HEARTBEAT_S  # a client whose heartbeats stop keeps its session this long
# Expiry is kept in whole seconds and swept once a heartbeat by a live client (with jitter).
TAKEOVER_BUDGET_S = SESSION_S + 3 * HEARTBEAT_S + 2.0
_FLOCK = struct.Struct("@hhqqi4x")

# A replica's lock, in a process of its own: an OFD write lock held by an open descriptor on a
# host's mount; each stdin line is appended through that descriptor and fsync'd.
HOLDER = r"""
import fcntl, os, struct, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("@hhqqi4x", fcntl.F_WRLCK, 0, 0, 0, 0))
print("locked", flush=True)
for line in sys.stdin:
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
        print("wrote", flush=True)
    except OSError as exc:
        print(f"error {exc.errno}", flush=True)
"""


# -- helpers ------------------------------------------------------------------------------------


def wait_for(predicate: Callable[[], T | None], within_s: float, what: str) -> T:
    """``predicate()``'s first truthy value, or fail after ``within_s`` saying ``what``."""
    value: T = eventually(predicate, timeout=within_s, message=f"{what}: not within {within_s:g}s")
    return value


class Call:
    """A file-system call in a daemon thread, so a test can tell one that hangs from one that
    answers without hanging itself."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:
            self.error = exc

    def answered(self, within_s: float) -> bool:
        self._thread.join(within_s)
        return not self._thread.is_alive()


def lock(path: Path) -> int | None:
    """An OFD write lock on ``path``: its descriptor, or None while another holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def mounted_under(root: Path) -> list[str]:
    found = []
    with open("/proc/mounts", encoding="utf-8") as mounts:
        for line in mounts:
            target = line.split()[1].replace("\\040", " ")
            if target.startswith(str(root)):
                found.append(target)
    return found


class Holder:
    """A process holding a lock through a host's mount (the replica's part of a host)."""

    def __init__(self, path: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.said() == "locked"

    def said(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def append(self, line: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.said()

    def end(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.kill()
        self.proc.wait(timeout=10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[JuiceFs]:
    root = tmp_path / "jfs"
    substrate = JuiceFs(root, JuiceFsConfig(heartbeat_s=HEARTBEAT_S))
    try:
        substrate.prepare(["a", "b"], ["s"])
        yield substrate
    finally:
        started = substrate.pids()
        substrate.close()
    assert [pid for pid in started if alive(pid)] == []
    assert mounted_under(root) == []


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    made: list[Holder] = []
    yield made
    for holder in made:
        holder.end()  # before the substrate closes: a descriptor on a mount keeps it busy


# -- what the substrate asks of JuiceFS and Redis (no processes) ----------------------------


def test_every_mount_is_told_what_the_design_depends_on(tmp_path: Path) -> None:
    argv = mount_argv(
        Path("juicefs"), "redis://x/1", tmp_path, tmp_path / "c", ClientOptions(heartbeat_s=2.0)
    )
    joined = " ".join(argv)
    for flags in (
        "--no-usage-report",
        "--no-agent",
        "--backup-meta 0",
        "--heartbeat 2s",
        "--attr-cache 0",
        "--entry-cache 0",
        "--dir-entry-cache 0",
        "--negative-entry-cache 0",
        "--open-cache 0",
        "--metrics 127.0.0.1:0",
        "--hide-internal",
    ):
        assert flags in joined
    assert "--writeback" not in argv and "-d" not in argv and "--background" not in argv


def test_the_engine_keeps_every_acknowledged_write(tmp_path: Path) -> None:
    conf = config_text(tmp_path, 1234).splitlines()
    for line in (
        "appendonly yes",
        "appendfsync always",
        "maxmemory-policy noeviction",
        "bind 127.0.0.1",
        'save ""',
    ):
        assert line in conf


# -- real processes -----------------------------------------------------------------------------


@pytest.mark.juicefs
@pytest.mark.timeout(60)
def test_two_hosts_see_one_volume(fs: JuiceFs) -> None:
    a, b = fs.shard_path("a", "s"), fs.shard_path("b", "s")
    write_synced(a / "seg-1", b"written on a\n")
    assert (b / "seg-1").read_bytes() == b"written on a\n"
    assert fs.backing("s").joinpath("seg-1").read_bytes() == b"written on a\n"
    # No lookup caching: a name made on one host is there at once on the other.
    (b / "sessions").mkdir()
    assert (a / "sessions").is_dir()
    fd = os.open(a / "seg-2", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    os.close(fd)
    with pytest.raises(FileExistsError):
        os.open(b / "seg-2", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    # JuiceFS's virtual files are out of a walker's way (an endless .accesslog), not gone.
    assert sorted(os.listdir(a.parent)) == ["s"]
    assert (a.parent / ".config").is_file()
    assert fs.mount_dir("a") == a.parent
    assert len(fs.fs_pids("a")) == 2 and set(fs.fs_pids("a")).isdisjoint(fs.fs_pids("b"))


@pytest.mark.juicefs
@pytest.mark.timeout(60)
def test_an_ofd_lock_conflicts_across_hosts(fs: JuiceFs) -> None:
    on_a = lock(fs.shard_path("a", "s") / "lock")
    assert on_a is not None
    assert lock(fs.shard_path("b", "s") / "lock") is None
    os.close(on_a)  # the description's last descriptor: the lock goes with it
    on_b = wait_for(lambda: lock(fs.shard_path("b", "s") / "lock"), 5, "b takes the released lock")
    os.close(on_b)


@pytest.mark.juicefs
@pytest.mark.timeout(90)
def test_a_frozen_hosts_lock_passes_after_its_session_expires(
    fs: JuiceFs, holders: list[Holder], record_property: Callable[[str, object], None]
) -> None:
    holder = Holder(fs.shard_path("a", "s") / "lock")
    holders.append(holder)
    assert lock(fs.shard_path("b", "s") / "lock") is None
    holder.proc.send_signal(signal.SIGSTOP)
    fs.freeze("a")
    frozen_at = time.monotonic()
    assert {state(pid) for pid in fs.fs_pids("a")} == {"T"}
    on_b = wait_for(
        lambda: lock(fs.shard_path("b", "s") / "lock"), TAKEOVER_BUDGET_S, "b takes a's lock"
    )
    took = time.monotonic() - frozen_at
    print(f"freeze -> takeover: {took:.2f}s (heartbeat {HEARTBEAT_S:g}s)")
    record_property("freeze_takeover_s", round(took, 2))
    # The lock outlived the stop: only the session's expiry moved it.
    assert took > 2 * HEARTBEAT_S
    fs.thaw("a")
    holder.proc.send_signal(signal.SIGCONT)
    # A's client finds its session was cleaned up, and carries on with a new one.
    log = fs.root / "logs" / "mount-a.log"
    wait_for(lambda: "was stale and cleaned up" in log.read_text(), 5 * HEARTBEAT_S, "a notices")
    assert Call(lambda: os.listdir(fs.shard_path("a", "s"))).answered(5)
    # Nothing fences the stale holder: its old descriptor still writes. Only the epoch fence
    # of the replica stops a stale owner.
    assert holder.append("stale write") == "wrote"
    assert lock(fs.shard_path("a", "s") / "lock") is None  # b holds it now
    os.close(on_b)


@pytest.mark.juicefs
@pytest.mark.timeout(90)
def test_a_partitioned_hosts_lock_passes_while_its_holder_runs(
    fs: JuiceFs, holders: list[Holder], record_property: Callable[[str, object], None]
) -> None:
    holder = Holder(fs.shard_path("a", "s") / "lock")
    holders.append(holder)
    fs.partition("a")
    cut_at = time.monotonic()
    on_b = wait_for(
        lambda: lock(fs.shard_path("b", "s") / "lock"), TAKEOVER_BUDGET_S, "b takes a's lock"
    )
    took = time.monotonic() - cut_at
    # The graders read through a mount of their own, which no partition reaches.
    assert Call(lambda: fs.backing("s").joinpath("lock").exists()).answered(2)
    print(f"partition -> takeover: {took:.2f}s (heartbeat {HEARTBEAT_S:g}s)")
    record_property("partition_takeover_s", round(took, 2))
    assert took > 2 * HEARTBEAT_S
    # The holder and A's client ran on throughout: only their link to Redis was cut.
    assert state(holder.proc.pid) in ("S", "R")
    assert all(state(pid) in ("S", "R") for pid in fs.fs_pids("a"))
    fs.heal("a")
    listing = Call(lambda: os.listdir(fs.shard_path("a", "s")))
    assert listing.answered(4 * SESSION_S), "a's mount still not answering after the heal"
    assert listing.error is None and "lock" in listing.result
    os.close(on_b)


@pytest.mark.juicefs
@pytest.mark.timeout(60)
def test_a_hung_mount_answers_nothing_until_unhung(fs: JuiceFs, holders: list[Holder]) -> None:
    holder = Holder(fs.shard_path("a", "s") / "lock")
    holders.append(holder)
    supervisor, worker = fs.fs_pids("a")
    fs.hang("a")
    stat = Call(lambda: os.stat(fs.shard_path("a", "s") / "lock"))
    assert not stat.answered(1.0)
    # The replica's side and the other hosts run on; only A's worker is stopped.
    assert state(holder.proc.pid) in ("S", "R")
    assert state(worker) == "T" and state(supervisor) != "T"
    assert Call(lambda: os.stat(fs.shard_path("b", "s") / "lock")).answered(2)
    fs.unhang("a")
    assert stat.answered(5) and stat.error is None
    assert Call(lambda: os.listdir(fs.shard_path("a", "s"))).answered(5)


@pytest.mark.juicefs
@pytest.mark.timeout(60)
def test_a_metadata_restart_keeps_what_was_fsynced(fs: JuiceFs) -> None:
    assert fs.redis is not None
    before = fs.redis.pid
    content = os.urandom(100_000)
    write_synced(fs.shard_path("a", "s") / "seg-1", content)
    fs.restart_metadata()
    assert fs.redis.pid not in (None, before)

    def read(host: str) -> bytes | None:
        try:
            return (fs.shard_path(host, "s") / "seg-1").read_bytes()
        except OSError:
            return None  # a client still reconnecting

    for host in ("a", "b"):
        assert wait_for(partial(read, host), 30, f"{host} reads after the restart") == content
    write_synced(fs.shard_path("b", "s") / "seg-2", b"after")
    assert (fs.shard_path("a", "s") / "seg-2").read_bytes() == b"after"


@pytest.mark.juicefs
@pytest.mark.timeout(60)
def test_nothing_the_substrate_runs_talks_beyond_this_machine(fs: JuiceFs) -> None:
    write_synced(fs.shard_path("a", "s") / "f", b"x")
    assert (fs.shard_path("b", "s") / "f").read_bytes() == b"x"
    pids = fs.pids()
    # The warden, Redis, two relays, and three clients of two processes each.
    assert len(pids) == 1 + 1 + 2 + 3 * 2
    juicefs = juicefs_binary().resolve()
    for pid in pids:
        if Path(os.readlink(f"/proc/{pid}/exe")) == juicefs:
            # JuiceFS rewrites its command line in place, words joined by spaces.
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").split()
            assert b"--no-usage-report" in argv, pid
    # Sampled a few times over two heartbeats: a report or check would be a fresh connection.
    seen: set[tuple[int, str, str]] = set()
    deadline = time.monotonic() + 2 * HEARTBEAT_S
    while time.monotonic() < deadline:
        for pid in pids:
            seen |= {(pid, local, remote) for local, remote in inet_sockets(pid)}
        time.sleep(0.1)
    outside = [s for s in seen if not _local(s[1]) or not (_local(s[2]) or _unset(s[2]))]
    assert outside == []
    assert fs.redis is not None
    to_redis = [s for s in seen if s[2].endswith(f":{fs.redis.port}")]
    assert to_redis, "no connection to Redis was found: the socket listing reads nothing"


def inet_sockets(pid: int) -> list[tuple[str, str]]:
    """(local, remote) of each TCP and UDP socket ``pid`` has open, as ``addr:port``."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6", "udp", "udp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[9] in inodes:
                found.append((_address(fields[1]), _address(fields[2])))
    return found


def _address(hex_address: str) -> str:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    # /proc prints each 32-bit word of the address in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"{ip}:{int(port, 16)}"


def _local(address: str) -> bool:
    return ipaddress.ip_address(address.rpartition(":")[0]).is_loopback


def _unset(address: str) -> bool:
    return ipaddress.ip_address(address.rpartition(":")[0]).is_unspecified


@pytest.mark.juicefs
@pytest.mark.timeout(90)
def test_close_ends_everything_whatever_state_the_hosts_are_in(
    tmp_path: Path, holders: list[Holder]
) -> None:
    root = tmp_path / "jfs"
    fs = JuiceFs(root, JuiceFsConfig(heartbeat_s=HEARTBEAT_S, stop_budget_s=8.0))
    try:
        fs.prepare(["a", "b", "c"], ["s"])
        # A descriptor left open on a frozen host's mount, a cut host, a hung one.
        holders.append(Holder(fs.shard_path("a", "s") / "lock"))
        fs.freeze("a")
        fs.partition("b")
        fs.hang("c")
        stuck = Call(lambda: os.listdir(fs.shard_path("c", "s")))
    finally:
        started = fs.pids()
        closing = time.monotonic()
        fs.close()
    took = time.monotonic() - closing
    print(f"close with a frozen, a cut and a hung host: {took:.2f}s")
    assert took < 20
    assert [pid for pid in started if alive(pid)] == []
    assert mounted_under(root) == []
    assert stuck.answered(5)  # the hung call was released, not left in the kernel


# A simulator of its own, killed outright once its hosts are up.
OWNER = r"""
import json, sys
from pathlib import Path
from fleet_sim.juicefs import JuiceFs, JuiceFsConfig
fs = JuiceFs(Path(sys.argv[1]), JuiceFsConfig(heartbeat_s=1.0))
fs.prepare(["a"], ["s"])
fs.freeze("a")  # a stopped client too: it must still be ended
print(json.dumps(fs.pids()), flush=True)
sys.stdin.read()
"""


@pytest.mark.juicefs
@pytest.mark.timeout(60)
def test_a_simulator_killed_outright_leaves_nothing_behind(tmp_path: Path) -> None:
    root = tmp_path / "jfs"
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None
        pids = json.loads(owner.stdout.readline())
        assert len(mounted_under(root)) == 2
    finally:
        owner.kill()
        owner.wait(timeout=10)
        for pipe in (owner.stdin, owner.stdout):
            if pipe is not None:
                pipe.close()
    wait_for(lambda: not any(alive(pid) for pid in pids), 15, "the warden ends every process")
    wait_for(lambda: mounted_under(root) == [], 15, "the warden detaches every mount")


# -- failures name their logs ------------------------------------------------------------------


@pytest.mark.juicefs
@pytest.mark.timeout(60)
def test_formatting_on_a_closed_port_fails_naming_its_log(tmp_path: Path) -> None:
    log = tmp_path / "format.log"
    with pytest.raises(FormatFailed) as failed:
        format_volume(url_for(free_port()), tmp_path / "bucket", "v", log, budget_s=3)
    assert str(log) in str(failed.value) and failed.value.log == log
    assert "refused" in str(failed.value)


@pytest.mark.juicefs
@pytest.mark.timeout(60)
def test_a_mount_of_an_unformatted_volume_fails_naming_its_log(tmp_path: Path) -> None:
    redis = RedisServer(RedisConfig(tmp_path / "redis"))
    redis.start()
    try:
        log = tmp_path / "mount.log"
        mount = JuiceFsMount(redis.url, tmp_path / "mnt", tmp_path / "cache", log)
        with pytest.raises(MountFailed) as failed:
            mount.start()
        assert str(log) in str(failed.value)
        assert mount.pids() == [] and mounted_under(tmp_path) == []
    finally:
        redis.stop()


@pytest.mark.juicefs
@pytest.mark.timeout(60)
def test_a_redis_that_cannot_start_fails_naming_its_log(tmp_path: Path) -> None:
    first = RedisServer(RedisConfig(tmp_path / "one"))
    first.start()
    try:
        second = RedisServer(RedisConfig(tmp_path / "two", port=first.port, start_budget_s=5))
        with pytest.raises(MetadataFailed) as failed:
            second.start()
        assert str(second.log) in str(failed.value)
        assert second.pid is None
    finally:
        first.stop()
