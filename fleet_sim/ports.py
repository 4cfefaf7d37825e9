"""Ports chosen ahead of the process that will listen on them.

A replica restarted by a fault must come back on the address the edge's configuration names, so
the simulator chooses its port before starting it. A port learned by binding to 0 and releasing it
comes from the kernel's ephemeral range, the same range every outgoing connection on the box
draws its local port from: between the probe and the replica's own bind, any client (an edge's
upstream, a test's HTTP client) can take it, and the replica dies with "address already in use".

So ports are chosen below that range, where the kernel never hands one out by itself; only another
explicit bind can take them. Each port is probed by binding it and is handed out once per process.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10_000  # below this sit the well-known and commonly configured service ports
ATTEMPTS = 200

_given: set[tuple[str, int]] = set()
_lock = threading.Lock()
# This process's share of the range (see confine): the whole of it unless told otherwise.
_share = (0, 1)


def ephemeral_range(path: Path | None = None) -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default when it cannot be read)."""
    try:
        low, high = (int(part) for part in (path or EPHEMERAL_RANGE_FILE).read_text().split())
    except (OSError, ValueError):
        return 32_768, 60_999
    return low, high


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _kernel_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
    return port


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing listens on now and no outgoing connection will take.

    Falls back to a kernel-chosen port when the ephemeral range leaves no room below it.
    """
    low, _high = ephemeral_range()
    if low - LOWEST < 1_000:
        return _kernel_port(host)
    index, shares = _share
    width = (low - LOWEST) // shares
    start = LOWEST + index * width
    with _lock:
        for _ in range(ATTEMPTS):
            port = random.randrange(start, start + width)
            if (host, port) in _given or not _bindable(host, port):
                continue
            _given.add((host, port))
            return port
    return _kernel_port(host)


def confine(index: int, shares: int) -> None:
    """Hand out ports from share ``index`` of ``shares`` equal parts of the range only.

    Processes that each start fleets at the same time (``fleet-sim matrix --jobs``) remember
    only their own ports; a port one of them chose, but whose process has not bound it yet (or
    has just restarted), is free to the others' probe. Disjoint shares keep them apart.
    """
    global _share
    if not 0 <= index < shares:
        raise ValueError(f"share {index} of {shares}")
    _share = (index, shares)
