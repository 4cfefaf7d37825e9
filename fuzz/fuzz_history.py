"""Fuzz replay of a whole session directory (``replica.history.read_history``).

Input: a history script (``fuzz.formats.build_session_dir``): up to four files or directories,
each with a name and segment-script content sealed with the session's real key. The harness
writes them into a scratch session directory and replays it. The documented errors are
:class:`~replica.errors.CorruptHistory` and :class:`~replica.errors.StorageUnavailable`; a
history that replays must add up.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fuzz.common import instrument

    instrument("replica.history", "replica.segments", "replica.transcript")

import atexit
import os
import shutil
import tempfile

from fuzz.common import Harness, main
from fuzz.formats import build_session_dir
from fuzz.fuzz_segments import TOKENS
from fuzz.known import Mismatch
from replica.errors import CorruptHistory, StorageUnavailable
from replica.history import History, read_history
from replica.sealing import RecordSealer

SEALER = RecordSealer.for_session(bytes(range(32)), "acme", "a07-s3.x")
_SCRATCH = Path(tempfile.mkdtemp(prefix="fuzz-history-"))
atexit.register(shutil.rmtree, _SCRATCH, True)
SESSION = _SCRATCH / "acme" / "sessions" / "a07-s3.x"


def _reset() -> None:
    if SESSION.exists():
        shutil.rmtree(SESSION)
    SESSION.mkdir(parents=True)


def _adds_up(history: History) -> None:
    epochs = [s.epoch for s in history.segments]
    if epochs != sorted(epochs) or len(set(epochs)) != len(epochs):
        raise Mismatch("history", f"segments out of order: {epochs}")
    if history.committed_messages != sum(s.messages for s in history.segments):
        raise Mismatch("history", "message counts do not add up")
    if history.batches != sum(s.batches for s in history.segments):
        raise Mismatch("history", "batch counts do not add up")
    if len(history.transcript) > history.committed_messages:
        raise Mismatch("history", "more messages than were committed")


def check(data: bytes) -> None:
    _reset()
    for entry in build_session_dir(data, SEALER):
        path = SESSION / entry.name
        if path.exists():
            continue  # the first entry of a name wins
        if entry.directory:
            path.mkdir()
        else:
            path.write_bytes(entry.content)
    try:
        history = read_history(SESSION, SEALER)
    except (CorruptHistory, StorageUnavailable):
        return
    _adds_up(history)
    if not os.path.isdir(SESSION):
        raise Mismatch("history", "replay removed the session directory")


HARNESS = Harness(
    target="history",
    test=check,
    tokens=(
        *TOKENS,
        b"file epoch-0000000001.seg\n",
        b"file epoch-0000000002.seg\n",
        b"file epoch-0000000003.seg\n",
        b"dir epoch-0000000002.seg\n",
        b"file epoch-0000000000.seg\n",
        b'{"k":"h","prev":1,"seal":',
        b'{"k":"r","jobs":',
    ),
    max_len=16384,
)

if __name__ == "__main__":
    main(HARNESS)
