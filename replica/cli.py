"""``fleet-replica``: the replica's command line.

``fleet-replica serve --service ...`` runs a replica (flags are checked before anything listens;
see ``replica.config``). Once listening it prints one JSON line, ``{"event": "listening", "url":
..., "metrics_url": ...}``, so a supervisor can find it.

``fleet-replica store verify SESSION_DIR --dek-file FILE`` opens every sealed record of one
session, checks the epoch chain and the seals, and prints what it found. Exit status: 0 when the
history verifies, 1 when it does not (the message says where), 2 for bad usage.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from replica.agent import DEFAULT_BUDGET, TurnBudget
from replica.coalescing import DEFAULT_MAX_CHARS, DEFAULT_WINDOW_MS
from replica.errors import ConfigError, CorruptHistory, StorageUnavailable
from replica.history import History, read_history
from replica.keyfiles import read_key_file
from replica.probes import DEADLINE_S as PROBE_DEADLINE_S
from replica.sealing import RecordSealer
from wire.errors import InvalidName
from wire.names import parse_session_id, parse_tenant
from wire.redaction import redact_handlers


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fleet-replica", description="A replica of the coding-agent fleet.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    store = commands.add_parser("store", help="inspect session storage")
    store_commands = store.add_subparsers(dest="store_command", required=True, parser_class=_Parser)
    verify = store_commands.add_parser(
        "verify",
        help="check every seal and the epoch chain of one session",
        description=(
            "Open every sealed record of SESSION_DIR (<shard>/<tenant>/sessions/<session id>) "
            "with the tenant's data key, check the chain of epoch segments, and print a summary. "
            "Exits 1 on any corruption."
        ),
    )
    verify.add_argument("session_dir", type=Path, metavar="SESSION_DIR")
    verify.add_argument("--dek-file", type=Path, required=True, help="the tenant's data key file")
    verify.add_argument("--tenant", help="tenant (default: read from SESSION_DIR's path)")
    verify.add_argument("--session", help="session id (default: SESSION_DIR's name)")
    verify.add_argument("--json", action="store_true", help="print the summary as JSON")
    _add_serve(commands)
    return parser


def _add_serve(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        help="run a replica of the fleet",
        description="Serve coding-agent sessions as one replica of a multi-tenant fleet.",
    )
    add = serve.add_argument
    add("--service", action="store_true", help="run as a fleet replica (required)")
    add("--listen", required=True, metavar="HOST:PORT", help="tenant-facing listener")
    add(
        "--shard",
        action="append",
        default=[],
        metavar="NAME=/abs/path",
        help="a mounted shard (repeatable); NAME is slice-qualified, e.g. a07-s3",
    )
    add(
        "--grant-key",
        action="append",
        default=[],
        metavar="KID=PUBKEY",
        help="a control-plane grant verification key (repeatable)",
    )
    add("--seal-key", type=Path, metavar="FILE", help="the fleet's X25519 private key file")
    add("--notify-key", type=Path, metavar="FILE", help="the job-end notify token key file")
    add("--notify-origin", metavar="URL", help="origin sandboxes reach the fleet at")
    add("--lifecycle-url", metavar="URL", help="where lifecycle events are POSTed")
    add(
        "--model",
        default="mock",
        help="mock | stub:ttft=300ms,per_token=12ms,tokens=200[,tick=25ms] | "
        "openai:http://host:port/v1[#model=NAME] (default: mock)",
    )
    add("--max-live-sessions", type=int, default=20_000, metavar="N")
    add(
        "--session-idle-timeout",
        type=float,
        metavar="S",
        help="close a detached, idle session after S seconds (default 60)",
    )
    add(
        "--drain-grace",
        type=float,
        default=0.0,
        metavar="S",
        help="on SIGTERM, let running turns finish for up to S seconds (default 0)",
    )
    add(
        "--storage-probe-deadline",
        type=float,
        default=PROBE_DEADLINE_S,
        metavar="S",
        help="how long a shard's storage may take to answer a probe before it counts as "
        "hanging: /readyz answers 503 and the readers of its sessions are told to reconnect "
        f"(default {PROBE_DEADLINE_S:g})",
    )
    add("--metrics-listen", metavar="127.0.0.1:PORT", help="loopback-only Prometheus listener")
    add(
        "--name",
        default="replica",
        help="this replica's name in logs and segment headers, by the ring's rule: printable "
        "ASCII without whitespace, 1-255 bytes (use its ring name, e.g. r1 or 10.0.4.17:9000)",
    )
    add("--turn-max-steps", type=int, default=DEFAULT_BUDGET.max_steps, metavar="N")
    add("--turn-max-tokens", type=int, default=DEFAULT_BUDGET.max_tokens, metavar="N")
    add(
        "--turn-max-tokens-per-call",
        type=int,
        default=DEFAULT_BUDGET.max_tokens_per_call,
        metavar="N",
        help="max_tokens asked of the model in one call",
    )
    add("--turn-max-seconds", type=float, default=DEFAULT_BUDGET.max_seconds, metavar="S")
    add(
        "--sse-keepalive",
        type=float,
        default=15.0,
        metavar="S",
        help="seconds between SSE keepalive comments (default 15)",
    )
    add(
        "--stream-queue-frames",
        type=int,
        default=2048,
        metavar="N",
        help="frames a WebSocket or SSE reader may fall behind before it is told to reconnect",
    )
    add(
        "--coalesce-ms",
        type=float,
        default=DEFAULT_WINDOW_MS,
        metavar="MS",
        help="send a session's streamed text at most once every MS milliseconds: a delta that "
        "comes MS or more after the last text frame goes out at once, sooner ones are gathered "
        "into one frame sent when the MS since that frame are up; any other frame sends what "
        f"is gathered first; 0 sends every delta as its own frame (default {DEFAULT_WINDOW_MS:g})",
    )
    add(
        "--coalesce-max-chars",
        type=int,
        default=DEFAULT_MAX_CHARS,
        metavar="N",
        help="send the gathered text at once when it reaches N characters, before its window "
        f"closes (default {DEFAULT_MAX_CHARS})",
    )
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _serve(args: argparse.Namespace) -> int:
    from replica.config import build_config  # imported here: verify needs none of the service
    from replica.service import Bound, ReplicaService

    try:
        if (
            min(args.turn_max_steps, args.turn_max_tokens, args.turn_max_tokens_per_call) < 1
            or args.turn_max_seconds <= 0
        ):
            raise ConfigError("turn budgets must be positive")
        config = build_config(
            service=args.service,
            listen=args.listen,
            shards=args.shard,
            grant_keys=args.grant_key,
            seal_key=args.seal_key,
            notify_key=args.notify_key,
            notify_origin=args.notify_origin,
            lifecycle_url=args.lifecycle_url,
            model=args.model,
            max_live_sessions=args.max_live_sessions,
            session_idle_timeout=args.session_idle_timeout,
            drain_grace=args.drain_grace,
            metrics_listen=args.metrics_listen,
            name=args.name,
            budget=TurnBudget(
                args.turn_max_steps,
                args.turn_max_tokens,
                args.turn_max_seconds,
                args.turn_max_tokens_per_call,
            ),
            keepalive_s=args.sse_keepalive,
            stream_queue_frames=args.stream_queue_frames,
            coalesce_ms=args.coalesce_ms,
            coalesce_max_chars=args.coalesce_max_chars,
            probe_deadline=args.storage_probe_deadline,
        )
    except (ConfigError, InvalidName) as exc:
        print(f"fleet-replica: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    redact_handlers()  # a second line: the server logs no request bytes to begin with

    def ready(bound: Bound) -> None:
        print(
            json.dumps({"event": "listening", "url": bound.url, "metrics_url": bound.metrics_url}),
            flush=True,
        )

    import resource

    import uvloop

    # Each live session holds a descriptor (two while active): allow as many as the host does.
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    try:
        uvloop.run(ReplicaService(config).run(ready))
    except OSError as exc:
        print(f"fleet-replica: cannot listen: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


def _names_from(args: argparse.Namespace) -> tuple[str, str]:
    directory: Path = args.session_dir.resolve()
    tenant = args.tenant or directory.parent.parent.name
    if args.tenant is None and directory.parent.name != "sessions":
        raise InvalidName("SESSION_DIR is not <shard>/<tenant>/sessions/<id>; pass --tenant")
    return parse_tenant(tenant), str(parse_session_id(args.session or directory.name))


def summarize(history: History, tenant: str, session: str) -> dict[str, object]:
    return {
        "tenant": tenant,
        "session": session,
        "segments": [
            {
                "epoch": s.epoch,
                "prev_epoch": s.prev_epoch,
                "seals_prev_at": s.seals_prev_at,
                "bound": s.bound,
                "valid_end": s.valid_end,
                "size": s.size,
                "batches": s.batches,
                "messages": s.messages,
                "ignored_bytes": s.ignored_bytes,
                "header_torn": s.header_torn,
            }
            for s in history.segments
        ],
        "batches": history.batches,
        "committed_messages": history.committed_messages,
        "conversation_messages": len(history.transcript),
        "leaf_id": history.transcript.leaf_id,
    }


_COLUMNS = (
    "epoch",
    "prev_epoch",
    "seals_prev_at",
    "bound",
    "valid_end",
    "size",
    "batches",
    "messages",
    "ignored_bytes",
)


def _print_table(history: History, tenant: str, session: str) -> None:
    print(f"session {session} (tenant {tenant})")
    rows = [
        ["-" if getattr(seg, c) is None else str(getattr(seg, c)) for c in _COLUMNS]
        for seg in history.segments
    ]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(_COLUMNS)]
    for row in (list(_COLUMNS), *rows):
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
    segments = history.segments
    print(
        f"ok: {len(segments)} segments, epochs {segments[0].epoch}-{segments[-1].epoch}, "
        f"{history.batches} batches, {history.committed_messages} committed messages "
        f"({len(history.transcript)} in the current conversation, "
        f"leaf {history.transcript.leaf_id or '-'})"
    )


def _verify(args: argparse.Namespace) -> int:
    try:
        tenant, session = _names_from(args)
        dek = read_key_file(args.dek_file, what="tenant data key")
    except (InvalidName, ConfigError) as exc:
        print(f"fleet-replica: {exc}", file=sys.stderr)
        return 2
    if not args.session_dir.is_dir():
        print(f"fleet-replica: {args.session_dir} is not a directory", file=sys.stderr)
        return 2
    try:
        history = read_history(args.session_dir, RecordSealer.for_session(dek, tenant, session))
    except CorruptHistory as exc:
        print(f"CORRUPT: {exc}", file=sys.stderr)
        return 1
    except StorageUnavailable as exc:
        print(f"fleet-replica: {exc}", file=sys.stderr)
        return 1
    if not history.segments:
        print(
            "CORRUPT: no segments: not a session directory, or its history is gone", file=sys.stderr
        )
        return 1
    if args.json:
        print(json.dumps(summarize(history, tenant, session), indent=2))
    else:
        _print_table(history, tenant, session)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "store" and args.store_command == "verify":
        return _verify(args)
    if args.command == "serve":
        return _serve(args)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
