"""The catalogue's callback scenarios: the edge held to rules E1-E7 for a sandbox's job-end
callback, with raw bytes on real sockets. Exactly one well-formed Bearer header is a callback
(E1); it is forwarded unchanged (E2) and routed as any request (E3); the edge answers within its
callback budget (E4), passes the replica's status through (E5), limits callbacks per session
(E6) and never logs a token (E7).

Some rules need a replica that misbehaves on purpose (never answers, answers a chosen status,
reports the exact bytes it got). For those a scenario starts a stand-in replica of its own
(:class:`fleet_sim.sim.standin.Backend`) and a second edge process whose one slice is that
backend, next to the real fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from pathlib import Path
from typing import Any, Final

from edge.core.config import EdgeOptions, parse_config_text
from edge.core.errors import ConfigError
from edge.core.retry import CALLBACK_BUDGET_S
from fleet_sim.sim.checkers import ClaimResult, verdict
from fleet_sim.sim.job_queries import (
    ANYWHERE,
    LOCAL,
    committed_holder,
    held_job,
    lifecycle_events,
    prompt,
    recount,
    release,
    sessions_with_one_owner,
    start_job,
    told_exactly_once,
    wait_told,
    with_errors,
)
from fleet_sim.sim.observe import metric, replica_metric, scrape, tokens_in_memory
from fleet_sim.sim.rawhttp import (
    HOP_BY_HOP,
    Headers,
    Wire,
    callback_request,
    callback_target,
    chunked,
    request_bytes,
    send_raw,
    send_together,
)
from fleet_sim.sim.scenario import Context, scenario
from fleet_sim.sim.scenarios_core import STANDARD
from fleet_sim.sim.standin import Backend, edge_in_front_of
from fleet_sim.up import SLICES
from replica.keyfiles import read_key_file
from replica.notify import NotifyKey, NotifyTokenError


def notify_key(ctx: Context) -> NotifyKey:
    return NotifyKey(read_key_file(ctx.fleet.keys_dir / "notify.key", what="notify key"))


# == E1-E7: the edge and callbacks ================================================================


@scenario(
    "job-ended-classified-exactly", claims=("job-ended-classified-exactly",), substrates=ANYWHERE
)
def classified_exactly(ctx: Context) -> list[ClaimResult]:
    """E1 on the wire: exactly one 'Bearer bjn_v1.' header is a callback and is forwarded; two
    headers, a tab, no space or a non-UTF-8 value is refused 400 by the edge and forwarded
    nowhere; a token on GET events or a WebSocket upgrade is refused 403; a repeated session_id
    is refused 400."""
    session = ctx.sessions(1)[0]
    sid, tenant = session.session_id, session.tenant
    token = notify_key(ctx).mint(tenant, sid).encode()
    target = callback_target(sid, tenant)
    ws_headers: Headers = [
        (b"Host", b"fleet.example"),
        (b"Authorization", b"Bearer " + token),
        (b"Upgrade", b"websocket"),
        (b"Connection", b"Upgrade"),
        (b"Sec-WebSocket-Key", b"dGhlIHNhbXBsZSBub25jZQ=="),
        (b"Sec-WebSocket-Version", b"13"),
    ]
    get_headers: Headers = [
        (b"Host", b"fleet.example"),
        (b"Authorization", b"Bearer " + token),
        (b"Connection", b"close"),
    ]
    refused: dict[str, tuple[bytes, int]] = {
        "two Authorization headers": (
            callback_request(target, b"Bearer " + token, b"Bearer " + token),
            400,
        ),
        "Bearer and Basic": (
            callback_request(target, b"Bearer " + token, b"Basic dXNlcjpwdw=="),
            400,
        ),
        "a tab": (callback_request(target, b"Bearer\t" + token), 400),
        "a space then a tab": (callback_request(target, b"Bearer \t" + token), 400),
        "no space": (callback_request(target, b"Bearer" + token), 400),
        "not UTF-8": (callback_request(target, b"Bearer " + token + b"\xff\xfe"), 400),
        "on GET events": (
            request_bytes("GET", f"/_beyond/agent/events?session_id={sid}", get_headers),
            403,
        ),
        "on a WebSocket upgrade": (
            request_bytes("GET", f"/_beyond/agent?session_id={sid}", ws_headers),
            403,
        ),
        "session_id twice": (
            callback_request(
                f"/_beyond/agent?session_id={sid}&tenant={tenant}&session_id={sid}",
                b"Bearer " + token,
            ),
            400,
        ),
        "session_id twice, once encoded": (
            callback_request(
                f"/_beyond/agent?session_id={sid}&session%5Fid={sid}", b"Bearer " + token
            ),
            400,
        ),
    }
    edge_metrics = ctx.fleet.edge_metrics_url

    def replica_side() -> float:
        return replica_metric(ctx, "agent_refusals_total") + replica_metric(
            ctx, "agent_job_callbacks_total"
        )

    before_replicas = replica_side()
    before_rejected = metric(scrape(edge_metrics), "edge_requests_total", outcome="rejected")
    errors: list[str] = []
    answers: dict[str, int] = {}
    for name, (data, expected) in refused.items():
        got = ctx.run(send_raw(ctx.edge, data))
        answers[name] = got.status
        if got.status != expected:
            errors.append(f"{name}: the edge answered {got.status}, not {expected}")
        if token in got.body or token[7:] in got.body:
            errors.append(f"{name}: the answer quotes the token")
    rejected = metric(scrape(edge_metrics), "edge_requests_total", outcome="rejected")
    reached_replicas = replica_side() - before_replicas
    if reached_replicas:
        errors.append(f"{reached_replicas:g} refused requests reached a replica anyway")
    if edge_metrics and rejected - before_rejected != len(refused):
        errors.append(
            f"the edge counted {rejected - before_rejected:g} rejections for {len(refused)}"
        )
    # The one well-formed callback: forwarded, and since nobody holds the session, the replica
    # that gets it hands the report to the control plane.
    good = ctx.run(send_raw(ctx.edge, callback_request(target, b"bearer   " + token)))
    answers["exactly one Bearer header"] = good.status
    handed = lifecycle_events(ctx, "job_ended", sid)
    if good.status not in (200, 202):
        errors.append(f"a well-formed callback was answered {good.status}: {good.body[:200]!r}")
    elif good.status == 202 and len(handed) != 1:
        errors.append(f"handed off, but the control plane holds {len(handed)} reports")
    figures = {
        "answers": answers,
        "refused_cases": len(refused),
        "refused_requests_reaching_a_replica": reached_replicas,
        "edge_rejections_counted": rejected - before_rejected,
        "well_formed_answer": good.body.decode("utf-8", "replace")[:200],
        "control_plane_reports": len(handed),
    }
    return [verdict("job-ended-classified-exactly", errors, figures)]


@scenario(
    "job-ended-forwarded-unchanged",
    claims=("job-ended-forwarded-unchanged", "real-callbacks-verify-at-the-replica"),
    substrates=LOCAL,
)
def forwarded_unchanged(ctx: Context) -> list[ClaimResult]:
    """E2: what a replica receives is what the sandbox sent (target, every end-to-end header,
    Content-Length or Transfer-Encoding, the body bytes), recorded by a stand-in replica behind a
    second edge; and on the real fleet a real job's callback still verifies at the replica."""
    sid = f"a07-s1.{secrets.token_urlsafe(9)}"
    token = notify_key(ctx).mint("t-forward", sid).encode()
    target = callback_target(sid, "t-forward")
    body = json.dumps(
        {"type": "job_ended", "job_id": "j" + "0" * 16, "status": "exited", "exit_code": 0},
        separators=(", ", ": "),
    ).encode()
    sent: dict[str, tuple[str, Headers, bytes]] = {
        "content-length": (
            target,
            [
                (b"Host", b"sandbox-callbacks.example"),
                (b"Authorization", b"Bearer  " + token),
                (b"Content-Type", b"application/json"),
                (b"X-Sandbox-Id", b"sbx-7"),
                (b"x-beyond-grant", b"not-for-the-edge"),
                (b"Accept-Encoding", b"gzip, deflate"),
                (b"Content-Length", str(len(body)).encode()),
                (b"Connection", b"close"),
            ],
            body,
        ),
        "chunked": (
            target,
            [
                (b"Host", b"sandbox-callbacks.example"),
                (b"Authorization", b"BEARER " + token),
                (b"Content-Type", b"application/json"),
                (b"Transfer-Encoding", b"chunked"),
                (b"Connection", b"close"),
            ],
            body,
        ),
    }
    backend = Backend(lambda wire: (200, b"recorded"))
    errors: list[str] = []
    compared: dict[str, Any] = {}
    with edge_in_front_of(ctx, backend) as (edge_url, _):
        for name, (path, headers, payload) in sent.items():
            framed = chunked(payload) if name == "chunked" else payload
            got = ctx.run(send_raw(edge_url, request_bytes("POST", path, headers, framed)))
            if (got.status, got.body) != (200, b"recorded"):
                errors.append(f"{name}: the caller got {got.status} {got.body[:100]!r}")
        seen = backend.received
    if len(seen) != len(sent):
        errors.append(f"the stand-in replica saw {len(seen)} requests for {len(sent)} sent")
    for (name, (path, headers, payload)), got_wire in zip(sent.items(), seen, strict=False):
        wire = got_wire.wire
        want = [(n, v) for n, v in headers if n.lower() not in HOP_BY_HOP]
        have = [(n, v) for n, v in wire.headers if n.lower() not in HOP_BY_HOP]
        same_headers = [(n.lower(), v) for n, v in want] == [(n.lower(), v) for n, v in have]
        compared[name] = {
            "target_unchanged": wire.target == path,
            "headers_unchanged": same_headers,
            "body_unchanged": wire.body == payload,
            "content_length": [v.decode() for v in wire.header("content-length")],
            "transfer_encoding": [v.decode() for v in wire.header("transfer-encoding")],
        }
        if wire.target != path:
            errors.append(f"{name}: the target became {wire.target!r}")
        if not same_headers:
            missing = [n.decode() for n, v in want if (n, v) not in have]
            added = [n.decode() for n, v in have if (n, v) not in want]
            errors.append(f"{name}: headers changed (missing {missing}, added {added})")
        if wire.body != payload:
            errors.append(f"{name}: the body changed")
        if name == "chunked" and (
            wire.header("transfer-encoding") != [b"chunked"] or wire.header("content-length")
        ):
            errors.append("chunked: the framing changed on the way")
    claims = [
        verdict(
            "job-ended-forwarded-unchanged",
            errors,
            {"requests": len(sent), "compared": compared},
        )
    ]
    # On the real fleet, through the real edge: a job's real callback verifies at the replica
    # (a changed byte of the token or of the query would be a 401 or 403), and the edge checks
    # nothing itself: a forged token goes through and the replica refuses it.
    session = ctx.sessions(1)[0]
    job = start_job(ctx, session, "sleep 0.5; echo forwarded")
    telling = wait_told(ctx, session, job)
    forged = NotifyKey(bytes(32)).mint(session.tenant, session.session_id).encode()
    refused = ctx.run(
        send_raw(
            ctx.edge,
            callback_request(
                callback_target(session.session_id, session.tenant), b"Bearer " + forged
            ),
        )
    )
    real_errors = []
    if not telling.path or telling.path[-1] not in (200, 202):
        real_errors.append(f"the real callback's attempts were answered {list(telling.path)}")
    if refused.status != 401:
        real_errors.append(f"a forged token came back {refused.status}, not the replica's 401")
    claims.append(
        with_errors(
            told_exactly_once(
                "real-callbacks-verify-at-the-replica",
                [telling],
                {"forged_token_answer": refused.status},
            ),
            real_errors,
        )
    )
    return claims


@scenario(
    "job-ended-routed-as-any-request",
    claims=("job-ended-routed-as-any-request", *STANDARD),
    substrates=LOCAL,
)
def routed_as_any_request(ctx: Context) -> list[ClaimResult]:
    """E3: with the owner drained, two sessions open on the next replica of their walk. One job
    ends while the owner is down: its callback walks to the holder. The other ends once the
    owner is back: the owner does not hold the session, hands the report off, and the control
    plane's wake reaches the holder. Either way the model is told once."""
    first, second = sessions_with_one_owner(ctx, 2)
    owner = ctx.owner(first.session_id)
    ctx.faults.drain(owner)
    walked_job = start_job(ctx, first, held_job("end", "walked"))
    handed_job = start_job(ctx, second, held_job("end", "handed-off"))
    release(ctx, first)
    walked = wait_told(ctx, first, walked_job, settle_s=0)
    ctx.faults.restart(owner)
    ctx.faults.wait_ready(owner)
    release(ctx, second)
    handed = wait_told(ctx, second, handed_job)
    walked = recount(ctx, first, walked)
    holders = committed_holder(ctx, [first, second])
    claim = told_exactly_once(
        "job-ended-routed-as-any-request",
        [walked, handed],
        {
            "owner": owner,
            "holders": holders,
            "reports_handed_to_the_control_plane": len(
                lifecycle_events(ctx, "job_ended", second.session_id)
            ),
        },
    )
    premise = [f"{sid} is held by its owner" for sid, h in holders.items() if h == owner]
    return [with_errors(claim, premise), *ctx.standard_claims([first, second])]


@scenario(
    "job-ended-answers-within-25s", claims=("job-ended-answers-within-25s",), substrates=LOCAL
)
def answers_within_budget(ctx: Context) -> list[ClaimResult]:
    """E4: a replica that never answers a callback: the edge answers 503 within its callback
    budget (at most 25 s; a shorter one in --quick) and cancels the request upstream, so the
    replica sees it go away."""
    budget = 3.0 if ctx.quick else CALLBACK_BUDGET_S
    backend = Backend(lambda wire: None)
    sid = f"a07-s1.{secrets.token_urlsafe(9)}"
    token = notify_key(ctx).mint("t-hang", sid).encode()
    errors = []
    with edge_in_front_of(ctx, backend, callback_budget_s=budget) as (edge_url, _):
        got = ctx.run(
            send_raw(edge_url, callback_request(callback_target(sid), b"Bearer " + token))
        )
        answered_at = time.time()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(r.cancelled_at for r in backend.received):
            time.sleep(0.05)
        seen = backend.received
    if got.status != 503:
        errors.append(f"the edge answered {got.status}, not 503")
    if not got.header("retry-after"):
        errors.append("the 503 carries no Retry-After")
    if got.seconds > budget + 1.0:
        errors.append(f"the answer took {got.seconds:.2f} s for a {budget:g} s budget")
    if got.seconds < budget - 0.05:
        errors.append(f"the edge gave up after {got.seconds:.2f} s, before its {budget:g} s")
    cancelled = [r.cancelled_at for r in seen if r.cancelled_at is not None]
    if not seen:
        errors.append("the callback never reached the stand-in replica")
    elif not cancelled:
        errors.append("the stand-in replica still held the request 5 s after the edge's 503")
    # Nobody can configure the edge past 25 s, and 25 s is what it does when not told.
    default_budget = EdgeOptions().callback_budget_s
    try:
        parse_config_text(
            '[edge]\ncallback_budget_s = 26.0\n[[slice]]\nname = "a07"\n'
            'replicas = [{ name = "r", url = "http://127.0.0.1:9" }]\n'
        )
        errors.append("an edge config with callback_budget_s = 26 was accepted")
    except ConfigError:
        pass
    if default_budget > CALLBACK_BUDGET_S:
        errors.append(f"the default callback budget is {default_budget:g} s")
    figures = {
        "budget_s": budget,
        "default_budget_s": default_budget,
        "status": got.status,
        "answered_after_s": round(got.seconds, 3),
        "requests_seen_upstream": len(seen),
        "upstream_cancelled_after_answer_s": (
            round(max(0.0, cancelled[0] - answered_at), 3) if cancelled else None
        ),
    }
    return [verdict("job-ended-answers-within-25s", errors, figures)]


E5_STATUSES: Final = (200, 400, 401, 403, 404, 410, 411, 413, 503)


@scenario(
    "job-ended-status-passes-through",
    claims=("job-ended-status-passes-through", "real-replica-answers-pass-through"),
    substrates=LOCAL,
)
def status_passes_through(ctx: Context) -> list[ClaimResult]:
    """E5: each status a replica answers a callback with (200, 400, 401, 403, 404, 410, 411, 413,
    503) reaches the sandbox unchanged, with the replica's body; and the real replicas'
    refusals come back through the real edge exactly as the replica gives them directly."""
    by_session = {f"a07-s1.st{status}x{secrets.token_hex(4)}": status for status in E5_STATUSES}

    def script(wire: Wire) -> tuple[int, bytes]:
        sid = wire.target.partition("session_id=")[2].partition("&")[0]
        status = by_session.get(sid, 500)
        return status, f"replica says {status}".encode()

    backend = Backend(script)
    key = notify_key(ctx)
    errors = []
    answers: dict[int, dict[str, Any]] = {}
    # The 503 is retried and walked (E3) until the callback budget; keep that short here.
    with edge_in_front_of(ctx, backend, callback_budget_s=2.0) as (edge_url, _):
        for sid, status in by_session.items():
            token = key.mint("t-status", sid).encode()
            got = ctx.run(
                send_raw(edge_url, callback_request(callback_target(sid), b"Bearer " + token))
            )
            answers[status] = {"got": got.status, "seconds": round(got.seconds, 3)}
            if got.status != status:
                errors.append(f"the replica answered {status}; the sandbox got {got.status}")
            elif status != 503 and got.body != f"replica says {status}".encode():
                errors.append(f"{status}: the replica's body was not passed on")
            elif status == 503 and not got.header("retry-after"):
                errors.append("503 came back without Retry-After")
        seen = backend.received
    tries = {
        status: sum(1 for r in seen if sid in r.wire.target) for sid, status in by_session.items()
    }
    for status, count in tries.items():
        if status != 503 and count != 1:
            errors.append(f"{status}: the replica was asked {count} times")
    claims = [
        verdict(
            "job-ended-status-passes-through",
            errors,
            {"answers": answers, "upstream_attempts": tries},
        )
    ]
    # The real replicas: each refusal through the edge equals the refusal got directly.
    session = ctx.sessions(1)[0]
    sid, tenant = session.session_id, session.tenant
    good = key.mint(tenant, sid).encode()
    other = key.mint(tenant, f"{sid[:-1]}{'A' if sid[-1] != 'A' else 'B'}").encode()
    forged = NotifyKey(bytes(32)).mint(tenant, sid).encode()
    target = callback_target(sid, tenant)
    cases = {
        "forged token": callback_request(target, b"Bearer " + forged),
        "token for another session": callback_request(target, b"Bearer " + other),
        "body that is not a job_ended": callback_request(
            target, b"Bearer " + good, body=b'{"type":"prompt"}'
        ),
        "body over 64 KiB": callback_request(
            target, b"Bearer " + good, body=b'{"type":"job_ended","pad":"' + b"x" * 70_000 + b'"}'
        ),
    }
    owner_url = ctx.fleet.replicas[ctx.owner(sid)][1].url
    real: dict[str, dict[str, int]] = {}
    real_errors = []
    for name, data in cases.items():
        direct = ctx.run(send_raw(owner_url, data))
        through = ctx.run(send_raw(ctx.edge, data))
        real[name] = {"direct": direct.status, "through_the_edge": through.status}
        if (through.status, through.body) != (direct.status, direct.body):
            real_errors.append(
                f"{name}: the replica answers {direct.status}, the edge passed on {through.status}"
            )
        if direct.status < 400:
            real_errors.append(f"{name}: the replica accepted it ({direct.status})")
    claims.append(verdict("real-replica-answers-pass-through", real_errors, {"answers": real}))
    return claims


@scenario(
    "job-ended-rate-limited-per-session",
    claims=("job-ended-rate-limited-per-session",),
    substrates=ANYWHERE,
)
def rate_limited_per_session(ctx: Context) -> list[ClaimResult]:
    """E6: 30 callbacks for one session land on the real edge inside a second: 20 are forwarded
    to the holder and the excess is answered 429 by the edge; another session's callback in the
    same burst is not limited."""
    session, bystander = ctx.sessions(2)
    prompt(ctx, session, "open the session")  # held, so callbacks end in a reconcile
    key = notify_key(ctx)
    mine = callback_request(
        callback_target(session.session_id, session.tenant),
        b"Bearer " + key.mint(session.tenant, session.session_id).encode(),
    )
    theirs = callback_request(
        callback_target(bystander.session_id, bystander.tenant),
        b"Bearer " + key.mint(bystander.tenant, bystander.session_id).encode(),
    )
    edge_metrics = ctx.fleet.edge_metrics_url
    before = metric(scrape(edge_metrics), "edge_callbacks_rate_limited_total", scope="session")
    answers, spread = ctx.run(send_together(ctx.edge, [mine] * 30 + [theirs]))
    after = metric(scrape(edge_metrics), "edge_callbacks_rate_limited_total", scope="session")
    statuses = [a.status for a in answers[:30]]
    limited = [a for a in answers[:30] if a.status == 429]
    figures = {
        "sent": 30,
        "writes_took_s": round(spread, 3),
        "answered_429": len(limited),
        "forwarded_answers": sorted({s for s in statuses if s != 429}),
        "bystander_answer": answers[30].status,
        "edge_counted_session_limit": after - before,
    }
    errors = []
    if spread >= 0.5:
        # All of them must have arrived inside one second for the count to be exact.
        return [verdict("job-ended-rate-limited-per-session", [], figures, unknown=True)]
    if len(limited) != 10:
        errors.append(f"{len(limited)} of 30 callbacks were answered 429, not 10")
    if any(not a.header("retry-after") for a in limited):
        errors.append("a 429 carries no Retry-After")
    if any(s not in (200, 202, 429) for s in statuses):
        errors.append(f"forwarded callbacks were answered {sorted(set(statuses))}")
    if answers[30].status == 429:
        errors.append("another session's callback was limited too")
    if edge_metrics and after - before != len(limited):
        errors.append(f"the edge counted {after - before:g} session limits")
    return [verdict("job-ended-rate-limited-per-session", errors, figures)]


@scenario(
    "job-ended-token-never-logged",
    claims=("job-ended-token-never-logged", "no-plaintext-on-the-shard"),
    substrates=LOCAL,
)
def token_never_logged(ctx: Context) -> list[ClaimResult]:
    """E7: after real jobs' callbacks, and a token of our own sent well-formed and malformed
    through the edge, no log, journal, state or shard file of the fleet holds any token the
    sandbox was given (read from the sandbox's memory), and the shard holds no plaintext."""
    sessions = ctx.sessions(2)
    canaries = {f"PLAINTEXT-{secrets.token_hex(6)}", f"JOBOUTPUT-{secrets.token_hex(6)}"}
    said, printed = sorted(canaries)[1], sorted(canaries)[0]
    jobs = []
    for s in sessions:
        job = start_job(ctx, s, f"echo {printed}; sleep 0.5")
        jobs.append((s, job))
        prompt(ctx, s, f"read: {job} 0\n{said}")
    tellings = [wait_told(ctx, s, j, settle_s=0) for s, j in jobs]
    session = sessions[0]
    mine = notify_key(ctx).mint(session.tenant, session.session_id).encode()
    target = callback_target(session.session_id, session.tenant)
    for data in (
        callback_request(target, b"Bearer " + mine),
        callback_request(target, b"Bearer\t" + mine),
        callback_request(target, b"Bearer " + mine, b"Bearer " + mine),
        callback_request(target, b"Bearer " + mine + b"\x01"),  # unparseable: quoted by aiohttp
        request_bytes(
            "GET",
            f"/_beyond/agent/events?session_id={session.session_id}",
            [(b"Host", b"x"), (b"Authorization", b"Bearer " + mine), (b"Connection", b"close")],
        ),
    ):
        with contextlib.suppress(OSError, ValueError, asyncio.IncompleteReadError):
            ctx.run(send_raw(ctx.edge, data, timeout_s=30))
    wanted = {s.session_id for s in sessions}
    key = notify_key(ctx)
    shaped, problem = tokens_in_memory(ctx.local.fleet.sandbox.proc.proc.pid)
    given: set[bytes] = set()
    for candidate in shaped:
        with contextlib.suppress(NotifyTokenError, UnicodeDecodeError):
            if key.verify(candidate.decode()).session_id in wanted:
                given.add(candidate)
    # Stop everything first, so whatever a process writes on its way out is scanned too.
    ctx.fleet.stop(drain_timeout_s=20)
    needles = {t: t for t in given | {mine}}
    needles |= {t[len(b"bjn_v1.") :]: t for t in list(needles)}
    shard_roots = [
        Path(ctx.substrate.backing(shard)) for shards in SLICES.values() for shard in shards
    ]
    leaks: list[str] = []
    plaintext: list[str] = []
    files = scanned_bytes = 0
    for path in sorted(ctx.out_dir.rglob("*")):
        if "mnt" in path.relative_to(ctx.out_dir).parts[:1] or not path.is_file():
            continue  # leasefs mounts show the backing directory a second time
        if path.is_symlink():
            continue
        data = path.read_bytes()
        files += 1
        scanned_bytes += len(data)
        for needle in needles:
            if needle in data:
                leaks.append(f"{path.relative_to(ctx.out_dir)} holds a notify token")
                break
        if any(root in path.parents for root in shard_roots):
            plaintext += [
                f"{path.relative_to(ctx.out_dir)} holds {c[:9]} in plaintext"
                for c in canaries
                if c.encode() in data
            ]
    figures: dict[str, Any] = {
        "files_scanned": files,
        "bytes_scanned": scanned_bytes,
        "tokens_from_the_sandbox": len(given),
        "tokens_minted_here": 1,
        "jobs": len(jobs),
        "jobs_told_once": sum(1 for t in tellings if t.told == 1),
    }
    if problem:
        figures["memory"] = problem
    token_claim = verdict(
        "job-ended-token-never-logged",
        leaks,
        figures,
        unknown=len(given) < len(jobs),  # not every real token was found to look for
    )
    return [
        token_claim,
        verdict("no-plaintext-on-the-shard", plaintext, {"canaries": len(canaries)}),
    ]
