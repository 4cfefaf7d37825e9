"""Readiness: is every mounted shard present, writable and answering?

A probe writes, fsyncs and removes a small file on each shard. It runs in its own thread because a
hung mount blocks the calling thread in the kernel and nothing can interrupt it; what keeps that
from leaking threads is single flight: while a shard's probe is still stuck, later checks reuse
its verdict ("hanging") instead of starting another thread. So a dead mount costs one thread per
shard, however long it stays dead and however often readiness is asked. Results are cached
briefly and every check has a deadline, so ``/readyz`` answers within about a second regardless.

A hang verdict lasts as long as the stuck probe, not as long as the cache: once the probe
returns, the shard is judged by what it returned, so a stall that ends (a slow fsync under load)
stops refusing placements at once. Readers shed meanwhile reconnect and resume from their last
event, on the same owner if it can serve them by then.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

PROBE_DIR = ".beyond-probe"
# How long a probe may take before its shard counts as hanging (--storage-probe-deadline), and
# the most that may be set: past it a dead mount would go unnoticed for too long to matter.
DEADLINE_S = 1.0
MAX_DEADLINE_S = 600.0


@dataclass(frozen=True, slots=True)
class ProbeResult:
    ok: bool
    reason: str
    seconds: float


def probe_file_name(owner: str, pid: int) -> str:
    """The probe file's name for ``owner``: one per replica process sharing the shard.

    A replica's name follows the ring's rule (up to 255 bytes, ``/`` and ``..`` allowed), so it
    cannot be a file name as it stands: the readable part keeps only safe characters, and a
    digest of the exact name keeps two names that read the same apart."""
    readable = re.sub(r"[^A-Za-z0-9_-]", "_", owner)[:32]
    digest = hashlib.blake2b(owner.encode(), digest_size=8).hexdigest()
    return f"{readable}-{digest}.{pid}"


def write_probe(root: Path, owner: str) -> None:
    """One round trip to the storage server: create, write, fsync, remove."""
    if not root.is_dir():
        raise FileNotFoundError(errno.ENOENT, "shard root is missing")
    directory = root / PROBE_DIR
    directory.mkdir(exist_ok=True)
    path = directory / probe_file_name(owner, os.getpid())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, b"probe")
        os.fsync(fd)
    finally:
        os.close(fd)
    path.unlink()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        if exc.errno == errno.EROFS:
            return "read-only"
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ESTALE):
            return "missing"
        return f"failing ({errno.errorcode.get(exc.errno or 0, 'error')})"
    return "failing"


class ShardProbe:
    def __init__(
        self,
        name: str,
        root: Path,
        owner: str,
        *,
        cache_s: float = 2.0,
        deadline_s: float = DEADLINE_S,
        probe: Callable[[Path, str], None] = write_probe,
        observe: Callable[[float], None] = lambda seconds: None,
    ) -> None:
        self.name, self.root, self.owner = name, root, owner
        self.cache_s, self.deadline_s = cache_s, deadline_s
        self._probe = probe
        self._observe = observe
        self._inflight: asyncio.Future[float] | None = None
        self._started = 0.0
        # When, what, and whether it was a hang (a verdict that ends with the stuck probe).
        self._cached: tuple[float, ProbeResult, bool] | None = None

    def _start(self) -> asyncio.Future[float]:
        future: Future[float] = Future()

        def body() -> None:
            started = time.monotonic()
            try:
                self._probe(self.root, self.owner)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(time.monotonic() - started)

        threading.Thread(target=body, name=f"probe-{self.name}", daemon=True).start()
        return asyncio.wrap_future(future)

    @property
    def stalled_s(self) -> float:
        """How long the probe now running has been at it (0 when none is)."""
        inflight = self._inflight
        if inflight is None or inflight.done():
            return 0.0
        return time.monotonic() - self._started

    def _stall_over(self) -> bool:
        """The latest verdict was a hang, and the stuck probe has finished since."""
        inflight = self._inflight
        return (
            self._cached is not None
            and self._cached[2]
            and inflight is not None
            and inflight.done()
        )

    @property
    def healthy(self) -> bool:
        """The latest verdict, without probing: a shard not yet probed counts as healthy."""
        if self.stalled_s > self.deadline_s:
            return False  # a probe is stuck right now, whatever the cache says
        if self._stall_over():
            inflight = self._inflight
            assert inflight is not None
            return not inflight.cancelled() and inflight.exception() is None
        return self._cached is None or self._cached[1].ok

    async def check(self) -> ProbeResult:
        now = time.monotonic()
        cached = self._cached
        if cached is not None and now - cached[0] < self.cache_s and not self._stall_over():
            return cached[1]
        if self._inflight is None or self._inflight.done():
            self._inflight, self._started = self._start(), now
        inflight, started = self._inflight, self._started
        try:
            seconds = await asyncio.wait_for(
                asyncio.shield(inflight),
                max(0.0, self.deadline_s - (time.monotonic() - now)),
            )
            result = ProbeResult(True, "ok", seconds)
            self._observe(seconds)
        except TimeoutError:
            stuck = time.monotonic() - started
            result = ProbeResult(False, f"shard {self.name} is hanging ({stuck:.1f}s)", stuck)
            self._cached = (time.monotonic(), result, True)
            return result
        except Exception as exc:
            result = ProbeResult(
                False, f"shard {self.name} is {_describe(exc)}", time.monotonic() - now
            )
        self._cached = (time.monotonic(), result, False)
        return result


class Readiness:
    """All shards' probes plus the replica's own state (draining makes it unready)."""

    def __init__(self, probes: list[ShardProbe], draining: Callable[[], bool]) -> None:
        self.probes = probes
        self._draining = draining

    def shard_healthy(self, name: str) -> bool:
        return all(p.healthy for p in self.probes if p.name == name)

    async def watch(
        self, on_unhealthy: Callable[[str], None] = lambda name: None, interval_s: float = 1.0
    ) -> None:
        """Probe in the background, so placement knows a shard hangs before a request does;
        ``on_unhealthy`` hears of each shard that turns bad (once per turn)."""
        bad: set[str] = set()
        while True:
            await asyncio.gather(*(p.check() for p in self.probes))
            for probe in self.probes:
                if not probe.healthy and probe.name not in bad:
                    bad.add(probe.name)
                    on_unhealthy(probe.name)
                elif probe.healthy:
                    bad.discard(probe.name)
            await asyncio.sleep(interval_s)

    async def check(self) -> tuple[bool, str]:
        if self._draining():
            return False, "draining"
        results = await asyncio.gather(*(p.check() for p in self.probes))
        bad = [r.reason for r in results if not r.ok]
        return (not bad, "; ".join(bad) if bad else "ready")
