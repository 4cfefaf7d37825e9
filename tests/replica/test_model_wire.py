from __future__ import annotations

import json
from typing import Any

import pytest

from replica.model_types import (
    ChatMessage,
    Finish,
    ModelEvent,
    ModelProtocolError,
    ModelStreamError,
    TextDelta,
    ToolCall,
    ToolCallEvent,
    ToolSpec,
)
from replica.model_wire import (
    MAX_EVENT_DATA,
    SSEDecoder,
    StreamAssembler,
    error_detail,
    merge_text,
    request_body,
)


def delta(d: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": d, "finish_reason": finish}]}


def frag(index: int, **fields: Any) -> dict[str, Any]:
    return delta({"tool_calls": [{"index": index, **fields}]})


def run(chunks: list[dict[str, Any] | str]) -> list[ModelEvent]:
    assembler = StreamAssembler()
    events: list[ModelEvent] = []
    for chunk in chunks:
        data = chunk if isinstance(chunk, str) else json.dumps(chunk)
        events += assembler.feed_data(data)
    return events + assembler.end_of_stream()


def test_interleaved_fragments_are_reassembled_by_index() -> None:
    events = run(
        [
            delta({"role": "assistant", "content": None}),
            frag(0, id="a", type="function", function={"name": "bash", "arguments": ""}),
            frag(1, id="b", type="function", function={"name": "job_output", "arguments": '{"jo'}),
            frag(0, function={"arguments": '{"command"'}),
            frag(1, function={"arguments": 'b_id": "j1"}'}),
            frag(0, function={"arguments": ': "ls"}'}),
            delta({}, "tool_calls"),
            {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 7}},
            "[DONE]",
        ]
    )
    assert events == [
        ToolCallEvent(ToolCall("a", "bash", '{"command": "ls"}')),
        ToolCallEvent(ToolCall("b", "job_output", '{"job_id": "j1"}')),
        Finish("tool_calls", 11, 7),
    ]


def test_repeated_names_are_not_doubled_and_split_names_are_joined() -> None:
    events = run(
        [
            frag(0, id="x", function={"name": "bash", "arguments": "{}"}),
            frag(0, id="x", function={"name": "bash"}),
            frag(1, id="y", function={"name": "job_", "arguments": ""}),
            frag(1, function={"name": "output"}),
            delta({}, "tool_calls"),
        ]
    )
    assert [e.call.name for e in events if isinstance(e, ToolCallEvent)] == ["bash", "job_output"]
    assert events[1] == ToolCallEvent(ToolCall("y", "job_output", "{}"))


def test_stop_with_tool_calls_counts_as_tool_calls() -> None:
    events = run([frag(0, id="a", function={"name": "bash", "arguments": "{}"}), delta({}, "stop")])
    assert isinstance(events[-1], Finish) and events[-1].reason == "tool_calls"


def test_length_finish_drops_incomplete_calls() -> None:
    events = run(
        [frag(0, id="a", function={"name": "bash", "arguments": '{"comm'}), delta({}, "length")]
    )
    assert events == [Finish("length", 0, 0)]


def test_text_and_unknown_finish_reason() -> None:
    events = run([delta({"content": "he"}), delta({"content": "y"}), delta({}, "content_filter")])
    assert events == [TextDelta("he"), TextDelta("y"), Finish("error", 0, 0)]


def test_done_without_finish_reason_is_a_normal_stop() -> None:
    assert run([delta({"content": "x"}), "[DONE]"]) == [TextDelta("x"), Finish("stop", 0, 0)]


def test_end_before_finish_is_a_stream_error() -> None:
    with pytest.raises(ModelStreamError):
        run([delta({"content": "partial"})])


@pytest.mark.parametrize("data", ["{nope", "[1, 2]"])
def test_non_object_events_are_protocol_errors(data: str) -> None:
    with pytest.raises(ModelProtocolError):
        StreamAssembler().feed_data(data)


def test_error_object_in_stream_is_a_stream_error() -> None:
    with pytest.raises(ModelStreamError, match="overloaded"):
        StreamAssembler().feed({"error": {"message": "model overloaded"}})


def test_sse_decoder_joins_multiline_data_and_skips_comments() -> None:
    decoder = SSEDecoder()
    lines = [": keepalive", "event: message", 'data: {"a":', "data:1}", "", "data: [DONE]"]
    out = [d for line in lines for d in decoder.feed(line)]
    assert out == ['{"a":\n1}']
    assert decoder.close() == ["[DONE]"]


BODY = (
    b': keepalive\r\nevent: message\r\ndata: {"a":\r\ndata:1}\r\n\r\n'
    b"data: \xc3\xa9t\xc3\xa9\n\ndata: cr\r\rdata: [DONE]\n\n"
)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 64, len(BODY)])
def test_sse_decoder_reads_bytes_in_any_pieces(size: int) -> None:
    """Whatever pieces the network cuts the body into, even between CR and LF or inside a
    UTF-8 character, the events are the same as read line by line."""
    decoder = SSEDecoder()
    out = [d for at in range(0, len(BODY), size) for d in decoder.feed_bytes(BODY[at : at + size])]
    assert out + decoder.close() == ['{"a":\n1}', "\u00e9t\u00e9", "cr", "[DONE]"]


def test_sse_decoder_refuses_an_endless_line() -> None:
    decoder = SSEDecoder()
    decoder.feed_bytes(b"data: " + b"x" * (MAX_EVENT_DATA // 2))
    with pytest.raises(ModelProtocolError, match="oversized"):
        decoder.feed_bytes(b"x" * (MAX_EVENT_DATA // 2 + 8))


def test_sse_decoder_close_reads_a_last_unterminated_line() -> None:
    decoder = SSEDecoder()
    assert decoder.feed_bytes(b"data: one\n\ndata: [DONE]") == ["one"]
    assert decoder.close() == ["[DONE]"]


def test_merge_text_joins_neighbouring_deltas_only() -> None:
    call = ToolCallEvent(ToolCall("c1", "bash", "{}"))
    events: list[ModelEvent] = [
        TextDelta("a"),
        TextDelta("b"),
        call,
        TextDelta("c"),
        TextDelta("d"),
    ]
    assert merge_text(events) == [TextDelta("ab"), call, TextDelta("cd")]
    assert merge_text([TextDelta("x")]) == [TextDelta("x")]
    assert merge_text([]) == []


def test_request_body_uses_openai_function_format() -> None:
    call = ToolCall("c1", "bash", '{"command": "ls"}')
    body = request_body(
        "m",
        [
            ChatMessage("user", "hi"),
            ChatMessage("assistant", "", (call,)),
            ChatMessage("tool", "out", tool_call_id="c1"),
        ],
        [ToolSpec("bash", "run", {"type": "object"})],
        max_tokens=9,
    )
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 9
    assert body["tools"] == [
        {
            "type": "function",
            "function": {"name": "bash", "description": "run", "parameters": {"type": "object"}},
        }
    ]
    assert body["messages"][1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "bash", "arguments": '{"command": "ls"}'},
            }
        ],
    }
    assert body["messages"][2] == {"role": "tool", "content": "out", "tool_call_id": "c1"}
    assert "tools" not in request_body("m", [ChatMessage("user", "hi")], [], max_tokens=1)


def test_error_detail_prefers_openai_message() -> None:
    assert error_detail(b'{"error": {"message": "Rate  limit\\nreached"}}') == "Rate limit reached"
    assert error_detail(b"<html>bad gateway</html>") == "<html>bad gateway</html>"
