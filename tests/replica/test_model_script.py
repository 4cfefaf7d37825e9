from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replica import model_script
from replica.model_script import ArgPiece, CallStart, TextPiece, plan_reply


@dataclass(frozen=True)
class Msg:
    role: str
    content: str
    tool_calls: tuple[object, ...] = ()


@given(st.text(max_size=300))
def test_pieces_reassemble_exactly_and_stay_small(text: str) -> None:
    parts = model_script.pieces(text)
    assert "".join(parts) == text
    assert all(p and len(p.strip()) <= 16 for p in parts)


def test_unit_offsets_are_absolute() -> None:
    assert model_script.unit_offset(0, 0.3, 0.012) == 0.3
    assert model_script.unit_offset(100, 0.3, 0.012) == pytest.approx(1.5)


def test_tool_call_reply_is_split_into_start_then_argument_pieces() -> None:
    reply = plan_reply([Msg("user", "run: echo one two")], {"bash"}, max_tokens=100)
    [call] = reply.calls
    assert isinstance(reply.units[0], CallStart)
    assert reply.units[0] == CallStart(0, call.id, "bash")
    args = [u for u in reply.units[1:] if isinstance(u, ArgPiece)]
    assert len(args) == len(reply.units) - 1 >= 2
    assert "".join(a.text for a in args) == call.arguments
    assert reply.completion_tokens == len(reply.units)


def test_call_ids_differ_between_steps_of_one_conversation() -> None:
    first = plan_reply([Msg("user", "run: ls\nrun: ls")], {"bash"}, max_tokens=100)
    history = [
        Msg("user", "run: ls\nrun: ls"),
        Msg("assistant", "", (object(),)),
        Msg("tool", "x"),
    ]
    second = plan_reply(history, {"bash"}, max_tokens=100)
    assert first.calls[0].arguments == second.calls[0].arguments
    assert first.calls[0].id != second.calls[0].id


@pytest.mark.parametrize(
    "line",
    ["run:", "read: a b c", "read: j -1", "words: 0", "words: many", "error: 200", "hangup: x"],
)
def test_malformed_directives_are_prompt_text(line: str) -> None:
    reply = plan_reply([Msg("user", line)], {"bash", "job_output"}, max_tokens=100)
    assert reply.calls == ()
    assert (reply.error_status, reply.hangup_after) == (None, None)
    assert reply.text == "ok: " + " ".join(line.split())


def test_only_the_last_user_message_directs() -> None:
    history = [Msg("user", "run: ls"), Msg("assistant", "done"), Msg("user", "thanks")]
    reply = plan_reply(history, {"bash"}, max_tokens=100)
    assert reply.calls == ()
    assert reply.text == "ok: thanks"


def test_default_words_pads_plain_and_result_replies() -> None:
    plain = plan_reply([Msg("user", "hi")], set(), max_tokens=100, default_words=6)
    assert len(plain.text.split()) == 6
    assert plain.text.startswith("ok: hi ")
    after_tool = plan_reply(
        [Msg("user", "run: x"), Msg("assistant", "", (object(),)), Msg("tool", "")],
        {"bash"},
        max_tokens=100,
        default_words=3,
    )
    assert after_tool.text == "result: (empty) the"
    assert all(isinstance(u, TextPiece) for u in after_tool.units)


def test_max_tokens_must_be_positive() -> None:
    with pytest.raises(ValueError):
        plan_reply([Msg("user", "x")], set(), max_tokens=0)
