"""Replay: read every segment of a session directory, bound each at its seal, check the chain, and
rebuild the transcript. Used by a new owner before it creates its own segment, by read-only
views, and by ``fleet-replica store verify``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from replica.errors import CorruptHistory, StorageUnavailable
from replica.sealing import RecordSealer
from replica.segments import (
    KIND_BATCH,
    KIND_RESET,
    parse_segment,
    parse_segment_name,
    segment_name,
)
from replica.transcript import Message, Transcript


@dataclass(frozen=True, slots=True)
class SegmentSummary:
    epoch: int
    prev_epoch: int | None
    seals_prev_at: int | None
    bound: int | None  # the seal its successor recorded; None for the open (last) segment
    valid_end: int
    size: int
    batches: int
    messages: int
    ignored_bytes: int  # a torn tail, or a stale owner's bytes past the seal
    header_torn: bool
    owner: str | None


@dataclass(slots=True)
class History:
    segments: list[SegmentSummary] = field(default_factory=list)
    transcript: Transcript = field(default_factory=Transcript)
    batches: int = 0
    committed_messages: int = 0  # across every conversation, archived ones included

    @property
    def last_epoch(self) -> int:
        """The highest epoch any file claims, torn headers included: the next owner's is +1."""
        return max((s.epoch for s in self.segments), default=0)

    @property
    def open_segment(self) -> SegmentSummary | None:
        """The newest segment with a header: the one a new owner seals."""
        for summary in reversed(self.segments):
            if not summary.header_torn:
                return summary
        return None


def list_epochs(session_dir: Path) -> list[int]:
    try:
        names = os.listdir(session_dir)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise StorageUnavailable(f"cannot list session directory: {exc.strerror}") from None
    return sorted(e for e in map(parse_segment_name, names) if e is not None)


def _read(path: Path) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as exc:
        raise StorageUnavailable(f"cannot read {path.name}: {exc.strerror}") from None


def read_history(session_dir: Path, sealer: RecordSealer) -> History:
    epochs = list_epochs(session_dir)
    blobs = {epoch: _read(session_dir / segment_name(epoch)) for epoch in epochs}
    # Headers first: a segment's bound is written in its successor's header, and nothing past
    # a bound may even be parsed (a stale owner's leftovers there are not ours to judge).
    headers = {
        epoch: parse_segment(blobs[epoch], epoch, sealer, header_only=True).header
        for epoch in epochs
    }
    history = History()
    bounds: dict[int, int | None] = {}
    previous: int | None = None
    for epoch in epochs:
        header = headers[epoch]
        if header is None:
            continue
        if header.prev_epoch != previous:
            raise CorruptHistory(
                f"segment {epoch} says it follows epoch {header.prev_epoch}, "
                f"but the segment before it is {previous}: a segment is missing or foreign"
            )
        if previous is not None:
            bounds[previous] = header.seal
        previous = epoch
    for epoch in epochs:
        bound = bounds.get(epoch)
        parsed = parse_segment(blobs[epoch], epoch, sealer, bound=bound)
        messages = batches = 0
        for record in parsed.records:
            kind = record.payload["k"]
            if kind == KIND_BATCH:
                batch = _batch_messages(epoch, record.index, record.payload)
                history.transcript.apply_batch(batch)
                batches += 1
                messages += len(batch)
            elif kind == KIND_RESET:
                jobs = record.payload.get("jobs", [])
                if not isinstance(jobs, list):
                    raise CorruptHistory(f"segment {epoch} record {record.index} is a bad reset")
                history.transcript.reset(j for j in jobs if isinstance(j, str))
            else:
                raise CorruptHistory(f"segment {epoch} record {record.index} has unknown kind")
        history.batches += batches
        history.committed_messages += messages
        header = parsed.header
        history.segments.append(
            SegmentSummary(
                epoch=epoch,
                prev_epoch=header.prev_epoch if header else None,
                seals_prev_at=header.seal if header else None,
                bound=bound,
                valid_end=parsed.valid_end,
                size=parsed.size,
                batches=batches,
                messages=messages,
                ignored_bytes=parsed.torn_bytes if bound is None else parsed.size - bound,
                header_torn=header is None,
                owner=header.owner if header else None,
            )
        )
    return history


def _batch_messages(epoch: int, index: int, payload: dict[str, object]) -> list[Message]:
    raw = payload.get("m")
    if not isinstance(raw, list):
        raise CorruptHistory(f"segment {epoch} record {index} is a batch without messages")
    try:
        return [Message.from_wire(item) for item in raw]
    except (ValueError, TypeError, AttributeError) as exc:
        raise CorruptHistory(f"segment {epoch} record {index} holds a bad message: {exc}") from None
