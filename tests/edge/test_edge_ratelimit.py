from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.core.ratelimit import TokenBucketLimiter, WindowLimiter, WindowRule


def test_window_admits_exactly_the_limit_per_window() -> None:
    limiter = WindowLimiter(WindowRule(20, 1.0))
    assert [limiter.allow("s", 0.001 * i) for i in range(21)] == [True] * 20 + [False]
    assert limiter.allow("other", 0.05)
    assert not limiter.allow("s", 0.999)
    assert limiter.allow("s", 1.0)


@given(st.lists(st.floats(min_value=0, max_value=5, allow_nan=False), max_size=120))
def test_no_window_ever_holds_more_than_the_limit(offsets: list[float]) -> None:
    limiter = WindowLimiter(WindowRule(5, 1.0))
    admitted = [t for t in sorted(offsets) if limiter.allow("k", t)]
    for start in admitted:
        assert len([t for t in admitted if start <= t < start + 1.0]) <= 5


def test_per_second_rules() -> None:
    assert WindowRule.per_second(20.0) == WindowRule(20, 1.0)
    assert WindowRule.per_second(0.5) == WindowRule(1, 2.0)
    with pytest.raises(ValueError, match="rate"):
        WindowRule.per_second(0)


def test_reconfigure_keeps_history() -> None:
    limiter = WindowLimiter(WindowRule(3, 1.0))
    for t in (0.0, 0.1, 0.2):
        assert limiter.allow("s", t)
    limiter.reconfigure(WindowRule(2, 1.0))
    assert not limiter.allow("s", 0.3)
    assert limiter.allow("s", 1.15)


def test_window_table_is_bounded_and_fails_closed() -> None:
    limiter = WindowLimiter(WindowRule(1, 1.0), max_keys=2)
    assert limiter.allow("a", 0.0) and limiter.allow("b", 0.0)
    assert not limiter.allow("c", 0.5)  # both others still live
    assert limiter.allow("c", 1.5)  # they have recovered and are swept
    assert len(limiter) == 1


def test_token_bucket_rate_and_burst() -> None:
    bucket = TokenBucketLimiter(rate=2.0, burst=3.0)
    assert [bucket.allow("h", 0.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.allow("h", 0.5) and not bucket.allow("h", 0.5)
    assert bucket.allow("other", 0.5)


def test_token_bucket_table_is_bounded() -> None:
    bucket = TokenBucketLimiter(rate=1.0, burst=1.0, max_keys=1)
    assert bucket.allow("a", 0.0)
    assert not bucket.allow("b", 0.5)
    assert bucket.allow("b", 2.0)
