"""The history a workload records: one JSON line per operation, written as it happens.

Every client operation ends in exactly one outcome: ``ok`` (the effect is known to have happened
and was acknowledged), ``fail`` (known not to have happened), or ``unknown`` (a timeout or a lost
connection on a step that is not idempotent: it may or may not have happened). Checkers grade
these records afterwards against what storage holds; the journal is written to disk first so a
crashed run can still be graded.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

OpOutcome = Literal["ok", "fail", "unknown"]  # how a client operation ended


@dataclass(frozen=True, slots=True)
class Op:
    session_id: str
    op: str  # prompt, attach, get_state, callback, ...
    token: str  # unique per operation; prompts carry it in their text
    started: float
    ended: float
    outcome: OpOutcome
    client: str = "ws"  # ws, sse, post
    detail: str = ""
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.ended - self.started


class Journal:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        self._mutex = threading.Lock()

    def record(self, op: Op) -> None:
        with self._mutex:
            self._file.write(json.dumps(asdict(op), separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


def load(path: Path) -> list[Op]:
    ops = []
    for line in path.read_text().splitlines():
        if line.strip():
            ops.append(Op(**json.loads(line)))
    return ops


def now() -> float:
    return time.time()


def iter_sessions(ops: list[Op]) -> Iterator[str]:
    seen: set[str] = set()
    for op in ops:
        if op.session_id not in seen:
            seen.add(op.session_id)
            yield op.session_id
