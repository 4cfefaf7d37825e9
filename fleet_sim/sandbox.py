"""The simulated sandbox exec service: many sandboxes, real subprocesses, job-end callbacks.

One aiohttp server hosts any number of sandboxes at ``{base}/s/{name}``, each with its own
workspace (see :mod:`fleet_sim.sandbox_jobs`). A session's grant carries the exec URL
``{base}/s/{name}`` and the exec header ``x-sandbox-token: base64url(HMAC-SHA256(secret, name))``
(:func:`sandbox_exec`), so the control plane can mint it without asking the service, and a token
for one sandbox opens no other. The protocol, relative to the exec URL::

    POST   /exec          {"command", "timeout_s"?, "background"?: false}     -> 200 result
    POST   /exec          {"command", "background": true, "notify"?: {"url", "token"} | null}
                                                                              -> 201 job
    GET    /jobs                                                              -> 200 {"jobs": [...]}
    GET    /jobs/{id}                                                         -> 200 job
    GET    /jobs/{id}/output?offset=N&limit=M     -> 200 {"data", "offset", "next_offset", "eof"}
    DELETE /jobs/{id}     kills the job's process group                       -> 200 job

A job is ``{"job_id", "command", "status": "running"|"exited"|"killed", "exit_code",
"signal", "started_at", "ended_at", "output_bytes", "output_truncated"}``: ``exit_code`` is set
for ``exited``, and a job (or foreground command) ended by a signal has ``exit_code`` null and
``signal`` set. A foreground result is ``{"exit_code", "signal", "stdout", "stderr",
"truncated", "timed_out"}``. Output offsets count bytes, and ``data`` ends on a character
boundary (unless ``limit`` is smaller than one character).

Refusals are JSON ``{"error": "..."}``: 401 when the exec header is missing or not this
sandbox's, 404 for an unknown sandbox name or job, 400 for a body or query that does not parse,
413 for a body over the limit, 429 when a sandbox already runs its maximum of jobs, 503 while
the service is stopping.

Simulator-only, unauthenticated: ``GET /_sim/health`` and ``GET /_sim/notifications`` (every
job-end callback and each of its attempts, never its token; see :mod:`fleet_sim.sandbox_notify`).

    python -m fleet_sim.sandbox --listen 127.0.0.1:7700 --root /tmp/sb [--secret-file FILE]

prints its base URL once listening. The secret file (a key file as in :mod:`replica.keyfiles`) is
created with a fresh key when it does not exist; by default it is ``ROOT/@sandbox.key``, a name
no sandbox can have. Stopping the service (SIGINT/SIGTERM) kills every job it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import logging
import math
import secrets
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, NoReturn
from urllib.parse import urlsplit

from aiohttp import web
from multidict import MultiMapping

from fleet_sim.sandbox_jobs import (
    Job,
    Sandbox,
    SandboxLimits,
    SandboxRequestError,
    ServiceStopping,
    valid_sandbox_name,
)
from fleet_sim.sandbox_notify import Notifier, NotifyPolicy, NotifyTarget
from fleet_sim.serving import listen_arg
from replica.errors import ConfigError
from replica.keyfiles import KEY_LEN, b64url_encode, read_key_file, write_key_file

log = logging.getLogger(__name__)

TOKEN_HEADER: Final = "x-sandbox-token"  # noqa: S105 (a header name, not a secret)
DEFAULT_TIMEOUT_S: Final = 60.0
MAX_TIMEOUT_S: Final = 600.0
DEFAULT_OUTPUT_LIMIT: Final = 64 * 1024
MAX_OUTPUT_LIMIT: Final = 1024 * 1024
MAX_COMMAND_BYTES: Final = 64 * 1024
MAX_BODY_BYTES: Final = 128 * 1024
MAX_NOTIFY_URL: Final = 2048
MAX_NOTIFY_TOKEN: Final = 4096
DEFAULT_SECRET_NAME: Final = "@sandbox.key"  # noqa: S105 (a file name)
_EXEC_KEYS: Final = frozenset({"command", "timeout_s", "background", "notify"})


def sandbox_token(secret: bytes, name: str) -> str:
    """The exec token of sandbox ``name``: unpadded base64url of HMAC-SHA256(secret, name)."""
    if not valid_sandbox_name(name):
        raise ValueError("not a sandbox name")
    return b64url_encode(hmac.new(secret, name.encode("ascii"), hashlib.sha256).digest())


def sandbox_exec(base_url: str, secret: bytes, name: str) -> tuple[str, dict[str, str]]:
    """The exec URL and exec headers a grant carries for sandbox ``name``."""
    return f"{base_url.rstrip('/')}/s/{name}", {TOKEN_HEADER: sandbox_token(secret, name)}


@dataclass(frozen=True, slots=True)
class SandboxConfig:
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    notify: NotifyPolicy = field(default_factory=NotifyPolicy)
    max_sandboxes: int = 4096

    def __post_init__(self) -> None:
        if self.max_sandboxes < 1:
            raise ValueError("max_sandboxes must be at least 1")


class BadRequest(SandboxRequestError):
    status = 400


@dataclass(frozen=True, slots=True)
class ExecRequest:
    command: str
    timeout_s: float
    background: bool
    notify: NotifyTarget | None = field(repr=False)


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _notify_target(value: object) -> NotifyTarget | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"url", "token"}:
        raise BadRequest("'notify' must be null or an object with exactly 'url' and 'token'")
    url, token = value["url"], value["token"]
    if not isinstance(url, str) or not url.isascii() or len(url) > MAX_NOTIFY_URL:
        raise BadRequest(f"'notify.url' must be an ASCII URL of at most {MAX_NOTIFY_URL} chars")
    try:
        parts = urlsplit(url)
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
    if not port_ok or parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadRequest("'notify.url' must be an http or https URL with a host")
    if any(ch.isspace() or not ch.isprintable() for ch in url):
        raise BadRequest("'notify.url' contains whitespace or control characters")
    # Visible ASCII only: the token goes into a header exactly as given.
    if (
        not isinstance(token, str)
        or not 0 < len(token) <= MAX_NOTIFY_TOKEN
        or not all("!" <= ch <= "~" for ch in token)
    ):
        raise BadRequest(f"'notify.token' must be 1 to {MAX_NOTIFY_TOKEN} visible ASCII characters")
    return NotifyTarget(url=url, token=token)


def parse_exec_request(body: object) -> ExecRequest:
    """Validate a decoded ``POST /exec`` body; :class:`BadRequest` says what is wrong."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = set(body) - _EXEC_KEYS
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(sorted(map(repr, unknown)))}")
    command = body.get("command")
    if not isinstance(command, str) or not command.strip():
        raise BadRequest("'command' must be a non-empty string")
    if "\0" in command or len(command.encode("utf-8", "surrogatepass")) > MAX_COMMAND_BYTES:
        raise BadRequest(f"'command' must hold no NUL and be at most {MAX_COMMAND_BYTES} bytes")
    background = body.get("background", False)
    if not isinstance(background, bool):
        raise BadRequest("'background' must be true or false")
    if not background:
        if body.get("notify") is not None:
            raise BadRequest("'notify' applies to background commands only")
        timeout = _number(body.get("timeout_s", DEFAULT_TIMEOUT_S))
        if timeout is None or not 0 < timeout <= MAX_TIMEOUT_S:
            raise BadRequest(f"'timeout_s' must be a number in (0, {MAX_TIMEOUT_S:g}]")
        return ExecRequest(command=command, timeout_s=timeout, background=False, notify=None)
    if "timeout_s" in body:
        raise BadRequest("'timeout_s' applies to foreground commands only; kill a job to end it")
    return ExecRequest(
        command=command,
        timeout_s=0.0,
        background=True,
        notify=_notify_target(body.get("notify")),
    )


def _query_int(query: MultiMapping[str], name: str, default: int, top: int) -> int:
    values = query.getall(name, [])
    if not values:
        return default
    if len(values) > 1:
        raise BadRequest(f"'{name}' is given more than once")
    text = values[0]
    if not text.isascii() or not text.isdigit() or len(text) > 18 or int(text) > top:
        raise BadRequest(f"'{name}' must be an integer from 0 to {top}")
    return int(text)


class SandboxHost:
    """Every sandbox of one service, their tokens and the job-end notifier."""

    def __init__(self, root: Path, secret: bytes, config: SandboxConfig) -> None:
        if len(secret) < 16:
            raise ValueError("the sandbox secret must be at least 16 bytes")
        self.root = root
        self.config = config
        self._secret = secret
        self._sandboxes: dict[str, Sandbox] = {}
        self.notifier = Notifier(config.notify)
        self._closing = False

    def __repr__(self) -> str:
        return f"SandboxHost(root={self.root!s}, sandboxes={len(self._sandboxes)})"

    def authorized(self, name: str, presented: Sequence[str]) -> bool:
        if len(presented) != 1:
            return False
        expected = sandbox_token(self._secret, name).encode("ascii")
        given = presented[0].encode("utf-8", "surrogateescape")
        return hmac.compare_digest(expected, given)

    def sandbox(self, name: str) -> Sandbox:
        found = self._sandboxes.get(name)
        if found is not None:
            return found
        if self._closing:
            raise ServiceStopping("the sandbox service is shutting down")
        if len(self._sandboxes) >= self.config.max_sandboxes:
            raise ServiceStopping("this service hosts its maximum number of sandboxes")
        created = Sandbox(name, self.root, self.config.limits, self._job_ended)
        self._sandboxes[name] = created
        return created

    def _job_ended(self, sandbox: Sandbox, job: Job) -> None:
        if job.notify is None or self._closing:
            return
        self.notifier.notify(
            sandbox=sandbox.name,
            job_id=job.job_id,
            target=job.notify,
            event={
                "type": "job_ended",
                "job_id": job.job_id,
                "status": str(job.status),
                "exit_code": job.exit_code,
            },
        )

    def health(self) -> dict[str, Any]:
        return {
            "status": "stopping" if self._closing else "ok",
            "sandboxes": len(self._sandboxes),
            "running_jobs": sum(box.running_jobs for box in self._sandboxes.values()),
            "pending_notifications": self.notifier.pending,
        }

    async def stop_processes(self) -> None:
        """First stage of a stop: no new sandboxes or commands, and every process killed."""
        self._closing = True
        await asyncio.gather(*(box.close() for box in self._sandboxes.values()))


HOST: Final = web.AppKey("sandbox_host", SandboxHost)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except SandboxRequestError as exc:
        return _error(exc.status, str(exc))
    except web.HTTPRequestEntityTooLarge:
        return _error(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = _error(exc.status, exc.reason)
        if "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response


def _sandbox(request: web.Request) -> Sandbox:
    host = request.app[HOST]
    name = request.match_info["name"]
    if not valid_sandbox_name(name):
        raise web.HTTPNotFound(reason="no such sandbox")
    if not host.authorized(name, request.headers.getall(TOKEN_HEADER, [])):
        raise web.HTTPUnauthorized(reason=f"missing or wrong {TOKEN_HEADER} for this sandbox")
    return host.sandbox(name)


def _reject_constant(name: str) -> NoReturn:
    raise BadRequest(f"the body is not JSON ({name} is not a JSON number)")


async def _exec(request: web.Request) -> web.Response:
    sandbox = _sandbox(request)
    raw = await request.read()
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None
    exec_request = parse_exec_request(body)
    if exec_request.background:
        job = await sandbox.start_job(exec_request.command, exec_request.notify)
        return web.json_response(job.to_json(), status=201)
    outcome = await sandbox.run(exec_request.command, exec_request.timeout_s)
    return web.json_response(outcome.to_json())


async def _jobs(request: web.Request) -> web.Response:
    sandbox = _sandbox(request)
    return web.json_response({"jobs": [job.to_json() for job in sandbox.jobs()]})


async def _job(request: web.Request) -> web.Response:
    sandbox = _sandbox(request)
    return web.json_response(sandbox.job(request.match_info["job_id"]).to_json())


async def _job_output(request: web.Request) -> web.Response:
    sandbox = _sandbox(request)
    query = request.rel_url.query
    offset = _query_int(query, "offset", 0, 2**62)
    limit = _query_int(query, "limit", DEFAULT_OUTPUT_LIMIT, MAX_OUTPUT_LIMIT)
    if limit == 0:
        raise BadRequest(f"'limit' must be an integer from 1 to {MAX_OUTPUT_LIMIT}")
    chunk = sandbox.read_output(request.match_info["job_id"], offset, limit)
    return web.json_response(chunk.to_json())


async def _kill(request: web.Request) -> web.Response:
    sandbox = _sandbox(request)
    job = await sandbox.kill(request.match_info["job_id"])
    return web.json_response(job.to_json())


async def _health(request: web.Request) -> web.Response:
    return web.json_response(request.app[HOST].health())


async def _notifications(request: web.Request) -> web.Response:
    records = request.app[HOST].notifier.records()
    return web.json_response({"notifications": [record.to_json() for record in records]})


async def _on_shutdown(app: web.Application) -> None:
    # Before in-flight requests are waited for, so a long foreground command ends them at once.
    await app[HOST].stop_processes()


async def _notifier_context(app: web.Application) -> AsyncIterator[None]:
    notifier = app[HOST].notifier
    await notifier.start()
    yield
    await notifier.close()


def make_app(root: Path, secret: bytes, config: SandboxConfig | None = None) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_json_errors])
    app[HOST] = SandboxHost(root, secret, config or SandboxConfig())
    app.cleanup_ctx.append(_notifier_context)
    app.on_shutdown.append(_on_shutdown)
    prefix = "/s/{name}"
    app.router.add_post(f"{prefix}/exec", _exec)
    app.router.add_get(f"{prefix}/jobs", _jobs)
    app.router.add_get(f"{prefix}/jobs/{{job_id}}", _job)
    app.router.add_delete(f"{prefix}/jobs/{{job_id}}", _kill)
    app.router.add_get(f"{prefix}/jobs/{{job_id}}/output", _job_output)
    app.router.add_get("/_sim/health", _health)
    app.router.add_get("/_sim/notifications", _notifications)
    return app


def _prepare_root(root: Path) -> Path:
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"sandbox root {root} cannot be created: {exc.strerror}") from None
    if not root.is_dir():
        raise ConfigError(f"sandbox root {root} is not a directory")
    return root.resolve()


async def start_sandbox_server(
    root: Path | str,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    secret: bytes,
    config: SandboxConfig | None = None,
) -> tuple[web.AppRunner, str]:
    """Serve on ``host:port`` (0 picks a free port); returns the runner and the base URL.

    The caller owns the runner: ``await runner.cleanup()`` kills every job and stops the server.
    The service state is ``runner.app[HOST]``.
    """
    app = make_app(_prepare_root(Path(root)), secret, config)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_host, bound_port = runner.addresses[0][:2]
    except BaseException:
        await runner.cleanup()
        raise
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    return runner, f"http://{shown}:{bound_port}"


def load_or_create_secret(path: Path) -> bytes:
    """Read the secret key file, creating it with a fresh key if it does not exist yet."""
    if not path.exists():
        try:
            write_key_file(path, secrets.token_bytes(KEY_LEN))
        except OSError as exc:
            raise ConfigError(f"sandbox secret {path} cannot be written: {exc.strerror}") from None
        print(f"created a new sandbox secret in {path}", file=sys.stderr, flush=True)
    return read_key_file(path, what="sandbox secret")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fleet_sim.sandbox",
        description="Simulated sandbox exec service: real subprocesses, jobs, job-end callbacks.",
    )
    parser.add_argument("--listen", type=listen_arg, required=True, metavar="HOST:PORT")
    parser.add_argument("--root", type=Path, required=True, help="directory holding sandboxes")
    parser.add_argument(
        "--secret-file",
        type=Path,
        default=None,
        help=f"key file the exec tokens derive from (default: ROOT/{DEFAULT_SECRET_NAME})",
    )
    parser.add_argument(
        "--notify-budget-s",
        type=float,
        default=NotifyPolicy().total_budget_s,
        help="how long one job-end callback is retried, in seconds",
    )
    parser.add_argument(
        "--notify-attempt-timeout-s",
        type=float,
        default=NotifyPolicy().attempt_timeout_s,
        help="when one callback attempt is abandoned, in seconds",
    )
    return parser


async def _serve(host: str, port: int, root: Path, secret: bytes, config: SandboxConfig) -> None:
    runner, url = await start_sandbox_server(root, host, port, secret=secret, config=config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        print(url, flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    host, port = args.listen
    try:
        root = _prepare_root(args.root)
        secret = load_or_create_secret(args.secret_file or root / DEFAULT_SECRET_NAME)
        config = SandboxConfig(
            notify=NotifyPolicy(
                total_budget_s=args.notify_budget_s,
                attempt_timeout_s=args.notify_attempt_timeout_s,
            )
        )
    except (ConfigError, ValueError) as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(host, port, root, secret, config))
    else:
        uvloop.run(_serve(host, port, root, secret, config))
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "HOST",
    "TOKEN_HEADER",
    "BadRequest",
    "ExecRequest",
    "SandboxConfig",
    "SandboxHost",
    "load_or_create_secret",
    "make_app",
    "parse_exec_request",
    "sandbox_exec",
    "sandbox_token",
    "start_sandbox_server",
]
