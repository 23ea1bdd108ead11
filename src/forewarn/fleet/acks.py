"""Acknowledgements sent independently of each other: a bounded pool, one call under way per target, and a
backoff per target that no worker sleeps through.

Why: an acknowledgement that waits inside its call for ARM's Retry-After (and a caller that sends target by
target) lets one target ARM keeps failing hold back every other target's approval, by up to five Retry-After
waits. Here a call is tried once (`acknowledge(..., attempts=1)`); a failure only sets when its target may be
tried again, the later of the backoff and ARM's Retry-After (capped), counted from the END of the failed call,
and the caller sends again at a later step. A target that keeps failing occupies at most one worker, for one
call at a time, and never another target's turn.

How a caller uses it (forewarn.fleet.approval does, once per step):

    rounds = AckRounds(acknowledger, clock, stop)         # one per term; close() at its end
    if rounds.ready(target, now):                         # nothing under way, its backoff passed
        rounds.send(target, event_ids, done)              # done(AckResult) later, on a pool thread
    else:
        log.info(rounds.waiting(target, now))             # why it waits, for a log line

A target counts as under way from `send` until `done` has returned, so a caller that updates its own state in
`done` and checks `ready` before sending never sends the same events twice.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Protocol

from forewarn.deadline import Stopped
from forewarn.retry import Backoff, RetryableError

log = logging.getLogger(__name__)

#: Calls under way at once, in all (ARM's write limit is per subscription and identity; 4 keeps a burst small).
DEFAULT_WORKERS = 4
#: The backoff per target: attempt n waits between half and all of BASE * 2^n, at most CAP (as does a Retry-After).
DEFAULT_BASE = 2.0
DEFAULT_CAP = 60.0


class Acknowledging(Protocol):
    """What AckRounds calls: forewarn.fleet.acknowledge.Acknowledger, tried once per call (`attempts=1`).
    It raises a RetryableError (with `status` when ARM answered) when the call did not go through, Stopped
    at the stop signal, ValueError for a target or event id that cannot be one."""

    def acknowledge(self, target: str, event_ids: Sequence[str], *, attempts: int) -> object: ...


@dataclass(frozen=True)
class AckResult:
    """What one call did. `ok`: ARM accepted every event. Otherwise `retryable` says whether the target may be
    tried again (429, 5xx, no answer, the stop); a failure that is not (`final`: 404 no such event, 403 no
    right, a target or id that cannot be one) should not be sent again for these events. `status` is ARM's
    (None: no answer), `error` the reason (never the token), `next_attempt` the clock time from which the
    target is `ready` again, `failures` the target's failures in a row (this one included; 0 after a success
    or a final refusal), `stopped` that the stop signal or close() ended it (nothing failed; counts as
    retryable, not as a failure)."""

    target: str
    event_ids: tuple[str, ...]
    ok: bool
    retryable: bool = False
    status: int | None = None
    error: str = ""
    next_attempt: float = 0.0
    failures: int = 0
    stopped: bool = False

    @property
    def final(self) -> bool:
        return not self.ok and not self.retryable


@dataclass
class _Target:
    """One target's turn: a call under way, or the failures in a row and when it may be tried again."""

    under_way: bool = False
    failures: int = 0
    next_attempt: float = 0.0
    last: str = ""             # the last failure, for `waiting`


class AckRounds:
    """Sends acknowledgements on a pool of `workers` threads, at most one call under way per target.

    - `acknowledger`: anything with `acknowledge(target, event_ids, *, attempts)` (Acknowledging); it should
      share `stop`, so that the stop also ends a call under way.
    - `clock`: the caller's clock (seconds; `ready`'s `now` and `AckResult.next_attempt` are on it).
    - `stop`: once set, no new call starts; a send still queued reports `stopped`.
    - `base`, `cap`: the backoff per target (forewarn.retry.Backoff); a Retry-After longer than the backoff is
      kept, up to `cap`.

    `ready(target, now)`: nothing under way for it and its backoff has passed (targets compare without case).
    `send(target, event_ids, done)`: one call on the pool; `done(AckResult)` is called exactly once, on a pool
    thread (also when the call is stopped or raises something unexpected). Raises RuntimeError when a call for
    the target is under way (ask `ready` first) or after close(). It does not check the backoff: that is
    `ready`'s.
    `waiting(target, now)`: why the target is not ready ("" when it is), for a log line.
    `close(wait=True)`: no more sends; with `wait`, returns once every `done` has been called (promptly when
    `stop` is set: a call under way ends at its next deadline slice).
    """

    def __init__(self, acknowledger: Acknowledging, clock: Callable[[], float] = time.time,
                 stop: threading.Event | None = None, *, workers: int = DEFAULT_WORKERS, base: float = DEFAULT_BASE,
                 cap: float = DEFAULT_CAP, rng: random.Random | None = None) -> None:
        if workers < 1 or base <= 0 or cap < base:
            raise ValueError(f"workers must be at least 1 and 0 < base <= cap; got {workers}, {base}, {cap}")
        self.acknowledger = acknowledger
        self.clock = clock
        self.stop = stop if stop is not None else threading.Event()
        self.workers = workers
        self.cap = cap
        self._backoff = Backoff(base=base, cap=cap, rng=rng)
        self._targets: dict[str, _Target] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fleet-ack")
        self._under_way: set[Future[None]] = set()

    def ready(self, target: str, now: float) -> bool:
        with self._lock:
            state = self._targets.get(target.lower())
            return state is None or (not state.under_way and now >= state.next_attempt)

    def waiting(self, target: str, now: float) -> str:
        with self._lock:
            state = self._targets.get(target.lower())
            if state is None or (not state.under_way and now >= state.next_attempt):
                return ""
            if state.under_way:
                return "an acknowledgement of its target is under way"
            return (f"acknowledging its target failed {state.failures} time(s) in a row ({state.last}); "
                    f"next try in {state.next_attempt - now:.0f} s")

    def send(self, target: str, event_ids: Sequence[str], done: Callable[[AckResult], object]) -> None:
        ids = tuple(event_ids)
        key = target.lower()
        with self._lock:
            if self._closed:
                raise RuntimeError("the acknowledgement rounds are closed")
            self._forget_idle(self.clock())
            state = self._targets.setdefault(key, _Target())
            if state.under_way:
                raise RuntimeError(f"an acknowledgement of {target} is under way; ask ready() first")
            state.under_way = True
            future = self._pool.submit(self._run, target, ids, done)
            self._under_way.add(future)
        future.add_done_callback(self._finished)

    def _finished(self, future: Future[None]) -> None:
        with self._lock:
            self._under_way.discard(future)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every call sent so far has had its `done` called; False if one has not after `timeout`."""
        with self._lock:
            under_way = set(self._under_way)
        return not wait(under_way, timeout=timeout).not_done

    def close(self, wait: bool = True) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=wait)

    # --- on a pool thread ----------------------------------------------------------------------------------
    def _run(self, target: str, ids: tuple[str, ...], done: Callable[[AckResult], object]) -> None:
        key = target.lower()
        try:
            result = self._call(target, ids)
            try:
                done(result)
            except Exception:  # the caller's bug must not leave the target under way for ever
                log.exception("handling the acknowledgement of %s on %s failed", ", ".join(ids), target)
        finally:
            with self._lock:
                state = self._targets[key]
                state.under_way = False
                if state.failures == 0:
                    del self._targets[key]   # nothing to remember: ready at once

    def _call(self, target: str, ids: tuple[str, ...]) -> AckResult:
        """One call, then the target's schedule (still under way, so `ready` stays False until `done` returns)."""
        status: int | None = None
        retry_after: float | None = None
        if self.stop.is_set() or self._closed:
            return self._stopped(target, ids)
        try:
            self.acknowledger.acknowledge(target, ids, attempts=1)
        except Stopped:
            return self._stopped(target, ids)
        except RetryableError as exc:
            ok, retryable, error = False, exc.retryable, str(exc)
            status, retry_after = getattr(exc, "status", None), exc.retry_after
        except ValueError as exc:
            ok, retryable, error = False, False, str(exc)
        except Exception as exc:  # a bug here must not take the target's turn for ever: tried again later
            log.exception("acknowledging %s on %s failed unexpectedly", ", ".join(ids), target)
            ok, retryable, error = False, True, f"{type(exc).__name__}: {str(exc)[:200]}"
        else:
            ok, retryable, error = True, False, ""
        ended = self.clock()
        with self._lock:
            state = self._targets[target.lower()]
            if ok or not retryable:
                state.failures, state.next_attempt, state.last = 0, ended, ""
            else:
                state.failures += 1
                backoff = self._backoff.delay(state.failures - 1)
                # counted from the end of the failed call: ARM's Retry-After is from its answer, not our request
                state.next_attempt = ended + min(self.cap, max(backoff, retry_after or 0.0))
                state.last = f"HTTP {status}" if status is not None else error[:120]
            return AckResult(target, ids, ok, retryable, status, error, state.next_attempt, state.failures)

    def _stopped(self, target: str, ids: tuple[str, ...]) -> AckResult:
        with self._lock:
            state = self._targets[target.lower()]
            return AckResult(target, ids, False, True, None, "stopping", max(state.next_attempt, self.clock()),
                             state.failures, stopped=True)

    def _forget_idle(self, now: float) -> None:
        """Targets whose backoff passed more than `cap` ago and that were not tried since are forgotten (their
        events ended, or moved on): the memory is bounded by the targets that failed lately."""
        for key in [key for key, state in self._targets.items()
                    if not state.under_way and state.next_attempt + self.cap < now]:
            del self._targets[key]
