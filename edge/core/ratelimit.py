"""Per-key rate limits for job-end callbacks, driven by a caller's clock (pure, no I/O).

Two shapes, for two different promises:

* :class:`WindowLimiter` keeps, per key, the times of the last ``limit`` admitted events and
  admits another only if the oldest of them is at least ``window_s`` old. That is an exact
  "at most N in any window" bound, which is what rule E6 says for one session id ("at most 20
  callbacks a second"). A token bucket with a burst of 20 refilled at 20/s would admit up to 39
  inside one second (a full bucket, then a second's refill), so it cannot make that promise.
* :class:`TokenBucketLimiter` is the usual bucket (sustained ``rate`` per second, bursts up to
  ``burst``), used per source address, where the goal is smoothing one noisy host rather than
  an exact count.

Memory is bounded: keys whose state has fully recovered are swept once the table is large, and
if it is still full of live keys a new key is refused (fail closed) rather than growing without
bound or evicting a key that is being limited.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

DEFAULT_MAX_KEYS = 100_000


@dataclass(frozen=True, slots=True)
class WindowRule:
    """At most ``limit`` events in any ``window_s`` seconds."""

    limit: int
    window_s: float

    def __post_init__(self) -> None:
        if self.limit < 1 or not math.isfinite(self.window_s) or self.window_s <= 0:
            raise ValueError("a window rule needs limit >= 1 and a positive window")

    @classmethod
    def per_second(cls, rate: float) -> WindowRule:
        """``rate`` events a second: ``floor(rate)`` per second, or one per ``1/rate`` seconds."""
        if not math.isfinite(rate) or rate <= 0:
            raise ValueError("rate must be a positive number")
        if rate >= 1:
            return cls(int(rate), 1.0)
        return cls(1, 1.0 / rate)


class WindowLimiter:
    def __init__(self, rule: WindowRule, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        self._rule = rule
        self._max_keys = max_keys
        self._events: dict[str, deque[float]] = {}

    @property
    def rule(self) -> WindowRule:
        return self._rule

    def reconfigure(self, rule: WindowRule) -> None:
        """Apply a new rule to existing keys too (a reload must not reset anyone's history)."""
        self._rule = rule
        for key, times in self._events.items():
            self._events[key] = deque(times, maxlen=rule.limit)

    def __len__(self) -> int:
        return len(self._events)

    def allow(self, key: str, now: float) -> bool:
        rule = self._rule
        times = self._events.get(key)
        if times is None:
            if len(self._events) >= self._max_keys and not self._sweep(now):
                return False
            times = self._events[key] = deque(maxlen=rule.limit)
        if len(times) >= rule.limit and now - times[0] < rule.window_s:
            return False
        times.append(now)
        return True

    def _sweep(self, now: float) -> bool:
        window = self._rule.window_s
        stale = [k for k, t in self._events.items() if not t or now - t[-1] >= window]
        for key in stale:
            del self._events[key]
        return len(self._events) < self._max_keys


class TokenBucketLimiter:
    def __init__(self, rate: float, burst: float, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        self._check(rate, burst)
        self._rate = rate
        self._burst = burst
        self._max_keys = max_keys
        # key -> (tokens, time of last update)
        self._buckets: dict[str, tuple[float, float]] = {}

    @staticmethod
    def _check(rate: float, burst: float) -> None:
        if not (math.isfinite(rate) and rate > 0 and math.isfinite(burst) and burst >= 1):
            raise ValueError("a token bucket needs rate > 0 and burst >= 1")

    def reconfigure(self, rate: float, burst: float) -> None:
        self._check(rate, burst)
        self._rate = rate
        self._burst = burst

    def __len__(self) -> int:
        return len(self._buckets)

    def allow(self, key: str, now: float) -> bool:
        state = self._buckets.get(key)
        if state is None:
            if len(self._buckets) >= self._max_keys and not self._sweep(now):
                return False
            tokens = self._burst
        else:
            tokens, then = state
            tokens = min(self._burst, tokens + max(now - then, 0.0) * self._rate)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            return False
        self._buckets[key] = (tokens - 1.0, now)
        return True

    def _sweep(self, now: float) -> bool:
        # A bucket that would be full again carries no state worth keeping.
        full_after = self._burst / self._rate
        stale = [k for k, (_, then) in self._buckets.items() if now - then >= full_after]
        for key in stale:
            del self._buckets[key]
        return len(self._buckets) < self._max_keys
