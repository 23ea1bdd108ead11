"""Trying again: how long to wait between attempts, and which failures are worth another one.

Everything that retries uses these: the IMDS one-shot commands (`events`, `approve`), the approver, and
the outbox's delivery workers. Loops that wait on a stop signal call `Backoff.delay` and wait themselves;
`with_retries` is for a call that may simply block.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class RetryableError(Exception):
    """A failure that says whether asking again may help (`retryable`) and, when the peer said so, how
    soon (`retry_after`, in seconds)."""

    def __init__(self, message: str, retryable: bool = False, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.retry_after = retry_after


class Backoff:
    """Capped exponential backoff with jitter: attempt n waits between half and all of base*2^n."""

    def __init__(self, base: float, cap: float, rng: random.Random | None = None) -> None:
        self.base = base
        self.cap = cap
        self._rng = rng or random.Random()

    def delay(self, attempt: int) -> float:
        ceiling = min(self.cap, self.base * (2 ** min(attempt, 30)))
        return self._rng.uniform(ceiling / 2, ceiling)


def parse_retry_after(value: str | None) -> float | None:
    """An HTTP Retry-After header in seconds (a negative value counts as 0), or None when it is absent
    or not a finite number (the HTTP-date form is not used by IMDS and is ignored)."""
    try:
        seconds = float(value) if value else None
    except ValueError:
        return None
    return max(0.0, seconds) if seconds is not None and math.isfinite(seconds) else None


def with_retries(call: Callable[[], T], attempts: int = 4, backoff: Backoff | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> T:
    """Run `call`, retrying a RetryableError that says it is retryable, at most `attempts` times in all;
    the wait is the error's `retry_after` when it has one, the backoff's otherwise."""
    backoff = backoff or Backoff(base=0.5, cap=5.0)
    for attempt in range(attempts):
        try:
            return call()
        except RetryableError as exc:
            if not exc.retryable or attempt == attempts - 1:
                raise
            sleep(exc.retry_after if exc.retry_after is not None else backoff.delay(attempt))
    raise AssertionError("unreachable")
