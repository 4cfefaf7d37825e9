"""The fleet's own Redis server: the JuiceFS volume's metadata engine.

The fleet starts it, owns its port and directory, and is the only thing that talks to it. Its
settings are the ones the storage design depends on:

- ``appendonly yes`` + ``appendfsync always``: every write is in the AOF, fsync'd, before Redis
  answers it, so a JuiceFS call that returned (an fsync, a create, a lock) survives Redis being
  killed; ``save ""`` so a restart loads that AOF and nothing older;
- ``maxmemory-policy noeviction``: Redis refuses writes when full rather than silently dropping
  metadata (JuiceFS warns about any other policy);
- ``bind 127.0.0.1`` and ``protected-mode yes``: nothing outside this machine can reach it.

:meth:`RedisServer.restart` is the ``metadata-restart`` fault: SIGKILL (no shutdown save, no
goodbye to clients) and a start on the same port from the same AOF.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from fleet_sim.juicefs import procs
from fleet_sim.juicefs.binaries import redis_binary
from fleet_sim.juicefs.errors import MetadataFailed
from fleet_sim.ports import free_port

HOST = "127.0.0.1"
DATABASE = 1  # not 0: a stray client on the default database sees an empty one


@dataclass(frozen=True, slots=True)
class RedisConfig:
    directory: Path
    port: int = 0  # 0: a free port chosen at start, then kept across restarts
    start_budget_s: float = 15.0
    stop_budget_s: float = 5.0


# JuiceFS hands its Redis client a retry backoff capped at 10 s, and that client retries a
# dead connection a metadata transaction has pinned up to 10 times (then once more to UNWATCH):
# after a Redis restart one call could sleep 35-60 s, long enough for the host's heartbeats to
# stop and its session to be cleaned up. Capped at 500 ms, the same restart costs a few
# seconds and a call still rides out an engine that is away for about 3 s.
RETRY_BACKOFF_CAP: Final = "500ms"


def url_for(port: int) -> str:
    """The metadata URL of the engine as reached on ``port`` (its own, or a host's relay)."""
    return f"redis://{HOST}:{port}/{DATABASE}?max-retry-backoff={RETRY_BACKOFF_CAP}"


def config_text(directory: Path, port: int) -> str:
    """The server's configuration file (pure: what the module docstring promises)."""
    return "\n".join(
        [
            f"bind {HOST}",
            f"port {port}",
            "protected-mode yes",
            f'dir "{directory}"',
            f'logfile "{directory / "redis.log"}"',
            "daemonize no",
            "supervised no",
            "appendonly yes",
            "appendfsync always",
            "maxmemory-policy noeviction",
            'save ""',
            "always-show-logo no",
            "",
        ]
    )


def info(port: int, timeout_s: float = 0.5) -> dict[str, str]:
    """The fields of Redis's INFO on ``port``; empty if nothing answers (INFO is answered even
    while Redis is still loading its AOF, and says so)."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout_s) as conn:
            conn.sendall(b"*1\r\n$4\r\nINFO\r\n")
            reply = b""
            while b"\r\n" not in reply:
                chunk = conn.recv(4096)
                if not chunk:
                    return {}
                reply += chunk
            head, _, body = reply.partition(b"\r\n")
            if not head.startswith(b"$"):
                return {}
            size = int(head[1:])
            while len(body) < size:
                chunk = conn.recv(65_536)
                if not chunk:
                    return {}
                body += chunk
    except (OSError, ValueError):
        return {}
    fields = {}
    for line in body[:size].decode("utf-8", "replace").splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key] = value.strip()
    return fields


class RedisServer:
    """One redis-server process, restartable on its port."""

    def __init__(self, config: RedisConfig) -> None:
        self.config = config
        self.port = config.port or free_port(HOST)
        self._proc: subprocess.Popen[bytes] | None = None
        self._binary: Path | None = None

    @property
    def log(self) -> Path:
        return self.config.directory / "redis.log"

    @property
    def url(self) -> str:
        return url_for(self.port)

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> None:
        self._binary = self._binary or redis_binary()
        self.config.directory.mkdir(parents=True, exist_ok=True)
        conf = self.config.directory / "redis.conf"
        conf.write_text(config_text(self.config.directory, self.port))
        # Its own output goes to the log file the configuration names; what it says before it
        # has read that (a bad configuration) goes there too.
        with open(self.log, "ab") as out:
            self._proc = subprocess.Popen(
                [str(self._binary), str(conf)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
            )
        proc = self._proc

        def answered() -> bool:
            if proc.poll() is not None:
                raise MetadataFailed(f"redis-server exited with {proc.returncode}", self.log)
            # Ours (not some other server that holds the port) and done replaying its AOF.
            said = info(self.port)
            return said.get("process_id") == str(proc.pid) and said.get("loading") == "0"

        try:
            if not procs.poll(answered, self.config.start_budget_s, 0.02):
                raise MetadataFailed(
                    f"redis-server did not answer on {HOST}:{self.port} within "
                    f"{self.config.start_budget_s:g}s",
                    self.log,
                )
        except MetadataFailed:
            self.stop()
            raise

    def kill(self) -> None:
        """SIGKILL: what survives is only what the AOF already holds."""
        proc = self._proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=self.config.stop_budget_s)
        self._proc = None

    def restart(self) -> None:
        """Killed outright, then started again on the same port from its AOF."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """SIGTERM (Redis fsyncs its AOF and exits), SIGKILL if it does not within the budget."""
        proc = self._proc
        if proc is None:
            return
        procs.stop_process(proc, self.config.stop_budget_s)
        self._proc = None
