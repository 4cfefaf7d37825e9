"""``fleet-sim``: the simulator's command line.

Each subcommand is one ``_register_<name>(subparsers)`` function that adds its parser and sets
``handler`` to a ``(argparse.Namespace) -> int`` function; adding a subcommand is adding a pair
of functions and naming the first in ``_REGISTRARS``.

Exit codes: 0 success, 2 bad input (a usage error or a refused flag, file or value: one line on
stderr, never a traceback), 1 anything else a handler reports as failure.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from fleet_sim.keys import (
    DEFAULT_TTL_S,
    GRANT_KEYS_FILE,
    KEYSET_FILES,
    TENANT_ROOT_FILE,
    derive_tenant_dek,
    generate_keyset,
    load_keyset,
    mint_grant,
)
from replica.errors import ReplicaError
from replica.keyfiles import read_key_file
from wire.errors import WireError

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
DEFAULT_WORKSPACE: Final = "/workspace"
DEFAULT_EXEC_URL: Final = "http://127.0.0.1:7700"
UP_SUBSTRATES: Final = ("local-dir", "leasefs", "juicefs")

Handler = Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """Bad input found after argument parsing; reported like an argparse error (exit 2)."""


# --- keys ---


def _register_keys(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "keys",
        help="write a fresh control-plane keyset",
        description=(
            "Write the control plane's keys into a new directory (mode 0700, files 0600): "
            + ", ".join(KEYSET_FILES)
            + f". Start replicas with each line of {GRANT_KEYS_FILE} as a --grant-key value, "
            "--seal-key DIR/seal.key and --notify-key DIR/notify.key. "
            f"{TENANT_ROOT_FILE} exists only so the simulator can derive tenant data keys."
        ),
    )
    parser.add_argument("--dir", required=True, type=Path, metavar="D", help="keys directory")
    parser.add_argument("--kid", default="k1", help="key id of the signing key (default: k1)")
    parser.add_argument("--force", action="store_true", help="replace an existing keyset in D")
    parser.set_defaults(handler=_run_keys)


def _run_keys(args: argparse.Namespace) -> int:
    keyset = generate_keyset(args.dir, kid=args.kid, force=args.force)
    print(f"wrote keyset to {keyset.directory}")
    for value in keyset.grant_key_args:
        print(f"  --grant-key {value}")
    print(f"  --seal-key {keyset.seal_key_path}")
    print(f"  --notify-key {keyset.notify_key_path}")
    return EXIT_OK


# --- grant ---


def _parse_header(value: str) -> tuple[str, str]:
    name, sep, header_value = value.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError("must be NAME=VALUE")
    return name, header_value


def _register_grant(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "grant",
        help="mint a grant for one session and print it",
        description=(
            "Print a signed x-beyond-grant for one session of one tenant. Without --dek-file the "
            f"tenant's data key is derived from {TENANT_ROOT_FILE} in the keys directory, a "
            "simulator convenience so every grant for a tenant carries the same key; a real "
            "control plane keeps per-tenant keys in its secret store."
        ),
    )
    parser.add_argument("--keys", required=True, type=Path, metavar="D", help="keys directory")
    parser.add_argument("--tenant", required=True, help="tenant name")
    parser.add_argument("--session", required=True, metavar="ID", help="session id <shard>.<id>")
    parser.add_argument(
        "--ttl",
        type=int,
        default=DEFAULT_TTL_S,
        metavar="S",
        help=f"lifetime in seconds (default: {DEFAULT_TTL_S}, at most one day)",
    )
    parser.add_argument(
        "--workspace",
        default=DEFAULT_WORKSPACE,
        metavar="PATH",
        help=f"workspace root in the sandbox (default: {DEFAULT_WORKSPACE})",
    )
    parser.add_argument(
        "--exec-url",
        default=DEFAULT_EXEC_URL,
        metavar="URL",
        help=f"sandbox exec endpoint (default: {DEFAULT_EXEC_URL})",
    )
    parser.add_argument(
        "--exec-header",
        action="append",
        default=[],
        type=_parse_header,
        metavar="NAME=VALUE",
        help="a header for the exec endpoint, sealed in the grant (repeatable)",
    )
    parser.add_argument(
        "--dek-file",
        type=Path,
        metavar="FILE",
        help="tenant data key file (32 bytes, base64url) instead of the derived one",
    )
    parser.set_defaults(handler=_run_grant)


def _run_grant(args: argparse.Namespace) -> int:
    keyset = load_keyset(args.keys)
    if args.dek_file is not None:
        dek = read_key_file(args.dek_file, what="tenant data")
    else:
        dek = derive_tenant_dek(keyset, args.tenant)
    headers: dict[str, str] = {}
    for name, value in args.exec_header:
        if name.lower() in (existing.lower() for existing in headers):
            raise UsageError(f"--exec-header {name} given twice")
        headers[name] = value
    token = mint_grant(
        keyset,
        tenant=args.tenant,
        session_id=args.session,
        workspace_root=args.workspace,
        exec_url=args.exec_url,
        dek=dek,
        exec_headers=headers,
        ttl_s=args.ttl,
    )
    print(token)
    return EXIT_OK


# --- up ---


def _register_up(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "up",
        help="run a whole local fleet (the main command)",
        description=(
            "Start the control plane, the sandbox service, a model server, two slices of three "
            "replicas on local-directory storage and one edge, all under --dir; print how to "
            "talk to a session. Ctrl-C drains and stops everything and leaves the data."
        ),
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path("fleet-data"),
        metavar="D",
        help="state directory: keys, shards, logs (default: ./fleet-data)",
    )
    parser.add_argument(
        "--listen",
        default="127.0.0.1:8080",
        metavar="HOST:PORT",
        help="the edge's address (default 127.0.0.1:8080; port 0 picks one)",
    )
    parser.add_argument(
        "--model",
        default="server",
        help="server (a local OpenAI-compatible mock server, the default), mock, "
        "stub:ttft=300ms,per_token=12ms,tokens=200, or openai:URL",
    )
    parser.add_argument(
        "--state",
        type=Path,
        metavar="FILE",
        help="write every process's URL and pid here as JSON, kept current as processes "
        "restart (default: D/state.json); `fleet-sim fault` finds the fleet through it",
    )
    parser.add_argument(
        "--substrate",
        default="local-dir",
        choices=UP_SUBSTRATES,
        help="where the shards live: local-dir (one directory, the default), leasefs (a FUSE "
        "mount per replica host that behaves like NFSv4: partitions and lease expiry), juicefs "
        "(JuiceFS on a Redis the fleet owns, one mount per replica host)",
    )
    parser.add_argument(
        "--restart",
        default="always",
        choices=("always", "never"),
        help="always (the default): a process that exits is started again after a backoff; "
        "never: it stays down (for experiments)",
    )
    parser.add_argument("--drain-grace", type=float, default=30.0, metavar="S")
    parser.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="the edge's and the replicas' log verbosity (default: info)",
    )
    parser.add_argument(
        "--web-listen",
        metavar="HOST:PORT",
        help="the session page's address, loopback only (default: the edge's port + 1; "
        "off: no page)",
    )
    parser.set_defaults(handler=_run_up)


def _run_up(args: argparse.Namespace) -> int:
    from fleet_sim.up import UpConfig, run

    if args.model != "server":
        from replica.model import parse_model_spec

        parse_model_spec(args.model)  # a bad spec is a usage error here, not six dead replicas
    from fleet_sim.webui.errors import ConfigError
    from fleet_sim.webui.process import web_listen

    try:
        web = web_listen(args.web_listen, args.listen)
    except ConfigError as exc:
        raise UsageError(f"--web-listen: {exc}") from None
    config = UpConfig(
        state_dir=args.dir.resolve(),
        listen=args.listen,
        model=args.model,
        drain_grace_s=args.drain_grace,
        web_listen=web,
        log_level=args.log_level,
    )
    if args.substrate == "juicefs":
        from fleet_sim.juicefs.binaries import juicefs_binary, redis_binary
        from fleet_sim.juicefs.errors import JuiceFsError

        try:
            juicefs_binary()
            redis_binary()
        except JuiceFsError as exc:
            raise UsageError(f"--substrate juicefs: {exc}") from None
    if args.substrate in ("leasefs", "juicefs"):
        from fleet_sim.leasefs.errors import LeaseFsError
        from fleet_sim.leasefs.mount import check_fuse_available

        try:
            check_fuse_available()
        except LeaseFsError as exc:
            raise UsageError(f"--substrate {args.substrate} needs FUSE: {exc}") from None
    state = args.state.resolve() if args.state else None
    return run(
        config,
        state,
        sys.stdout,
        substrate_name=args.substrate,
        restart=args.restart == "always",
    )


# --- fault ---


def _register_fault(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from fleet_sim.supervisor import VERBS

    parser = subparsers.add_parser(
        "fault",
        help="fault a process of a running `fleet-sim up`",
        description=(
            "Do one fault to one process of a running `fleet-sim up`, through that fleet's "
            "supervisor, and print what was done. kill: SIGKILL (the supervisor starts it "
            "again unless up ran with --restart never); freeze / thaw: SIGSTOP / SIGCONT, of a "
            "replica and its host's file-system client where the substrate has one (on leasefs "
            "its mount stops answering, so its lease runs out); drain: SIGTERM; partition / "
            "heal, hang / unhang: the replica's mount (leasefs, juicefs); restart: drain, then "
            "start again at once (or start a process that is down); metadata-restart metadata: "
            "kill JuiceFS's Redis and start it again from its log. pause, resume and term are the "
            "names deploy/*/fault.sh uses for freeze, thaw and drain. `status` lists the "
            "processes instead."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("verb", choices=[*VERBS, "status"], metavar="VERB", help="the fault")
    parser.add_argument(
        "target",
        nargs="?",
        metavar="TARGET",
        help="r1..r6, edge, control-plane, sandbox, model or page; `metadata` for "
        "metadata-restart (juicefs); none for status",
    )
    parser.add_argument(
        "--state",
        type=Path,
        default=Path("fleet-data") / "state.json",
        metavar="FILE",
        help="the fleet's state file (default: ./fleet-data/state.json, as `fleet-sim up` "
        "writes it by default)",
    )
    parser.set_defaults(handler=_run_fault)


def _run_fault(args: argparse.Namespace) -> int:
    from fleet_sim.upctl import ControlError, fault, owned_sessions, read_state, status

    try:
        if args.verb == "status":
            if args.target:
                raise UsageError("status takes no target")
            rows = status(args.state)
            owned = owned_sessions(read_state(args.state))
            print(f"{'PROCESS':<14} {'PID':>7}  {'STATE':<9} {'RESTARTS':>8}  {'STORAGE':<9} OWNS")
            for row in rows:
                owns = owned.get(row["name"])
                print(
                    f"{row['name']:<14} {row['pid']:>7}  {row['state']:<9} "
                    f"{row['restarts']:>8}  {' '.join(row['storage']) or '-':<9} "
                    + ("-" if owns is None else " ".join(owns) or "no session")
                )
            return EXIT_OK
        if not args.target:
            raise UsageError(f"{args.verb} needs a TARGET (a process of the fleet, e.g. r1)")
        print(fault(args.state, args.verb, args.target))
        return EXIT_OK
    except ControlError as exc:
        print(f"fleet-sim fault: {exc}", file=sys.stderr)
        return EXIT_FAILED


# --- chat ---


def _register_chat(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "chat",
        help="talk to a session through the edge",
        description="Hold a session over a WebSocket through the edge: type prompts, watch the "
        "stream. With --message, send one prompt, print the turn and exit.",
    )
    parser.add_argument("--edge", required=True, help="the edge's URL")
    parser.add_argument("--session", required=True, metavar="ID")
    parser.add_argument("--grant", required=True, help="the session's x-beyond-grant")
    parser.add_argument("--message", help="send this one prompt and exit after its turn")
    parser.set_defaults(handler=_run_chat)


def _run_chat(args: argparse.Namespace) -> int:
    import asyncio

    from fleet_sim.chat import chat

    return asyncio.run(chat(args.edge, args.session, args.grant, args.message))


# --- scenarios ---


def _register_scenarios(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from fleet_sim.sim.commands import register

    register(subparsers)


# --- wiring ---

_REGISTRARS: Final[
    tuple[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None], ...]
] = (
    _register_up,
    _register_fault,
    _register_chat,
    _register_scenarios,
    _register_keys,
    _register_grant,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleet-sim",
        description="Run and prove a fleet of edge and replicas on one machine.",
        epilog=(
            "example:\n"
            "  fleet-sim up                 # a whole fleet on this machine\n"
            "  fleet-sim fault kill r1      # kill a replica of it (it comes back)\n"
            "  fleet-sim keys --dir ./keys\n"
            "  fleet-sim grant --keys ./keys --tenant acme --session a07-s3.demo\n\n"
            "Run 'fleet-sim COMMAND --help' for a command's options."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in _REGISTRARS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        # argparse has already printed usage or help; keep main() a function that returns.
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    handler: Handler = args.handler
    try:
        return handler(args)
    except (ReplicaError, WireError, UsageError) as exc:
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        print(f"{parser.prog} {args.command}: error: {exc.strerror}{where}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    raise SystemExit(main())
