"""Grading: pure functions from recorded histories (and what storage holds) to verdicts.

A verdict is never a bare boolean: it names its claim, says ``pass``, ``fail`` or ``unknown``,
and carries the figures it was decided on and the errors it found, so a result can be read (and
argued with) without running anything again.
"""

from __future__ import annotations

import itertools
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fleet_sim.sim.journal import Op
from replica.history import History

Verdict = Literal["pass", "fail", "unknown"]
TOKEN = re.compile(r"\bop-[0-9a-f]{12}\b")
MAX_ERRORS = 20


@dataclass(frozen=True, slots=True)
class ClaimResult:
    claim: str
    verdict: Verdict
    figures: Mapping[str, Any] = field(default_factory=dict)
    errors: Sequence[str] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "claim": self.claim,
            "verdict": self.verdict,
            "figures": dict(self.figures),
            "errors": list(self.errors)[:MAX_ERRORS],
        }


def verdict(
    claim: str, errors: list[str], figures: Mapping[str, Any], *, unknown: bool = False
) -> ClaimResult:
    outcome: Verdict = "fail" if errors else ("unknown" if unknown else "pass")
    return ClaimResult(claim, outcome, figures, errors)


def prompt_tokens(history: History) -> Counter[str]:
    """How many committed user messages carry each operation token (across conversations)."""
    counts: Counter[str] = Counter()
    for message in history.transcript.messages:
        if message.role == "user":
            counts.update(TOKEN.findall(message.content))
    return counts


def no_acknowledged_turn_lost_or_duplicated(
    ops: Iterable[Op], histories: Mapping[str, History]
) -> ClaimResult:
    """Every acknowledged prompt is in storage exactly once; an unknown one at most once; a
    failed one never; every acknowledged prompt has its reply after it."""
    errors: list[str] = []
    figures: Counter[str] = Counter()
    stored: dict[str, Counter[str]] = {}  # per session, read once: a long soak has many ops
    for op in ops:
        if op.op != "prompt":
            continue
        figures[op.outcome] += 1
        history = histories.get(op.session_id)
        if history is None:
            errors.append(f"{op.session_id}: no stored history")
            continue
        tokens = stored.get(op.session_id)
        if tokens is None:
            tokens = stored[op.session_id] = prompt_tokens(history)
        count = tokens[op.token]
        if op.outcome == "ok" and count != 1:
            figures["lost" if count == 0 else "duplicated"] += 1
            errors.append(f"{op.session_id}: acknowledged {op.token} stored {count} times")
        elif op.outcome == "unknown" and count > 1:
            figures["duplicated"] += 1
            errors.append(f"{op.session_id}: {op.token} (unknown) stored {count} times")
        elif op.outcome == "fail" and count:
            figures["failed_but_stored"] += 1
            errors.append(f"{op.session_id}: {op.token} failed but was stored")
    figures.setdefault("lost", 0)
    figures.setdefault("duplicated", 0)
    return verdict("no-acknowledged-turn-lost-or-duplicated", errors, dict(figures))


def one_writer_per_epoch(histories: Mapping[str, History]) -> ClaimResult:
    """Segments are contiguous by epoch, each sealed by its successor at a record boundary
    (replay already refuses anything else), and the figures say how often ownership moved."""
    errors: list[str] = []
    segments = ignored = torn_headers = 0
    for sid, history in histories.items():
        epochs = [s.epoch for s in history.segments]
        if epochs != list(range(1, len(epochs) + 1)):
            errors.append(f"{sid}: epochs {epochs} are not contiguous")
        valid = [s for s in history.segments if not s.header_torn]
        for before, after in itertools.pairwise(valid):
            if after.prev_epoch != before.epoch or after.seals_prev_at != before.bound:
                errors.append(f"{sid}: segment {after.epoch} does not seal {before.epoch}")
        segments += len(history.segments)
        ignored += sum(s.ignored_bytes for s in history.segments if s.bound is not None)
        torn_headers += sum(1 for s in history.segments if s.header_torn)
    figures = {
        "sessions": len(histories),
        "segments": segments,
        "bytes_ignored_past_seals": ignored,
        "torn_headers": torn_headers,
    }
    return verdict("one-writer-per-epoch", errors, figures)


def every_transcript_verifies(
    sessions: Iterable[str], histories: Mapping[str, History], failures: Mapping[str, str]
) -> ClaimResult:
    errors = [f"{sid}: {failures[sid]}" for sid in sessions if sid in failures]
    return verdict(
        "every-transcript-verifies", errors, {"verified": len(histories), "failed": len(failures)}
    )


def nobody_gave_up(
    ops: Iterable[Op], *, kinds: Sequence[str] = ("prompt", "attach")
) -> ClaimResult:
    """No client was refused inside the edge's budget: no operation failed outright."""
    relevant = [op for op in ops if op.op in kinds]
    failed = [op for op in relevant if op.outcome == "fail"]
    errors = [f"{op.session_id}: {op.op} failed: {op.detail}" for op in failed]
    return verdict(
        "nobody-gave-up-inside-the-budget",
        errors,
        {"operations": len(relevant), "refused": len(failed)},
    )


def sessions_reachable(reached: Mapping[str, bool]) -> ClaimResult:
    errors = [f"{sid}: unreachable at the end" for sid, ok in reached.items() if not ok]
    return verdict(
        "sessions-reachable", errors, {"sessions": len(reached), "reachable": sum(reached.values())}
    )


def latency_figures(samples: Sequence[float], prefix: str) -> dict[str, float]:
    if not samples:
        return {f"{prefix}_count": 0}
    ordered = sorted(samples)
    return {
        f"{prefix}_count": len(ordered),
        f"{prefix}_median_s": round(statistics.median(ordered), 4),
        f"{prefix}_max_s": round(ordered[-1], 4),
    }


def takeover_times(
    ops: Sequence[Op], fault_at: float, sessions: Iterable[str], *, began_after: bool = False
) -> list[float]:
    """For each session, from the fault to the end of its first ok operation that ended after
    the fault: how long the session was unavailable to its client. With ``began_after``, only an
    operation begun after the fault counts: after a freeze, a turn done just before it still
    ends later, its client waiting for a close frame the stopped owner never sends."""
    by_session: dict[str, list[Op]] = defaultdict(list)
    for op in ops:
        by_session[op.session_id].append(op)
    times = []
    for sid in sessions:
        after = sorted(
            (
                op
                for op in by_session.get(sid, ())
                if op.ended >= fault_at
                and op.outcome == "ok"
                and (op.started >= fault_at or not began_after)
            ),
            key=lambda o: o.ended,
        )
        if after:
            times.append(after[0].ended - fault_at)
    return times


def paused_owner_stalls_only_its_own(
    ops: Sequence[Op], paused_at: float, resumed_at: float, held: Iterable[str]
) -> ClaimResult:
    """While an owner is stopped, sessions it does not hold are still served: every operation on
    them begun in the first half of the pause ended ok before the pause did. The sessions it
    holds wait: what they had in flight at the resume ends ok after it."""
    own = set(held)
    half = paused_at + (resumed_at - paused_at) / 2
    prompts = [op for op in ops if op.op == "prompt"]
    others = [op for op in prompts if op.session_id not in own and paused_at <= op.started <= half]
    errors = [
        f"{op.session_id}: a turn begun {op.started - paused_at:.1f}s into the pause "
        + (f"ended {op.outcome} ({op.detail})" if op.outcome != "ok" else "waited for the resume")
        for op in others
        if op.outcome != "ok" or op.ended > resumed_at
    ]
    if not others:
        errors.append("no session of another replica was exercised during the pause")
    waited = [op for op in prompts if op.session_id in own and op.started < resumed_at < op.ended]
    errors += [
        f"{op.session_id}: a turn held over the pause ended {op.outcome} ({op.detail})"
        for op in waited
        if op.outcome != "ok"
    ]
    figures = {
        "paused_s": round(resumed_at - paused_at, 2),
        "other_turns_during_pause": len(others),
        "other_turn_max_s": round(max((op.seconds for op in others), default=0.0), 3),
        "own_turns_held_over": len(waited),
        "own_turn_max_s": round(max((op.seconds for op in waited), default=0.0), 3),
    }
    return verdict("paused-owner-stalls-only-its-own", errors, figures)
