"""A store owner in a process of its own, for the tests that kill, pause or race owners."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

DEK = bytes(range(32))
REPO = Path(__file__).resolve().parents[2]


class Owner:
    """A session store owned by a process of its own (``tests.replica.store_child``), driven over
    its stdin and stdout one JSON operation at a time."""

    def __init__(self, root: Path, sid: str, locking: str = "lock") -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.replica.store_child",
                str(root),
                "acme",
                sid,
                DEK.hex(),
                locking,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )

    def send(self, op: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "owner process died"
        value: dict[str, Any] = json.loads(line)
        return value

    def __call__(self, op: str, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.reply()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
