from __future__ import annotations

import pytest

from edge.core.memo import Memo


class Reader:
    """A pure function of the bytes that counts how often it really ran."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, key: bytes) -> int | None:
        self.calls += 1
        return None if key.startswith(b"no") else len(key)


def test_an_answer_is_read_once_and_then_remembered() -> None:
    read = Reader()
    memo = Memo(read, size=4, key_max=16)
    assert [memo.get(b"abc") for _ in range(3)] == [3, 3, 3]
    assert read.calls == 1 and (memo.hits, memo.misses) == (2, 1)


def test_a_none_answer_is_remembered_too() -> None:
    read = Reader()
    memo = Memo(read, size=4, key_max=16)
    assert memo.get(b"nope") is None and memo.get(b"nope") is None
    assert read.calls == 1


def test_a_key_over_the_length_limit_is_read_every_time() -> None:
    read = Reader()
    memo = Memo(read, size=4, key_max=4)
    assert memo.get(b"12345") == 5 and memo.get(b"12345") == 5
    assert read.calls == 2 and len(memo) == 0
    assert memo.get(b"1234") == 4 and memo.get(b"1234") == 4
    assert read.calls == 3 and len(memo) == 1


def test_a_full_memo_forgets_everything_and_starts_again() -> None:
    read = Reader()
    memo = Memo(read, size=2, key_max=16)
    memo.get(b"a")
    memo.get(b"bb")
    assert len(memo) == 2
    assert memo.get(b"ccc") == 3  # full: the two are forgotten, the new one kept
    assert len(memo) == 1
    assert memo.get(b"a") == 1 and read.calls == 4  # read again
    assert memo.get(b"ccc") == 3 and read.calls == 4


@pytest.mark.parametrize(("size", "key_max"), [(0, 8), (8, 0)])
def test_a_memo_without_room_is_refused(size: int, key_max: int) -> None:
    with pytest.raises(ValueError, match="at least one"):
        Memo(Reader(), size=size, key_max=key_max)
