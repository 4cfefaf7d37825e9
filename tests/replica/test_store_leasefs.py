"""The store on leasefs: two hosts' mounts of one backing directory behave like NFSv4 clients.

An owner cut off from storage keeps its lock until the lease lapses; then another host takes the
session over, and after the partition heals the old owner's descriptors fail, so it can never
write into history again. A hung mount makes readiness fail fast without leaking threads.
"""

from __future__ import annotations

import re
import secrets
import time
from pathlib import Path

import httpx
import pytest

from fleet_sim.leasefs.mount import mount_leasefs
from replica.store import SessionStore
from tests.harness import eventually, fleet_at, post
from tests.replica.store_owner import DEK, Owner
from wire.names import parse_session_id

pytestmark = [pytest.mark.fuse, pytest.mark.slow]
LEASE_S = 1.0


def test_takeover_after_partition_and_the_old_owner_fails(tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    backing.mkdir()
    sid = "a07-s1.part1"
    with (
        mount_leasefs(str(backing), str(tmp_path / "hostA"), "hostA", LEASE_S) as host_a,
        mount_leasefs(str(backing), str(tmp_path / "hostB"), "hostB", LEASE_S) as host_b,
    ):
        a, b = Owner(Path(host_a.mountpoint), sid), Owner(Path(host_b.mountpoint), sid)
        try:
            assert a("open")["epoch"] == 1
            assert a("commit", tag="t1")["ok"]
            assert b("open").get("error") == "LockHeld"
            host_a.control.partition()
            started = time.monotonic()
            opened = eventually(lambda: b("open").get("epoch"), timeout=15, interval=0.1)
            waited = time.monotonic() - started
            assert opened == 2 and waited >= LEASE_S * 0.8
            assert b("commit", tag="t2")["ok"]
            host_a.control.heal()
            late = a("commit", tag="late")
            assert late.get("error") == "LockLost"  # EIO on the old descriptor: it stops
            assert b("commit", tag="t3")["ok"]
        finally:
            a.stop()
            b.stop()
    history = SessionStore(backing).read("acme", parse_session_id(sid), DEK)
    assert [m.id for m in history.transcript.messages] == [
        f"{t}-{r}" for t in ("t1", "t2", "t3") for r in ("u", "a")
    ]
    assert [s.epoch for s in history.segments] == [1, 2]


def test_hung_mount_is_reported_fast_and_leaks_no_threads(tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    backing.mkdir()
    with (
        fleet_at(tmp_path / "fleet") as fleet,
        mount_leasefs(str(backing), str(tmp_path / "mnt"), "hostH", 30.0) as mount,
    ):
        replica = fleet.replica("hung", {"a07-s1": Path(mount.mountpoint)})
        sid = f"a07-s1.{secrets.token_urlsafe(6)}"
        grant = fleet.grant("acme", sid, sandbox=False)
        with replica.client() as client:
            assert client.get("/readyz").status_code == 200
            assert post(client, sid, grant, {"type": "get_state"}).status_code == 200

            def threads() -> int:
                match = re.search(r"^agent_threads (\S+)$", replica.scrape(), re.M)
                assert match is not None
                return int(float(match.group(1)))

            before = threads()
            mount.control.hang()
            hung_at = time.monotonic()
            # A verdict may be cached for up to 2 s, and a probe is given 1 s.
            eventually(lambda: client.get("/readyz", timeout=5).status_code == 503, timeout=5)
            assert time.monotonic() - hung_at < 3.5
            timings = []
            for _ in range(20):
                started = time.monotonic()
                ready = client.get("/readyz", timeout=5)
                timings.append(time.monotonic() - started)
                assert ready.status_code == 503 and "hanging" in ready.text
                assert client.get("/livez").status_code == 200
                time.sleep(0.1)  # the probes are spread over 2 s of the hang, not a wait
            after = threads()
            assert max(timings) < 1.6
            assert after - before <= 1  # one probe thread stuck in the kernel, no more
            mount.control.ok()
            eventually(lambda: client.get("/readyz").status_code == 200, timeout=10)
            assert threads() <= before + 1
            with httpx.Client(base_url=replica.url, timeout=10) as again:
                assert post(again, sid, grant, {"type": "get_state"}).status_code == 200
