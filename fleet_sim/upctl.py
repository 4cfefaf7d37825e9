"""The endpoint through which a running ``fleet-sim up`` takes faults, and its client.

The endpoint listens on 127.0.0.1 only and asks for a bearer token that ``up`` draws at start and
writes into its state file (mode 0600), so what may fault the fleet is what may read that file.

- ``GET /v1/status``: every process with its kind, pid, state and restarts.
- ``POST /v1/fault`` with ``{"verb": ..., "target": ...}``: 200 and ``{"message"}``, or 400 (an
  unknown verb), 404 (no such process), 409 (not possible now or on this storage) with
  ``{"error"}``.

:func:`request` is what ``fleet-sim fault`` and the session page call; it reads the endpoint
from a state file and raises :class:`ControlError` with a sentence a person can act on.
"""

from __future__ import annotations

import hmac
import json
import secrets
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Final

import httpx

from fleet_sim.supervisor import FaultError, Supervisor

MAX_BODY: Final = 4096


class ControlError(Exception):
    """The endpoint could not be reached, or refused the request (the message says which)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class ControlServer:
    """The endpoint, served on a thread of its own until :meth:`close`."""

    def __init__(self, supervisor: Supervisor, host: str = "127.0.0.1") -> None:
        self.token = secrets.token_urlsafe(24)
        handler = _handler(supervisor, self.token)
        self._server = ThreadingHTTPServer((host, 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> ControlServer:
        self._thread.start()
        return self

    def state(self) -> dict[str, str]:
        """What the state file says of this endpoint."""
        return {"supervisor_url": self.url, "supervisor_token": self.token}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(supervisor: Supervisor, token: str) -> type[BaseHTTPRequestHandler]:
    expected = f"Bearer {token}".encode()

    class Handler(BaseHTTPRequestHandler):
        server_version = "fleet-sim-up"
        sys_version = ""

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet: the supervisor says on the terminal what each fault did."""

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _allowed(self) -> bool:
            given = self.headers.get("authorization", "").encode()
            if hmac.compare_digest(given, expected):
                return True
            self._answer(HTTPStatus.UNAUTHORIZED, {"error": "a bearer token is needed"})
            return False

        def do_GET(self) -> None:
            if not self._allowed():
                return
            if self.path != "/v1/status":
                self._answer(HTTPStatus.NOT_FOUND, {"error": "no such path"})
                return
            self._answer(HTTPStatus.OK, {"processes": supervisor.status()})

        def do_POST(self) -> None:
            if not self._allowed():
                return
            if self.path != "/v1/fault":
                self._answer(HTTPStatus.NOT_FOUND, {"error": "no such path"})
                return
            length = int(self.headers.get("content-length") or 0)
            if not 0 < length <= MAX_BODY:
                self._answer(HTTPStatus.BAD_REQUEST, {"error": "expected a small JSON body"})
                return
            try:
                body = json.loads(self.rfile.read(length))
                verb, target = body["verb"], body["target"]
                if not isinstance(verb, str) or not isinstance(target, str):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                self._answer(
                    HTTPStatus.BAD_REQUEST, {"error": 'expected {"verb": ..., "target": ...}'}
                )
                return
            try:
                message = supervisor.fault(verb, target)
            except FaultError as exc:
                self._answer(exc.status, {"error": str(exc)})
                return
            except OSError as exc:
                self._answer(HTTPStatus.CONFLICT, {"error": f"{verb} {target}: {exc.strerror}"})
                return
            self._answer(HTTPStatus.OK, {"message": message})

    return Handler


def read_state(state_file: Path) -> dict[str, Any]:
    """A running fleet's state file; :class:`ControlError` when there is none to read."""
    try:
        state = json.loads(state_file.read_text())
    except FileNotFoundError:
        raise ControlError(
            f"no running fleet: {state_file} does not exist (start one with `fleet-sim up`, "
            "or name its state file with --state)"
        ) from None
    except (OSError, ValueError) as exc:
        raise ControlError(f"cannot read the fleet's state file {state_file}: {exc}") from None
    if not isinstance(state, dict) or "supervisor_url" not in state:
        raise ControlError(f"{state_file} is not the state file of a running `fleet-sim up`")
    return state


def request(
    state_file: Path, method: str, path: str, body: dict[str, str] | None = None
) -> dict[str, Any]:
    state = read_state(state_file)
    try:
        response = httpx.request(
            method,
            f"{state['supervisor_url']}{path}",
            json=body,
            headers={"authorization": f"Bearer {state['supervisor_token']}"},
            timeout=30,
        )
    except httpx.HTTPError:
        raise ControlError(
            f"no running fleet: the `fleet-sim up` that wrote {state_file} does not answer "
            "(it has stopped, or was killed)"
        ) from None
    try:
        answer: dict[str, Any] = response.json()
    except ValueError:
        answer = {}
    if response.status_code != 200:
        raise ControlError(str(answer.get("error") or response.text), response.status_code)
    return answer


def fault(state_file: Path, verb: str, target: str) -> str:
    message: str = request(state_file, "POST", "/v1/fault", {"verb": verb, "target": target})[
        "message"
    ]
    return message


def status(state_file: Path) -> list[dict[str, Any]]:
    processes: list[dict[str, Any]] = request(state_file, "GET", "/v1/status")["processes"]
    return processes


def owned_sessions(state: dict[str, Any], timeout_s: float = 0.5) -> dict[str, list[str]]:
    """Replica name -> the ids of the sessions it owns now, from each replica's loopback
    ``/sessions``; a replica that does not answer in ``timeout_s`` (frozen, starting) is left
    out."""
    found: dict[str, list[str]] = {}
    for replica in state.get("replicas", []):
        metrics = replica.get("metrics_url")
        if not metrics:
            continue
        try:
            listed = httpx.get(metrics.replace("/metrics", "/sessions"), timeout=timeout_s)
            found[replica["name"]] = [s["session_id"] for s in listed.json()["sessions"]]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            continue
    return found
