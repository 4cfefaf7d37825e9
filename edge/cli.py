"""``fleet-edge``: the edge's command line.

``fleet-edge ring`` prints where session ids land, computed exactly as the serving edge routes
them, so an operator can answer "which replica should have this session, and who is next?"
without a running fleet. ``fleet-edge serve`` runs the router.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from edge.core.config import MAX_VNODES, load_config, parse_replica_name_at
from edge.core.errors import EdgeError
from edge.core.metrics import parse_listen, require_loopback
from edge.core.ring import DEFAULT_VNODES, Ring
from wire.names import MAX_REPLICA_NAME
from wire.redaction import redact_handlers

MAX_RING_IDS = 100_000
MAX_ID_LENGTH = 1024


class _UsageError(Exception):
    pass


def _vnodes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 1 <= value <= MAX_VNODES:
        raise argparse.ArgumentTypeError(f"must be within 1-{MAX_VNODES}, got {value}")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleet-edge",
        description="L7 edge router for a fleet of agent replicas.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    ring = commands.add_parser(
        "ring",
        help="print the replica walk order for session ids",
        description=(
            "Print one line per session id: the id, then every replica in the order the edge "
            "tries them (the owner first, then clockwise round the ring). Ids and replica names "
            "are hashed as given; the ring is per slice, so list the replicas of the id's slice."
        ),
    )
    ring.add_argument(
        "--replica",
        metavar="NAME",
        action="append",
        required=True,
        help="a replica's ring name, as in the edge config: printable ASCII without "
        f"whitespace, 1-{MAX_REPLICA_NAME} bytes, e.g. r1 or 10.0.4.17:9000 (repeat for each "
        "replica of the slice)",
    )
    ring.add_argument(
        "--vnodes",
        type=_vnodes,
        default=DEFAULT_VNODES,
        help=f"virtual nodes per replica (default {DEFAULT_VNODES}, as the reference edge)",
    )
    ring.add_argument("session_ids", metavar="SESSION_ID", nargs="+", help="ids to place")

    serve = commands.add_parser(
        "serve",
        help="run the edge router",
        description=(
            "Route session requests to the replicas named in the config file. SIGHUP reloads "
            "the config (a config that does not load is logged and the running one kept); "
            "SIGTERM or SIGINT drains: no new connections, work in progress gets the config's "
            "drain_grace_s, then the process exits."
        ),
    )
    serve.add_argument("--config", metavar="FILE", required=True, help="edge TOML config")
    serve.add_argument("--listen", metavar="HOST:PORT", required=True, help="client-facing address")
    serve.add_argument(
        "--metrics-listen",
        metavar="127.0.0.1:PORT",
        help="loopback address for Prometheus metrics (off when omitted)",
    )
    serve.add_argument(
        "--workers",
        metavar="N|auto",
        default="1",
        help="edge processes sharing the listening address (SO_REUSEPORT), each with its own "
        "replica pools; auto: one per CPU. With more than 1 the parent supervises: SIGHUP "
        "reloads every worker, SIGTERM drains them all, a worker that dies is started again, "
        "and --metrics-listen serves every worker's metrics under a worker label (default 1)",
    )
    serve.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="log verbosity on stderr (info includes one access line per request)",
    )
    return parser


def _fits_one_field(text: str) -> bool:
    # One id per output line, fields split on spaces: an id must not break that format.
    return 0 < len(text) <= MAX_ID_LENGTH and text.isprintable() and " " not in text


def _ring(args: argparse.Namespace) -> int:
    names: list[str] = [parse_replica_name_at(n, "--replica") for n in args.replica]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise _UsageError(f"--replica {dupes[0]!r} is given more than once")
    ids: list[str] = args.session_ids
    if len(ids) > MAX_RING_IDS:
        raise _UsageError(f"at most {MAX_RING_IDS} session ids per call")
    for sid in ids:
        if not _fits_one_field(sid):
            raise _UsageError(
                f"session id {sid!r} must be 1-{MAX_ID_LENGTH} printable characters without spaces"
            )
    ring = Ring(tuple(names), args.vnodes)
    out = sys.stdout
    for sid in ids:
        out.write(" ".join((sid, *ring.walk(sid))) + "\n")
    out.flush()
    return 0


def _serve(args: argparse.Namespace) -> int:
    # Everything that can be wrong with the flags or the file is reported before binding.
    host, port = parse_listen(args.listen, "--listen")
    metrics_address = None
    if args.metrics_listen is not None:
        metrics_address = parse_listen(args.metrics_listen, "--metrics-listen")
        require_loopback(metrics_address[0])
    # Imported here so that `fleet-edge ring` does not pay for loading the server.
    import uvloop

    from edge.core.accesslog import AccessSink, use_sink
    from edge.server import serve
    from edge.workers import run_workers, worker_count

    workers = worker_count(args.workers)
    config_path = Path(args.config)
    config = load_config(config_path)

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    redact_handlers()
    use_sink(AccessSink(sys.stderr))
    try:
        if workers > 1:
            result: int = uvloop.run(
                run_workers(config_path, host, port, metrics_address, workers, args.log_level)
            )
        else:
            result = uvloop.run(serve(config_path, config, host, port, metrics_address))
    finally:
        use_sink(None)  # whatever is still buffered goes out
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        # argparse exits itself on --help (0) and on bad usage (2); main reports, never exits.
        return exc.code if isinstance(exc.code, int) else 2
    try:
        if args.command == "ring":
            return _ring(args)
        return _serve(args)
    except (EdgeError, _UsageError) as exc:
        print(f"fleet-edge {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `fleet-edge ring ... | head` closing the pipe early is not an error worth a traceback.
        return 0
