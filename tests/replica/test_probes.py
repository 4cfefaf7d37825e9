from __future__ import annotations

import asyncio
import errno
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from replica.probes import (
    PROBE_DIR,
    ProbeResult,
    Readiness,
    ShardProbe,
    probe_file_name,
    write_probe,
)
from tests.harness import eventually_async

pytestmark = pytest.mark.anyio


def probe_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"probe-{name}"]


class Hung:
    """A probe that blocks like a call into a dead mount, until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def __call__(self, root: Path, owner: str) -> None:
        self.calls += 1
        self.release.wait(10)


@pytest.fixture
def hung() -> Iterator[Hung]:
    probe = Hung()
    yield probe
    probe.release.set()  # never leave a thread behind, whatever the test did


async def wait_no_threads(name: str) -> None:
    await eventually_async(
        lambda: not probe_threads(name),
        timeout=2.0,
        interval=0.01,
        message="probe thread did not finish",
    )


async def test_hung_mount_answers_within_the_deadline_and_starts_no_threads(
    tmp_path: Path, hung: Hung
) -> None:
    probe = ShardProbe("hang1", tmp_path, "r1", cache_s=0.0, deadline_s=0.1, probe=hung)
    started = time.monotonic()
    result = await probe.check()
    assert time.monotonic() - started < 0.5
    assert not result.ok and "hanging" in result.reason and "hang1" in result.reason
    assert len(probe_threads("hang1")) == 1
    for _ in range(6):
        started = time.monotonic()
        again = await probe.check()
        assert time.monotonic() - started < 0.5
        assert not again.ok and "hanging" in again.reason
    # Six more checks of a dead mount: still one stuck thread, one call into the mount.
    assert len(probe_threads("hang1")) == 1 and hung.calls == 1
    assert again.seconds >= result.seconds  # the stuck time keeps counting from the first start
    hung.release.set()
    await wait_no_threads("hang1")
    recovered = await probe.check()
    assert recovered.ok and recovered.reason == "ok"
    assert hung.calls == 2
    await wait_no_threads("hang1")


async def test_concurrent_checks_share_one_probe(tmp_path: Path, hung: Hung) -> None:
    probe = ShardProbe("hang2", tmp_path, "r1", cache_s=0.0, deadline_s=0.2, probe=hung)
    results = await asyncio.gather(*(probe.check() for _ in range(8)))
    assert all(not r.ok for r in results)
    assert hung.calls == 1 and len(probe_threads("hang2")) == 1


async def test_cache_holds_a_verdict(tmp_path: Path) -> None:
    calls: list[str] = []
    seen: list[float] = []

    def fast(root: Path, owner: str) -> None:
        calls.append(owner)

    probe = ShardProbe("c", tmp_path, "r1", cache_s=0.3, probe=fast, observe=seen.append)
    first = await probe.check()
    assert first.ok and calls == ["r1"] and len(seen) == 1 and seen[0] == first.seconds
    for _ in range(5):
        assert await probe.check() is first
    assert calls == ["r1"]
    # Not a wait for anything: the cached verdict's 0.3 s running out is what is under test.
    await asyncio.sleep(0.35)
    assert (await probe.check()).ok and len(calls) == 2


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (OSError(errno.EROFS, "read-only file system"), "is read-only"),
        (OSError(errno.ESTALE, "stale handle"), "is missing"),
        (OSError(errno.EIO, "i/o error"), "is failing (EIO)"),
        (RuntimeError("odd"), "is failing"),
    ],
)
async def test_failures_are_named(tmp_path: Path, error: BaseException, expected: str) -> None:
    def broken(root: Path, owner: str) -> None:
        raise error

    result = await ShardProbe("a07-s1", tmp_path, "r1", probe=broken).check()
    assert result == ProbeResult(False, f"shard a07-s1 {expected}", result.seconds)


async def test_real_probe_on_present_and_missing_roots(tmp_path: Path) -> None:
    good = await ShardProbe("a07-s1", tmp_path, "r1").check()
    assert good.ok and 0 <= good.seconds < 1
    assert list((tmp_path / PROBE_DIR).iterdir()) == []  # the probe file is removed
    missing = await ShardProbe("a07-s2", tmp_path / "absent", "r1").check()
    assert not missing.ok and missing.reason == "shard a07-s2 is missing"
    afile = tmp_path / "afile"
    afile.write_text("")
    assert (await ShardProbe("a07-s3", afile, "r1").check()).reason == "shard a07-s3 is missing"
    with pytest.raises(FileNotFoundError):
        write_probe(tmp_path / "absent", "r1")


@pytest.mark.parametrize(
    "owner", ["10.0.4.17:9000", "../../escaped", "rack/7/r1", ".", "..", "r" * 255, "~!$*?<>|\\"]
)
async def test_any_replica_name_probes_inside_the_probe_directory(
    tmp_path: Path, owner: str
) -> None:
    # A ring name may hold '/' and '..' and run to 255 bytes: none of that reaches the path
    # (before, "rack/7/r1" named a directory that does not exist and the shard read as missing).
    name = probe_file_name(owner, 4194304)
    assert "/" not in name and name not in (".", "..") and not name.startswith(".")
    assert len(name.encode()) <= 64
    root = tmp_path / "shard"
    root.mkdir()
    result = await ShardProbe("a07-s1", root, owner).check()
    assert result.ok, result
    assert os.listdir(tmp_path) == ["shard"] and os.listdir(root) == [PROBE_DIR]
    assert os.listdir(root / PROBE_DIR) == []  # the probe file is removed


def test_probe_file_names_keep_distinct_replicas_apart() -> None:
    owners = ["10.0.4.17:9000", "10.0.4.17_9000", "10.0.4.17/9000", "r" * 254 + "a", "r" * 255]
    names = {probe_file_name(owner, 7) for owner in owners}
    assert len(names) == len(owners)
    assert probe_file_name("r1", 7) == probe_file_name("r1", 7) != probe_file_name("r1", 8)
    assert probe_file_name("10.0.4.17:9000", 7).startswith("10_0_4_17_9000-")


async def test_readiness(tmp_path: Path, hung: Hung) -> None:
    draining = False
    good = ShardProbe("a07-s1", tmp_path, "r1")
    bad = ShardProbe("a07-s2", tmp_path / "absent", "r1")
    stuck = ShardProbe("a07-s3", tmp_path, "r1", deadline_s=0.2, probe=hung)
    assert await Readiness([good], lambda: draining).check() == (True, "ready")
    started = time.monotonic()
    ok, reason = await Readiness([good, bad, stuck], lambda: draining).check()
    assert time.monotonic() - started < 0.6
    assert not ok and "a07-s2 is missing" in reason and "a07-s3 is hanging" in reason
    assert "a07-s1" not in reason
    draining = True
    assert await Readiness([good], lambda: draining).check() == (False, "draining")


async def test_a_hang_verdict_ends_with_its_probe(tmp_path: Path, hung: Hung) -> None:
    # Cached for far longer than the stall: the verdict still ends when the stuck probe does.
    probe = ShardProbe("hang3", tmp_path, "r1", cache_s=60.0, deadline_s=0.1, probe=hung)
    assert "hanging" in (await probe.check()).reason
    assert not probe.healthy
    hung.release.set()
    await wait_no_threads("hang3")
    assert probe.healthy
    assert (await probe.check()).ok and hung.calls == 2


async def test_a_stall_that_ends_in_an_error_leaves_the_shard_unhealthy(tmp_path: Path) -> None:
    release = threading.Event()

    def stuck_then_broken(root: Path, owner: str) -> None:
        release.wait(10)
        raise OSError(errno.EIO, "i/o error")

    probe = ShardProbe(
        "hang4", tmp_path, "r1", cache_s=60.0, deadline_s=0.1, probe=stuck_then_broken
    )
    readiness = Readiness([probe], lambda: False)
    assert "hanging" in (await probe.check()).reason
    release.set()
    await wait_no_threads("hang4")
    assert not probe.healthy and not readiness.shard_healthy("hang4")
    assert (await probe.check()).reason == "shard hang4 is failing (EIO)"
    await wait_no_threads("hang4")
