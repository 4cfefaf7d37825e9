"""A session owner in its own process, driven one JSON command per stdin line.

Real-process tests use it to kill an owner mid-append, pause it, cut its lock (as a lapsed storage
lease does) and race it against another owner. Each command is answered with one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from replica.locking import NoLocking, OfdLocker
from replica.segments import encode_record
from replica.store import Committed, OwnedSession, SessionStore, StoreConfig
from replica.transcript import Message
from wire.names import parse_session_id


def _turn(tag: str) -> list[Message]:
    now = time.time()
    return [
        Message(f"{tag}-u", None, "user", f"prompt {tag}", now),
        Message(f"{tag}-a", None, "assistant", f"reply {tag}", now),
    ]


def main() -> int:
    root, tenant, sid, dek_hex, locking = sys.argv[1:6]
    store = SessionStore(
        Path(root),
        StoreConfig(owner=f"pid{os.getpid()}", lock_wait_s=0.0),
        OfdLocker() if locking == "lock" else NoLocking(),
    )
    session: OwnedSession | None = None
    dek = bytes.fromhex(dek_hex)
    for line in sys.stdin:
        cmd: dict[str, Any] = json.loads(line)
        op = cmd["op"]
        reply: dict[str, Any] = {"op": op}
        try:
            if op == "open":
                session = store.open(tenant, parse_session_id(sid), dek)
                reply.update(epoch=session.epoch, messages=len(session.transcript))
            elif op == "commit":
                assert session is not None
                outcome = session.commit(_turn(cmd["tag"]))
                reply.update(ok=isinstance(outcome, Committed), outcome=repr(outcome))
            elif op == "commit_partial":
                # Write the first half of a sealed batch record, as a crash mid-append leaves it.
                assert session is not None
                record = encode_record(
                    session._sealer,
                    session.epoch,
                    session._next_index,
                    {"k": "b", "m": [m.to_wire() for m in _turn(cmd["tag"])]},
                )
                os.pwrite(session._fd, record[: len(record) // 2], session._size)
                os.fsync(session._fd)
            elif op == "drop_lock":
                assert session is not None
                session._lock.release()
            elif op == "release":
                assert session is not None
                session.release()
        except Exception as exc:
            reply.update(error=type(exc).__name__, message=str(exc))
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
