"""One host's leasefs daemon: mounts, serves the control socket, runs FUSE until unmounted.

``python -m fleet_sim.leasefs mount ...`` lands here. The process stays in the foreground; it
unmounts and exits on SIGTERM or SIGINT (libfuse's handlers), when the mount is removed with
``fusermount3 -u``, or, with ``--watch-stdin``, when its standard input reaches end of file (so a
parent that dies cannot leave a mount behind).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, field

from fleet_sim.leasefs.control import ControlServer, LeaseFsStatus
from fleet_sim.leasefs.fs import CacheConfig, LeaseFsOperations, LeaseFuse
from fleet_sim.leasefs.gate import Gate
from fleet_sim.leasefs.openstate import OpenState
from fleet_sim.leasefs.policy import Mode

log = logging.getLogger(__name__)

# libfuse 3.14 serves at most 10 requests at once by default; calls blocked by a partition each
# hold a worker, so allow plenty before the mount stops taking new requests altogether.
DEFAULT_MAX_THREADS = 256
_LOOP_ENDED_BY_SIGNAL_OR_ERROR = 8


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    backing: str
    mountpoint: str
    host: str
    control: str
    lease_s: float = 10.0
    cache: CacheConfig = field(default_factory=CacheConfig)
    max_threads: int = DEFAULT_MAX_THREADS
    watch_stdin: bool = False
    debug: bool = False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fleet_sim.leasefs")
    sub = parser.add_subparsers(dest="command", required=True)
    mount = sub.add_parser("mount", help="serve one host's mount of a backing directory")
    mount.add_argument("--backing", required=True)
    mount.add_argument("--mountpoint", required=True)
    mount.add_argument("--host", required=True)
    mount.add_argument("--control", required=True, help="unix socket path for the control channel")
    mount.add_argument("--lease-s", type=float, default=10.0)
    mount.add_argument("--entry-timeout", type=float, default=0.0)
    mount.add_argument("--negative-timeout", type=float, default=0.0)
    mount.add_argument("--attr-timeout", type=float, default=0.0)
    mount.add_argument("--max-threads", type=int, default=DEFAULT_MAX_THREADS)
    mount.add_argument("--watch-stdin", action="store_true")
    mount.add_argument("--debug", action="store_true")
    return parser


def parse_config(argv: list[str]) -> DaemonConfig:
    ns = build_parser().parse_args(argv)
    if ns.lease_s <= 0:
        raise SystemExit("--lease-s must be positive")
    if not 1 <= ns.max_threads <= 100_000:
        raise SystemExit("--max-threads must be between 1 and 100000")
    return DaemonConfig(
        backing=os.path.abspath(ns.backing),
        mountpoint=os.path.abspath(ns.mountpoint),
        host=ns.host,
        control=os.path.abspath(ns.control),
        lease_s=ns.lease_s,
        cache=CacheConfig(ns.entry_timeout, ns.negative_timeout, ns.attr_timeout),
        max_threads=ns.max_threads,
        watch_stdin=ns.watch_stdin,
        debug=ns.debug,
    )


def _watch_stdin() -> None:
    # Any read result that is not data means the parent is gone: unmount via libfuse's handler.
    try:
        while os.read(sys.stdin.fileno(), 4096):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def run(config: DaemonConfig) -> int:
    logging.basicConfig(
        level=logging.DEBUG if config.debug else logging.INFO,
        format=f"%(asctime)s leasefs[{config.host}] %(levelname)s %(message)s",
    )
    if not os.path.isdir(config.backing):
        log.error("backing directory %s does not exist", config.backing)
        return 2
    # The kernel already applied the caller's umask; the daemon's own must not apply twice.
    os.umask(0)
    state = OpenState()

    def revoke() -> None:
        count = state.revoke()
        log.warning("lease lapsed while partitioned: revoked %d locks", count)

    gate = Gate(config.lease_s, revoke)

    def set_mode(mode: Mode) -> None:
        log.info("mode -> %s", mode.value)
        gate.set_mode(mode)

    def status() -> LeaseFsStatus:
        snap = gate.snapshot()
        counts = state.counts()
        return LeaseFsStatus(
            host=config.host,
            mode=snap.mode,
            held_locks=counts.held_locks,
            revoked_locks=counts.revoked_locks,
            revocations=snap.revocations,
            open_handles=counts.handles,
            stale_handles=counts.stale_handles,
            blocked_calls=snap.blocked,
        )

    server = ControlServer(config.control, set_mode, status)
    server.start()
    if config.watch_stdin:
        threading.Thread(target=_watch_stdin, name="leasefs-stdin", daemon=True).start()
    ops = LeaseFsOperations(config.backing, gate, state, config.cache)
    try:
        LeaseFuse(
            ops,
            config.mountpoint,
            raw_fi=True,
            foreground=True,
            nothreads=False,
            debug=config.debug,
            fsname=f"leasefs:{config.host}",
            subtype="leasefs",
            max_threads=config.max_threads,
        )
    except RuntimeError as exc:
        # fuse_main_real answers 8 whenever its loop ended with an error, and libfuse records
        # the signal that stopped it as that error, so SIGTERM/SIGINT also end here.
        if str(exc) != str(_LOOP_ENDED_BY_SIGNAL_OR_ERROR):
            log.error("fuse exited with an error: %s", exc)
            return 1
        log.info("fuse loop ended (signal or loop error)")
    finally:
        # Blocked calls must not outlive the mount: release them before tearing down.
        gate.set_mode(Mode.OK)
        server.close()
        gate.close()
        state.close_all()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_config(sys.argv[1:] if argv is None else argv))
