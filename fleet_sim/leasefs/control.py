"""The control channel: one JSON object per line over a unix socket.

Request ``{"op": "<mode>"}`` sets the mount's mode (``ok``, ``partition``, ``heal``, ``hang``,
``readonly``, ``vanish``; ``heal`` is ``ok`` by its partition name); ``{"op": "status"}`` reads it.
Every answer is ``{"ok": true, "status": {...}}`` or ``{"ok": false, "error": "..."}``. The server
runs on its own threads, so it answers while every filesystem call of the mount is blocked.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleet_sim.leasefs.errors import ControlError
from fleet_sim.leasefs.policy import Mode

MAX_LINE = 4096

_OPS: dict[str, Mode] = {mode.value: mode for mode in Mode} | {"heal": Mode.OK}


@dataclass(frozen=True, slots=True)
class LeaseFsStatus:
    host: str
    mode: Mode
    held_locks: int
    revoked_locks: int
    revocations: int
    open_handles: int
    stale_handles: int
    blocked_calls: int

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "mode": self.mode.value,
            "held_locks": self.held_locks,
            "revoked_locks": self.revoked_locks,
            "revocations": self.revocations,
            "open_handles": self.open_handles,
            "stale_handles": self.stale_handles,
            "blocked_calls": self.blocked_calls,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> LeaseFsStatus:
        try:
            return cls(
                host=str(raw["host"]),
                mode=Mode(raw["mode"]),
                held_locks=int(raw["held_locks"]),
                revoked_locks=int(raw["revoked_locks"]),
                revocations=int(raw["revocations"]),
                open_handles=int(raw["open_handles"]),
                stale_handles=int(raw["stale_handles"]),
                blocked_calls=int(raw["blocked_calls"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ControlError(f"malformed status: {exc}") from exc


def handle_request(
    line: bytes, set_mode: Callable[[Mode], None], status: Callable[[], LeaseFsStatus]
) -> dict[str, Any]:
    """Answer one request line (pure apart from the two callbacks)."""
    try:
        request = json.loads(line)
    except ValueError:
        return {"ok": False, "error": "request is not JSON"}
    op = request.get("op") if isinstance(request, dict) else None
    if op == "status":
        return {"ok": True, "status": status().to_json()}
    if isinstance(op, str) and op in _OPS:
        set_mode(_OPS[op])
        return {"ok": True, "status": status().to_json()}
    return {"ok": False, "error": f"unknown op {op!r}"}


class ControlServer:
    def __init__(
        self,
        sock_path: str,
        set_mode: Callable[[Mode], None],
        status: Callable[[], LeaseFsStatus],
    ) -> None:
        self._path = sock_path
        self._set_mode = set_mode
        self._status = status
        with contextlib.suppress(FileNotFoundError):
            os.unlink(sock_path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(sock_path)
        self._sock.listen(16)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="leasefs-control", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        # shutdown() wakes the accept() in the serving thread.
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=5)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(
                target=self._session, args=(conn,), name="leasefs-control-conn", daemon=True
            ).start()

    def _session(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as reader:
            conn.settimeout(30)
            try:
                for line in reader:
                    if len(line) > MAX_LINE:
                        answer: dict[str, Any] = {"ok": False, "error": "request too long"}
                    else:
                        answer = handle_request(line, self._set_mode, self._status)
                    conn.sendall(json.dumps(answer).encode() + b"\n")
            except OSError:
                return


class LeaseFsControl:
    """Client of one mount's control socket (a connection per request)."""

    def __init__(self, sock_path: str, timeout_s: float = 5.0) -> None:
        self.sock_path = sock_path
        self.timeout_s = timeout_s

    def request(self, op: str) -> LeaseFsStatus:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(self.timeout_s)
                sock.connect(self.sock_path)
                sock.sendall(json.dumps({"op": op}).encode() + b"\n")
                with sock.makefile("rb") as reader:
                    line = reader.readline(MAX_LINE * 4)
        except OSError as exc:
            raise ControlError(f"control socket {self.sock_path}: {exc}") from exc
        try:
            answer = json.loads(line)
        except ValueError as exc:
            raise ControlError("control answer is not JSON") from exc
        if not isinstance(answer, dict) or not answer.get("ok"):
            error = answer.get("error") if isinstance(answer, dict) else None
            raise ControlError(f"control request {op!r} refused: {error}")
        return LeaseFsStatus.from_json(answer["status"])

    def status(self) -> LeaseFsStatus:
        return self.request("status")

    def set_mode(self, mode: Mode) -> LeaseFsStatus:
        return self.request(mode.value)

    def ok(self) -> LeaseFsStatus:
        return self.request("ok")

    def partition(self) -> LeaseFsStatus:
        return self.request("partition")

    def heal(self) -> LeaseFsStatus:
        return self.request("heal")

    def hang(self) -> LeaseFsStatus:
        return self.request("hang")

    def readonly(self) -> LeaseFsStatus:
        return self.request("readonly")

    def vanish(self) -> LeaseFsStatus:
        return self.request("vanish")
