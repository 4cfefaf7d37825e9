"""``fleet-sim chat`` after a lost connection: what it makes of the turn that was in flight."""

from __future__ import annotations

from typing import Any

import pytest

from fleet_sim.chat import Turn, after_reconnect


def _message(role: str, content: str) -> dict[str, Any]:
    return {"id": f"{role}-{content}", "parent_id": None, "role": role, "content": content}


@pytest.mark.parametrize(
    ("messages", "replay", "expected"),
    [
        ([_message("user", "hi")], [{"type": "event", "event": {"kind": "text_delta"}}], "running"),
        ([_message("user", "hi"), _message("assistant", "ok: hi")], [], "ended"),
        ([_message("user", "hi")], [], "lost"),
        ([_message("user", "earlier"), _message("assistant", "ok")], [], "unsent"),
        ([], [], "unsent"),
        # The same words asked before and answered: only the last asking counts.
        ([_message("user", "hi"), _message("assistant", "a"), _message("user", "hi")], [], "lost"),
    ],
)
def test_what_became_of_the_turn(
    messages: list[dict[str, Any]], replay: list[dict[str, Any]], expected: str
) -> None:
    catchup = {"type": "catchup", "messages": messages, "leaf_id": None, "turn": replay}
    assert after_reconnect(catchup, Turn("hi", sent=True)) == expected
