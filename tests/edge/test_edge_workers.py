"""``fleet-edge serve --workers N`` as real processes: the workers share the address and the
kernel spreads connections across them; SIGHUP reloads each, SIGTERM drains each, a worker that
dies is started again, one whose parent dies goes too, and one scrape shows every worker's
metrics under a closed ``worker`` label."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from edge.core.errors import ConfigError
from edge.workers import MAX_BACKOFF_S, restart_delay, worker_count
from fleet_sim.ports import free_port
from tests.edge.fakes import FakeReplica, ok
from tests.harness import eventually_async

# The installed entry point, as a person types it.
FLEET_EDGE = shutil.which("fleet-edge", path=str(Path(sys.executable).parent))


def _fleet_edge() -> str:
    assert FLEET_EDGE is not None, f"fleet-edge is not installed next to {sys.executable}"
    return FLEET_EDGE


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie (an orphan's reaper may take its time)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def write_config(path: Path, replicas: list[FakeReplica], grace_s: float = 30.0) -> None:
    entries = ", ".join(f'{{ name = "{r.name}", url = "{r.url}" }}' for r in replicas)
    path.write_text(
        f"[edge]\nretry_budget_s = 2\ndrain_grace_s = {grace_s}\n\n"
        f'[[slice]]\nname = "a07"\nreplicas = [{entries}]\n'
    )


@dataclass
class Running:
    proc: asyncio.subprocess.Process
    url: str
    metrics_url: str
    log: Path

    def workers(self) -> list[int]:
        """The pids of the worker processes (the parent's children, its resource tracker
        aside)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        pids = []
        for pid in children.split():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmdline:
                pids.append(int(pid))
        return pids

    async def samples(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        async with aiohttp.ClientSession() as client, client.get(self.metrics_url) as resp:
            assert resp.status == 200
            text = await resp.text()
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    async def per_worker(self, name: str, **labels: str) -> dict[str, float]:
        found: dict[str, float] = {}
        for (sample, pairs), value in (await self.samples()).items():
            got = dict(pairs)
            if sample == name and all(got.get(k) == v for k, v in labels.items()):
                found[got["worker"]] = value
        return found


@asynccontextmanager
async def workers(tmp_path: Path, count: int = 2) -> AsyncIterator[Running]:
    metrics_port = free_port()
    log = tmp_path / "edge.log"
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            _fleet_edge(), "serve", "--config", "edge.toml", "--listen", "127.0.0.1:0",
            "--metrics-listen", f"127.0.0.1:{metrics_port}", "--workers", str(count),
            cwd=tmp_path, stdout=asyncio.subprocess.PIPE, stderr=err,
        )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert line.startswith("fleet-edge listening on http://127.0.0.1:"), log.read_text()
        running = Running(proc, line.split()[-1], f"http://127.0.0.1:{metrics_port}/metrics", log)
        assert len(running.workers()) == count
        yield running
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def post_fresh(url: str, count: int, sid: str = "a07-s1.workers") -> list[bytes]:
    """``count`` commands, each on a connection of its own (so each is a new connection for
    the kernel to give to a worker)."""
    bodies = []
    for _ in range(count):
        connector = aiohttp.TCPConnector(force_close=True)
        async with (
            aiohttp.ClientSession(connector=connector) as client,
            client.post(f"{url}/_beyond/agent?session_id={sid}", data=b"{}") as resp,
        ):
            assert resp.status == 200, await resp.text()
            bodies.append(await resp.read())
    return bodies


@asynccontextmanager
async def replicas(*names: str) -> AsyncIterator[list[FakeReplica]]:
    started = [await FakeReplica(n, ok(n.encode())).start() for n in names]
    try:
        yield started
    finally:
        for replica in started:
            await replica.close()


def test_worker_count_and_restart_backoff() -> None:
    assert worker_count("3") == 3
    assert worker_count("auto") == len(os.sched_getaffinity(0))
    for bad in ("0", "65", "many", ""):
        with pytest.raises(ConfigError, match="--workers"):
            worker_count(bad)
    assert [restart_delay(n) for n in (1, 2, 3, 4, 5, 9)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert MAX_BACKOFF_S == 4.0


@pytest.mark.parametrize("value", ["0", "lots"])
def test_a_bad_workers_value_exits_2(value: str, tmp_path: Path) -> None:
    (tmp_path / "edge.toml").write_text('[[slice]]\nname = "a07"\nreplicas = []\n')
    proc = subprocess.run(
        [_fleet_edge(), "serve", "--config", "edge.toml", "--listen", "127.0.0.1:0",
         "--workers", value],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert "--workers" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.anyio
async def test_workers_share_the_address_and_the_scrape_shows_each(tmp_path: Path) -> None:
    async with replicas("r1") as started:
        write_config(tmp_path / "edge.toml", started)
        async with workers(tmp_path) as edge:
            assert await post_fresh(edge.url, 40) == [b"r1"] * 40
            accepted = await edge.per_worker("edge_connections_accepted_total")
            delivered = await edge.per_worker(
                "edge_requests_total", kind="command", outcome="delivered"
            )
            samples = await edge.samples()
    # The kernel spread the connections: both workers took some, none was lost or counted twice.
    assert set(accepted) == {"0", "1"} and all(v > 0 for v in accepted.values()), accepted
    assert sum(accepted.values()) == 40 and sum(delivered.values()) == 40
    # Every worker's sample carries a worker label from the closed set; the parent adds two.
    own = {"edge_workers", "edge_worker_restarts_total"}
    assert {dict(labels).get("worker") for name, labels in samples if name not in own} == {
        "0",
        "1",
    }
    assert samples[("edge_workers", frozenset())] == 2
    assert samples[("edge_worker_restarts_total", frozenset())] == 0


@pytest.mark.anyio
async def test_sighup_reloads_every_worker_once(tmp_path: Path) -> None:
    async with replicas("r1", "r2") as (r1, r2):
        config = tmp_path / "edge.toml"
        write_config(config, [r1])
        async with workers(tmp_path) as edge:
            assert set(await post_fresh(edge.url, 6)) == {b"r1"}
            write_config(config, [r2])
            edge.proc.send_signal(signal.SIGHUP)

            async def both_reloaded() -> bool:
                return await edge.per_worker("edge_config_reloads_total", result="ok") == {
                    "0": 1.0,
                    "1": 1.0,
                }

            await eventually_async(both_reloaded, 20, 0.1, message="every worker reloaded")
            assert set(await post_fresh(edge.url, 20)) == {b"r2"}

            config.write_text("[edge]\nretry_budget = 5\n")  # a misspelt key: refused
            edge.proc.send_signal(signal.SIGHUP)

            async def refused() -> bool:
                return "config reload failed, workers keep the previous config" in (
                    edge.log.read_text()
                )

            await eventually_async(refused, 20, 0.1, message="the parent refused the file")
            # Checked once, by the parent: no worker was told to reload a file that fails.
            assert await edge.per_worker("edge_config_reloads_total", result="failed") == {
                "0": 0.0,
                "1": 0.0,
            }
            assert set(await post_fresh(edge.url, 6)) == {b"r2"}


@pytest.mark.anyio
async def test_sigterm_drains_every_worker_before_the_parent_exits(tmp_path: Path) -> None:
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.Response(body=b"done")

    replica = await FakeReplica("r1", slow).start()
    try:
        write_config(tmp_path / "edge.toml", [replica])
        async with workers(tmp_path) as edge:
            pids = edge.workers()
            held = [asyncio.ensure_future(post_fresh(edge.url, 1)) for _ in range(12)]
            await eventually_async(lambda: len(replica.seen) == 12, 20, 0.05)
            edge.proc.send_signal(signal.SIGTERM)

            async def both_draining() -> bool:
                return edge.log.read_text().count("stop requested: draining\n") == 2

            await eventually_async(both_draining, 20, 0.05, message="every worker draining")
            assert edge.proc.returncode is None  # the parent waits for its workers
            release.set()
            answers = await asyncio.gather(*held)
            assert answers == [[b"done"]] * 12
            assert await asyncio.wait_for(edge.proc.wait(), 30) == 0
    finally:
        release.set()
        await replica.close()
    assert not [pid for pid in pids if alive(pid)]
    log = edge.log.read_text()
    assert log.count("edge stopped") == 3 and "Traceback" not in log


@pytest.mark.anyio
async def test_a_worker_that_dies_is_started_again(tmp_path: Path) -> None:
    async with replicas("r1") as started:
        write_config(tmp_path / "edge.toml", started)
        async with workers(tmp_path) as edge:
            first = edge.workers()
            os.kill(first[0], signal.SIGKILL)

            async def replaced() -> bool:
                samples = await edge.samples()
                return (
                    samples[("edge_worker_restarts_total", frozenset())] == 1
                    and samples[("edge_workers", frozenset())] == 2
                )

            await eventually_async(replaced, 30, 0.1, message="the worker started again")
            now = edge.workers()
            assert len(now) == 2 and first[0] not in now and first[1] in now
            assert await post_fresh(edge.url, 20) == [b"r1"] * 20
            assert "exited with status -9" in edge.log.read_text()


@pytest.mark.anyio
async def test_workers_go_when_their_parent_is_killed(tmp_path: Path) -> None:
    async with replicas("r1") as started:
        write_config(tmp_path / "edge.toml", started)
        async with workers(tmp_path) as edge:
            pids = edge.workers()
            edge.proc.kill()
            await edge.proc.wait()

            def gone() -> bool:
                return not any(alive(pid) for pid in pids)

            await eventually_async(gone, 30, 0.1, message="the orphaned workers exited")


@pytest.mark.anyio
async def test_a_worker_that_does_not_stop_is_killed_after_its_grace(tmp_path: Path) -> None:
    async with replicas("r1") as started:
        write_config(tmp_path / "edge.toml", started, grace_s=0.5)
        async with workers(tmp_path) as edge:
            stuck, other = edge.workers()
            os.kill(stuck, signal.SIGSTOP)  # a stopped worker drains nothing
            edge.proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(edge.proc.wait(), 60) == 0
    assert not alive(stuck) and not alive(other)
    assert edge.log.read_text().count("did not stop in time; killing it") == 1
