"""Job-end callbacks from the simulated sandbox: the retry policy and the delivery loop.

When a background job that asked for it ends, the sandbox POSTs ``{"type": "job_ended", ...}`` to
the job's notify URL with ``Authorization: Bearer <token>``. The callback is only a hint (the
replica re-reads the job), so the rules are about not giving up too early and not hammering:

* a 2xx ends the delivery: the receiver took it;
* 401, 403, 404, 410 and every other status that repeating cannot change (400, 411, 413, a
  redirect, ...) end it too: the receiver refused it for good;
* 503, 429, 408, 425, any other 5xx, a refused or reset connection and an attempt that outlived
  its own timeout (30 s by default) are retried, after an exponential backoff with jitter, until
  the total budget (723 s by default, counted from the first attempt) would be exceeded.

:func:`classify` and :func:`next_delay` are the whole decision and do no I/O; :class:`Notifier`
runs deliveries as supervised tasks and keeps a bounded, token-free record of every attempt that
the simulator serves to graders. The token lives only inside the running task: it is never in a
record, a log line or an exception message.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import itertools
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any, Final

import aiohttp

log = logging.getLogger(__name__)

DEFAULT_TOTAL_BUDGET_S: Final = 723.0
DEFAULT_ATTEMPT_TIMEOUT_S: Final = 30.0
# Statuses outside 5xx that a later attempt may see answered differently.
_RETRYABLE_4XX: Final = frozenset({408, 425, 429})


@dataclass(frozen=True, slots=True)
class NotifyPolicy:
    """Retry bounds for one job-end callback. Tests shorten every one of them."""

    total_budget_s: float = DEFAULT_TOTAL_BUDGET_S
    attempt_timeout_s: float = DEFAULT_ATTEMPT_TIMEOUT_S
    backoff_base_s: float = 0.5
    backoff_cap_s: float = 30.0
    # A receiver's Retry-After is honoured up to this, never beyond the budget.
    retry_after_cap_s: float = 60.0
    max_records: int = 1024

    def __post_init__(self) -> None:
        if not 0 < self.total_budget_s <= 86_400:
            raise ValueError("total_budget_s must be positive and at most a day")
        if not 0 < self.attempt_timeout_s <= self.total_budget_s:
            raise ValueError("attempt_timeout_s must be positive and within the total budget")
        if not 0 < self.backoff_base_s <= self.backoff_cap_s:
            raise ValueError("backoff must satisfy 0 < backoff_base_s <= backoff_cap_s")
        if self.retry_after_cap_s < 0:
            raise ValueError("retry_after_cap_s must not be negative")
        if self.max_records < 1:
            raise ValueError("max_records must be at least 1")


class Verdict(enum.Enum):
    DELIVERED = "delivered"
    REFUSED = "refused"
    RETRY = "retry"


class DeliveryState(enum.StrEnum):
    PENDING = "pending"
    DELIVERED = "delivered"
    REFUSED = "refused"
    EXPIRED = "expired"
    CANCELLED = "cancelled"


def classify(status: int | None) -> Verdict:
    """What an attempt's outcome means; ``None`` is an attempt that got no status at all."""
    if status is None:
        return Verdict.RETRY
    if 200 <= status < 300:
        return Verdict.DELIVERED
    if status >= 500 or status in _RETRYABLE_4XX:
        return Verdict.RETRY
    return Verdict.REFUSED


def backoff_delay(policy: NotifyPolicy, failures: int, unit: float) -> float:
    """The pause after the ``failures``-th failed attempt (1-based), ``unit`` drawn from [0, 1).

    Half the exponential step is fixed and half is jitter, so callbacks from many jobs that ended
    together spread out without any pause collapsing to zero.
    """
    step = min(policy.backoff_cap_s, policy.backoff_base_s * 2.0 ** min(failures - 1, 62))
    return step / 2 + step / 2 * unit


def next_delay(
    policy: NotifyPolicy,
    *,
    failures: int,
    elapsed_s: float,
    retry_after_s: float | None,
    unit: float,
) -> float | None:
    """Seconds to wait before the next attempt, or ``None`` when the budget does not allow one.

    ``elapsed_s`` is the time since the delivery's first attempt started. An attempt is only
    started when it can begin inside the budget; its own timeout is then cut to what is left.
    """
    delay = backoff_delay(policy, failures, unit)
    if retry_after_s is not None:
        delay = max(delay, min(retry_after_s, policy.retry_after_cap_s))
    if elapsed_s + delay >= policy.total_budget_s:
        return None
    return delay


def parse_retry_after(value: str | None, *, now: float) -> float | None:
    """Seconds from a Retry-After value (delta-seconds or an HTTP date); ``None`` if unusable."""
    if value is None:
        return None
    text = value.strip()
    if text.isdigit():
        return float(min(int(text), 86_400))
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - now)


@dataclass(frozen=True, slots=True)
class NotifyTarget:
    """Where a job's end goes. The token stays out of ``repr`` and out of every record."""

    url: str
    token: str = field(repr=False)


@dataclass(frozen=True, slots=True)
class AttemptRecord:
    number: int
    at: float
    """Wall-clock start of the attempt (epoch seconds)."""
    elapsed_s: float
    """Start of the attempt relative to the start of the first one."""
    duration_s: float
    status: int | None
    error: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "at": self.at,
            "elapsed_s": round(self.elapsed_s, 6),
            "duration_s": round(self.duration_s, 6),
            "status": self.status,
            "error": self.error,
        }


@dataclass(slots=True)
class DeliveryRecord:
    """One callback and every attempt made for it. Mutated only by its delivery task."""

    delivery_id: int
    sandbox: str
    job_id: str
    url: str
    event: Mapping[str, Any]
    created_at: float
    state: DeliveryState = DeliveryState.PENDING
    finished_at: float | None = None
    attempts: list[AttemptRecord] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.delivery_id,
            "sandbox": self.sandbox,
            "job_id": self.job_id,
            "url": self.url,
            "event": dict(self.event),
            "state": str(self.state),
            "created_at": self.created_at,
            "finished_at": self.finished_at,
            "attempts": [attempt.to_json() for attempt in self.attempts],
        }


def _describe_error(exc: BaseException) -> str:
    """A short, token-free description of why an attempt got no status."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"connect failed: {exc.os_error.strerror or type(exc.os_error).__name__}"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "disconnected before answering"
    if isinstance(exc, aiohttp.ClientError):
        return f"client error: {type(exc).__name__}"
    return f"error: {type(exc).__name__}"


class Notifier:
    """Runs job-end callbacks as supervised tasks and remembers their attempts.

    ``start()`` opens the shared HTTP session and ``close()`` cancels what is still retrying, so
    no callback task outlives the sandbox service that spawned it.
    """

    def __init__(
        self,
        policy: NotifyPolicy | None = None,
        *,
        unit: Callable[[], float] = random.random,
    ) -> None:
        self.policy = policy or NotifyPolicy()
        self._unit = unit
        self._records: collections.deque[DeliveryRecord] = collections.deque(
            maxlen=self.policy.max_records
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self._ids = itertools.count(1)
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    async def start(self) -> None:
        if self._session is None:
            # trust_env=False: a proxy taken from the environment would see the token.
            self._session = aiohttp.ClientSession(
                cookie_jar=aiohttp.DummyCookieJar(),
                trust_env=False,
                timeout=aiohttp.ClientTimeout(total=None),
            )

    async def close(self) -> None:
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def pending(self) -> int:
        return len(self._tasks)

    def records(self) -> list[DeliveryRecord]:
        return list(self._records)

    def notify(
        self, *, sandbox: str, job_id: str, target: NotifyTarget, event: Mapping[str, Any]
    ) -> DeliveryRecord:
        """Start delivering ``event`` to ``target`` in the background; returns its live record."""
        if self._closed or self._session is None:
            raise RuntimeError("the notifier is not running")
        record = DeliveryRecord(
            delivery_id=next(self._ids),
            sandbox=sandbox,
            job_id=job_id,
            url=target.url,
            event=dict(event),
            created_at=time.time(),
        )
        self._records.append(record)
        task = asyncio.get_running_loop().create_task(
            self._deliver(self._session, record, target.token),
            name=f"notify {sandbox}/{job_id}",
        )
        self._tasks.add(task)
        task.add_done_callback(self._reap)
        return record

    def _reap(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            # Only the class: an exception raised while the token was in scope is not trusted.
            log.error("job-end callback task %s failed: %s", task.get_name(), type(exc).__name__)

    async def _deliver(
        self, session: aiohttp.ClientSession, record: DeliveryRecord, token: str
    ) -> None:
        policy = self.policy
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        begun = time.monotonic()
        try:
            for number in itertools.count(1):
                started = time.monotonic()
                elapsed = started - begun
                remaining = policy.total_budget_s - elapsed
                status, retry_after, error = await self._attempt(
                    session, record, headers, min(policy.attempt_timeout_s, remaining)
                )
                ended = time.monotonic()
                record.attempts.append(
                    AttemptRecord(
                        number=number,
                        at=time.time() - (ended - started),
                        elapsed_s=elapsed,
                        duration_s=ended - started,
                        status=status,
                        error=error,
                    )
                )
                verdict = classify(status)
                log.info(
                    "job-end callback %s/%s attempt %d: %s",
                    record.sandbox,
                    record.job_id,
                    number,
                    status if status is not None else error,
                )
                if verdict is Verdict.DELIVERED:
                    record.state = DeliveryState.DELIVERED
                    return
                if verdict is Verdict.REFUSED:
                    record.state = DeliveryState.REFUSED
                    return
                delay = next_delay(
                    policy,
                    failures=number,
                    elapsed_s=ended - begun,
                    retry_after_s=retry_after,
                    unit=self._unit(),
                )
                if delay is None:
                    record.state = DeliveryState.EXPIRED
                    log.warning(
                        "job-end callback %s/%s given up after %d attempts",
                        record.sandbox,
                        record.job_id,
                        number,
                    )
                    return
                await asyncio.sleep(delay)
        except asyncio.CancelledError:
            record.state = DeliveryState.CANCELLED
            raise
        finally:
            record.finished_at = time.time()

    async def _attempt(
        self,
        session: aiohttp.ClientSession,
        record: DeliveryRecord,
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> tuple[int | None, float | None, str | None]:
        try:
            async with (
                asyncio.timeout(timeout_s),
                session.post(
                    record.url,
                    json=dict(record.event),
                    headers=headers,
                    allow_redirects=False,
                ) as response,
            ):
                # The body is not needed, but reading it lets the connection be reused.
                with contextlib.suppress(aiohttp.ClientError):
                    await response.content.read(64 * 1024)
                retry_after = parse_retry_after(
                    response.headers.get("Retry-After"), now=time.time()
                )
                return response.status, retry_after, None
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            return None, None, _describe_error(exc)
