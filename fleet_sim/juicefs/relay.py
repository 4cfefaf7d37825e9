"""A host's link to the metadata engine: a TCP relay that can be cut the way a network is cut.

Each simulated host's JuiceFS mount reaches Redis through its own relay port, so the host alone
can be partitioned from its metadata engine while its replica runs on. A cut relay behaves as a
network that drops packets, never as one that closes connections:

- it stops reading both sides of every connection it holds, and forwards nothing: the client's
  requests sit unread and its connections stay open, unanswered, until its own timeouts give up
  on them (as TCP retransmissions would);
- a new connection is accepted (the kernel's SYN-ACK cannot be withheld from user space) and then
  never answered: no upstream connection is made for it until the heal;
- what was already read when the cut came, and anything still queued in the kernel, is delivered
  on the heal, as retransmitted segments are when a real partition ends. A connection that either
  end closed during the cut is closed on the other side only then.

Why a process of its own per host, and not a thread of the simulator: every metadata call of the
host goes through the relay, so it must not share a GIL with the simulator's own work (a busy
grader or workload would otherwise slow that host's file system), it must keep running whatever
the simulator's threads are doing, and a freeze of the host (SIGSTOP of the replica and of its
JuiceFS client) must not stop it: it is the network, not a process of the host. The relay reads
commands on stdin and acknowledges each on stdout; it exits when stdin closes, so a simulator
that dies takes its relays with it.

``python -m fleet_sim.juicefs relay --target HOST:PORT`` prints ``listening PORT`` once bound,
then answers ``partition`` / ``heal`` / ``status`` with ``ok <state>``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import select
import subprocess
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, cast

from fleet_sim.juicefs import procs
from fleet_sim.juicefs.errors import RelayFailed

LISTEN_HOST = "127.0.0.1"


class _Half(asyncio.Protocol):
    """One socket of a relayed connection: the client's (accepted) or the server's (dialled)."""

    def __init__(self, link: _Link) -> None:
        self.link = link
        self.transport: asyncio.Transport | None = None
        self.inbox: list[bytes] = []  # read from this socket, not yet written to the other
        self.ended = False  # this socket's end went away: close the other once allowed
        self.throttled = False  # the other socket's outgoing buffer is full

    @property
    def peer(self) -> _Half | None:
        return self.link.server if self is self.link.client else self.link.client

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.refresh()
        self.link.flush()

    def data_received(self, data: bytes) -> None:
        self.inbox.append(data)
        self.link.flush()

    def eof_received(self) -> bool:
        self.ended = True
        self.link.flush()
        return True  # the transport stays open until the relay may pass the EOF on

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.ended = True
        self.link.flush()

    def pause_writing(self) -> None:
        peer = self.peer
        if peer is not None:
            peer.throttled = True
            peer.refresh()

    def resume_writing(self) -> None:
        peer = self.peer
        if peer is not None:
            peer.throttled = False
            peer.refresh()

    def refresh(self) -> None:
        """Read only while the link is up, the other side is connected and not backed up."""
        if self.transport is None or self.transport.is_closing():
            return
        peer = self.peer
        reading = (
            not self.link.relay.cut
            and not self.throttled
            and peer is not None
            and peer.transport is not None
        )
        # Both are idempotent: a paused transport asked to pause again stays paused.
        if reading:
            self.transport.resume_reading()
        else:
            self.transport.pause_reading()


class _Link:
    """One client connection and, once the relay may make it, its connection to the target."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.client = _Half(self)
        self.server: _Half | None = None
        self.dialling = False

    def dial(self) -> None:
        if self.server is not None or self.dialling or self.client.ended:
            return
        self.dialling = True
        self.relay.spawn(self._dial())

    async def _dial(self) -> None:
        server = _Half(self)
        loop = asyncio.get_running_loop()
        try:
            await loop.create_connection(lambda: server, *self.relay.target)
        except OSError:
            # The target is down (a metadata restart): the client sees its connection close,
            # as it would see a refused one, and dials again.
            self.dialling = False
            if self.client.transport is not None:
                self.client.transport.close()
            self.relay.links.discard(self)
            return
        self.dialling = False
        self.server = server
        self.client.refresh()
        server.refresh()
        self.flush()

    def flush(self) -> None:
        """Pass on what each side has read, and each side's end, unless the link is cut."""
        if self.relay.cut:
            return
        for half in (self.client, self.server):
            peer = None if half is None else half.peer
            if half is None or peer is None or peer.transport is None:
                continue
            if half.inbox:
                peer.transport.write(b"".join(half.inbox))
                half.inbox.clear()
            if half.ended:
                peer.transport.close()  # after what is buffered has gone out
        gone = self.client.transport is None and (
            self.server is None or self.server.transport is None
        )
        ended = self.client.ended and (self.server is None or self.server.ended)
        if gone or ended:
            for half in (self.client, self.server):
                if half is not None and half.transport is not None:
                    half.transport.close()
            self.relay.links.discard(self)


class Relay:
    """The relay's state inside its own process: the target, the links, and whether it is cut."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.cut = False
        self.links: set[_Link] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        # The loop keeps only weak references to tasks: one nobody holds can vanish mid-dial.
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def accept(self) -> _Half:
        link = _Link(self)
        self.links.add(link)
        if not self.cut:
            link.dial()
        return link.client

    def partition(self) -> None:
        self.cut = True
        for link in list(self.links):
            for half in (link.client, link.server):
                if half is not None:
                    half.refresh()

    def heal(self) -> None:
        self.cut = False
        for link in list(self.links):
            link.dial()
            for half in (link.client, link.server):
                if half is not None:
                    half.refresh()
            link.flush()


async def _serve(target: tuple[str, int], port: int) -> None:
    relay = Relay(target)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(relay.accept, LISTEN_HOST, port)
    bound = server.sockets[0].getsockname()[1]
    print(f"listening {bound}", flush=True)
    commands = asyncio.StreamReader()
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(commands), os.fdopen(0, "rb", buffering=0)
    )
    async with server:
        while line := await commands.readline():
            verb = line.decode().strip()
            if verb == "partition":
                relay.partition()
            elif verb == "heal":
                relay.heal()
            elif verb != "status":
                print(f"error unknown command {verb!r}", flush=True)
                continue
            print(f"ok {'partitioned' if relay.cut else 'connected'}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleet_sim.juicefs relay")
    parser.add_argument("--target", required=True, help="HOST:PORT of the metadata engine")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: any free)")
    args = parser.parse_args(argv)
    host, _, port = args.target.rpartition(":")
    asyncio.run(_serve((host, int(port)), args.port))
    return 0


class RelayProcess:
    """The parent's handle on one host's relay process."""

    def __init__(self, target_port: int, log: Path, budget_s: float = 10.0) -> None:
        self.target_port = target_port
        self.log = log
        self.budget_s = budget_s
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._pending = b""

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> None:
        with open(self.log, "ab") as err:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "fleet_sim.juicefs",
                    "relay",
                    "--target",
                    f"{LISTEN_HOST}:{self.target_port}",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
            )
        try:
            said = self._line()
            if not said.startswith("listening "):
                raise RelayFailed(f"the relay said {said!r} instead of its port", self.log)
            self.port = int(said.split()[1])
        except BaseException:
            self.stop()
            raise

    def partition(self) -> None:
        self._command("partition", "ok partitioned")

    def heal(self) -> None:
        self._command("heal", "ok connected")

    def _command(self, verb: str, expected: str) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None:
            raise RelayFailed(f"{verb}: the relay is not running", self.log)
        try:
            proc.stdin.write(f"{verb}\n".encode())
            proc.stdin.flush()
        except OSError as exc:
            raise RelayFailed(f"{verb}: the relay is gone ({exc})", self.log) from None
        said = self._line()
        if said != expected:
            raise RelayFailed(f"{verb}: the relay answered {said!r}", self.log)

    def _line(self) -> str:
        """One line of the relay's stdout, read with a deadline (a dead relay is an error)."""
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + self.budget_s
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RelayFailed(f"the relay did not answer within {self.budget_s:g}s", self.log)
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise RelayFailed(f"the relay exited ({proc.poll()})", self.log)
                self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode("utf-8", "replace").strip()

    def stop(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()  # the relay exits when its stdin closes
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=self.budget_s / 2)
        procs.stop_process(proc, self.budget_s)
        if proc.stdout is not None:
            proc.stdout.close()
        self._proc = None
