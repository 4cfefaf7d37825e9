from __future__ import annotations

import pytest

from replica.errors import CorruptHistory
from replica.sealing import RecordSealer
from replica.segments import (
    PREFIX,
    SegmentHeader,
    decode_payload,
    encode_payload,
    encode_record,
    encode_segment_start,
    parse_segment,
    parse_segment_name,
    segment_name,
)

SEALER = RecordSealer.for_session(bytes(32), "acme", "a07-s3.x")


def _segment(epoch: int, batches: int) -> tuple[bytes, list[int]]:
    data = encode_segment_start(SEALER, SegmentHeader(epoch, None, None, "r1", 1.0))
    ends = [len(data)]
    for i in range(batches):
        data += encode_record(SEALER, epoch, i + 1, {"k": "b", "m": [], "n": i})
        ends.append(len(data))
    return data, ends


def test_names() -> None:
    assert segment_name(12) == "epoch-0000000012.seg"
    assert parse_segment_name("epoch-0000000012.seg") == 12
    for bad in ("epoch-12.seg", "epoch-0000000000.seg", "epoch-0000000012.seg.tmp", "lock"):
        assert parse_segment_name(bad) is None


def test_payload_compression_round_trip() -> None:
    big = {"k": "b", "text": "the same words again " * 40}
    small = {"k": "b"}
    assert encode_payload(big)[0] == 1 and len(encode_payload(big)) < 200
    assert encode_payload(small)[0] == 0
    assert decode_payload(encode_payload(big)) == big
    with pytest.raises(ValueError, match="flags"):
        decode_payload(b"\x80{}")


def test_parse_full_segment() -> None:
    data, ends = _segment(1, 3)
    parsed = parse_segment(data, 1, SEALER)
    assert parsed.header is not None and parsed.header.owner == "r1"
    assert [r.payload["n"] for r in parsed.records] == [0, 1, 2]
    assert (parsed.valid_end, parsed.torn_bytes) == (ends[-1], 0)


def test_every_torn_tail_keeps_the_complete_records() -> None:
    data, ends = _segment(1, 3)
    for cut in range(ends[0], len(data)):
        parsed = parse_segment(data[:cut], 1, SEALER)
        complete = max(e for e in ends if e <= cut)
        assert parsed.valid_end == complete
        assert len(parsed.records) == ends.index(complete)
        assert parsed.torn_bytes == cut - complete


def test_torn_header_is_an_empty_claim() -> None:
    data, ends = _segment(1, 0)
    for cut in range(0, ends[0]):
        parsed = parse_segment(data[:cut], 1, SEALER)
        assert parsed.header is None and parsed.records == () and parsed.valid_end == 0


def test_zero_filled_tail_is_torn_not_corrupt() -> None:
    data, ends = _segment(1, 2)
    parsed = parse_segment(data + bytes(100), 1, SEALER)
    assert (parsed.valid_end, parsed.torn_bytes) == (ends[-1], 100)


def test_flipped_bit_in_any_complete_record_is_corruption() -> None:
    data, _ = _segment(1, 2)
    for position in range(PREFIX.size, len(data)):
        damaged = bytearray(data)
        damaged[position] ^= 0x01
        try:
            parsed = parse_segment(bytes(damaged), 1, SEALER)
        except CorruptHistory:
            continue
        # A flipped length bit can only make the last record look longer than the file: torn.
        assert parsed.torn_bytes > 0 and parsed.valid_end < len(data)


def test_bound_must_be_present_and_aligned() -> None:
    data, ends = _segment(1, 3)
    assert len(parse_segment(data, 1, SEALER, bound=ends[2]).records) == 2
    with pytest.raises(CorruptHistory, match="truncated"):
        parse_segment(data[: ends[2] - 1], 1, SEALER, bound=ends[2])
    with pytest.raises(CorruptHistory, match="inside a record"):
        parse_segment(data, 1, SEALER, bound=ends[2] + 3)


def test_wrong_epoch_and_foreign_prefix() -> None:
    data, _ = _segment(1, 1)
    with pytest.raises(CorruptHistory):
        parse_segment(data, 2, SEALER)
    with pytest.raises(CorruptHistory):
        parse_segment(b"XXXX" + data[4:], 1, SEALER)


def test_reordered_records_are_caught() -> None:
    data, ends = _segment(1, 2)
    swapped = data[: ends[0]] + data[ends[1] : ends[2]] + data[ends[0] : ends[1]]
    with pytest.raises(CorruptHistory):
        parse_segment(swapped, 1, SEALER)
