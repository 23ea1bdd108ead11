"""Delivery workers: one thread per sink, draining that sink's part of the outbox in order.

Delivery never runs on the poll path: a sink that is down or slow only grows its own backlog. Each
batch is retried with capped, jittered backoff until the sink takes it; only then does the cursor move.
What the workers do is reported through a `DeliveryObserver`; the metrics implement it, so this package
never imports them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from forewarn.backlog import Backlog
from forewarn.logs import StateLog
from forewarn.outbox.outbox import Batch, Outbox
from forewarn.outbox.store import StoreError
from forewarn.retry import Backoff
from forewarn.sinks import Sink

log = logging.getLogger(__name__)

#: Records read from the outbox and handed to the sink at once, for a sink that names no `batch_size`.
BATCH_SIZE = 500
#: While a backlog drains, how often its size is read again for the gauge (a count reads every waiting
#: row, so counting after every batch would cost more than the batches once the backlog is large).
BACKLOG_REFRESH_SECONDS = 1.0
#: ... and at most this share of the time: counting 100,000 waiting records takes 34 ms, 3% of a core once a
#: second, while the drain needs every bit of it.
BACKLOG_REFRESH_SHARE = 0.01
#: ... but never less often than this.
BACKLOG_REFRESH_MAX_SECONDS = 10.0
#: An idle worker whose sink has released its connections looks at the outbox this often, though every append
#: wakes it: a safety net, not the way records are found.
RESTED_RECHECK_SECONDS = 300.0


class DeliveryObserver:
    """What a delivery worker reports, from its own thread; this base class ignores it all (the metrics
    of each mode implement it)."""

    def delivered(self, sink: str, count: int) -> None:
        """The sink took `count` more records."""

    def delivery_failed(self, sink: str) -> None:
        """A send to the sink failed (it is retried)."""

    def backlog(self, sink: str, backlog: Backlog) -> None:
        """What now waits for the sink."""


class DeliveryWorker:
    """Delivers one sink's records. `stop()` first drains what is waiting, for at most its timeout:
    records spooled just before SIGTERM still go out, and whatever cannot go out stays in the outbox.

    Batches are the sink's `batch_size` records (BATCH_SIZE for a sink without one) unless `batch_size`
    is given: one read of the outbox, one send, one acknowledging transaction each. Setting `stop` ends the
    worker at its next look; `stop()` (and `stop_workers`) ends one waiting between attempts at once."""

    def __init__(self, sink: Sink, outbox: Outbox, observer: DeliveryObserver | None = None,
                 stop: threading.Event | None = None, backoff: Backoff | None = None, idle_refresh: float = 30.0,
                 batch_size: int | None = None) -> None:
        batch_size = batch_size if batch_size is not None else getattr(sink, "batch_size", BATCH_SIZE)
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1; got {batch_size}")
        self.sink = sink
        self.batch_size = batch_size
        self._outbox = outbox
        self._observer = observer or DeliveryObserver()
        self._stop = stop or threading.Event()
        self._draining = threading.Event()
        #: Ends a wait between attempts early: set by a stop, whose drain has no time for a backoff.
        self._interrupt = threading.Event()
        self._backoff = backoff or Backoff(base=0.5, cap=30.0)
        self._idle_refresh = idle_refresh
        self._failures = StateLog(log, f"sink {sink.name}")
        self._backlog_next = float("-inf")
        self._thread = threading.Thread(target=self._run, name=f"deliver-{sink.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, drain_timeout: float = 5.0) -> None:
        """Deliver what is waiting (up to `drain_timeout` seconds), then end the thread."""
        stop_workers([self], drain_timeout)

    def _begin_drain(self) -> None:
        """Deliver what is waiting, then end (a failed send ends it at once: there is no time to retry)."""
        self._draining.set()
        self._interrupt.set()
        self._outbox.wake(self.sink.name)

    def _halt(self) -> None:
        self._stop.set()
        self._interrupt.set()
        self._outbox.wake(self.sink.name)

    def _pause(self, seconds: float) -> None:
        """Wait between attempts. A stop ends the wait at once: a worker that was backing off from a sink that is
        down when the stop came used to sleep out its backoff (up to 30 s, cut by --drain-timeout) before the
        one attempt the drain allows it, so a stop with an unreachable sink took seconds for nothing."""
        if self._stop.is_set():
            return
        self._interrupt.wait(seconds)

    def _publish_backlog(self, now: bool = True) -> None:
        """Report what waits for the sink: at once, or (`now` False, between the batches of a drain) when
        the last report is older than BACKLOG_REFRESH_SECONDS and than 1 / BACKLOG_REFRESH_SHARE times what the
        last count took, up to BACKLOG_REFRESH_MAX_SECONDS)."""
        started = time.monotonic()
        if not now and started < self._backlog_next:
            return
        try:
            self._observer.backlog(self.sink.name, self._outbox.backlog(self.sink.name))
        except Exception as exc:  # a metrics refresh must never stop delivery
            log.debug("cannot read backlog of %s: %s", self.sink.name, exc)
        took = time.monotonic() - started
        self._backlog_next = started + min(max(BACKLOG_REFRESH_SECONDS, took / BACKLOG_REFRESH_SHARE),
                                           BACKLOG_REFRESH_MAX_SECONDS)

    def _idle(self) -> None:
        """Nothing to send for a while: let a sink that holds costly connections release them."""
        idle = getattr(self.sink, "idle", None)
        if idle is None:
            return
        try:
            idle()
        except Exception as exc:  # releasing is best effort; the next send reconnects either way
            log.debug("sink %s: idle clean-up failed: %s", self.sink.name, exc)

    def _prepare(self, after: int = 0) -> Prepared:
        """The next batch (past the acknowledged records, and past `after`), encoded when the sink encodes
        apart from sending; raises StoreError when the outbox cannot be read."""
        batch = self._outbox.take(self.sink.name, self.batch_size, after)
        encode = getattr(self.sink, "encode", None)
        if encode is None or not batch:
            return Prepared(batch)
        try:
            return Prepared(batch, encode(batch.records))
        except Exception as exc:  # reported as that batch's failed send, and retried as one
            return Prepared(batch, error=exc)

    def _send(self, prepared: Prepared) -> None:
        if prepared.error is not None:
            raise prepared.error
        if prepared.payload is None:
            self.sink.send(prepared.batch.records)
        else:
            self.sink.send_encoded(prepared.payload)  # type: ignore[attr-defined]

    def _run(self) -> None:
        # The next batch is taken and encoded on a thread of its own while this one sends the current one:
        # a sink that encodes apart from sending spends its CPU while the peer works, not after it. (One
        # long-lived thread: a new thread per batch had the allocator add arenas, tens of MB of RSS.)
        with ThreadPoolExecutor(1, thread_name_prefix=f"encode-{self.sink.name}") as encoder:
            self._deliver(encoder)

    def _deliver(self, encoder: ThreadPoolExecutor) -> None:
        attempt = 0
        ahead: Future[Prepared] | None = None
        # Once the sink has been told it is idle, the worker sleeps until records come (every append wakes it) or
        # a stop does, looking again only every RESTED_RECHECK_SECONDS in case a wake-up was ever missed: it used
        # to look every 30 s, a read of the outbox that cost a thirtieth of an idle collector's CPU at 1 poll/s.
        rested = False
        while not self._stop.is_set():
            try:
                prepared = ahead.result() if ahead is not None else self._prepare()
            except StoreError as exc:
                ahead = None
                self._failures.failing("store", f"cannot read the outbox: {exc}")
                if self._draining.is_set():
                    return
                self._pause(self._backoff.delay(attempt))
                continue
            ahead = None
            batch = prepared.batch
            if not batch:
                self._publish_backlog()
                if self._draining.is_set():
                    return
                if not self._outbox.wait(self.sink.name, RESTED_RECHECK_SECONDS if rested else self._idle_refresh):
                    self._idle()
                    rested = True
                continue
            rested = False
            if prepared.payload is not None:
                ahead = encoder.submit(self._prepare, batch.last)
            try:
                self._send(prepared)
            except Exception as exc:  # any sink failure is retried; the message is sink-provided
                if ahead is not None:  # prepared behind a batch that did not go: taken again after the wait
                    wait([ahead])
                    ahead = None
                self._observer.delivery_failed(self.sink.name)
                self._failures.failing(type(exc).__name__ + str(exc)[:60],
                                       f"delivery failed, will retry: {exc}")
                self._publish_backlog()
                if self._draining.is_set():
                    return
                self._pause(retry_wait(exc, self._backoff.delay(attempt)))
                attempt += 1
                continue
            attempt = 0
            self._failures.ok()
            self._observer.delivered(self.sink.name, len(batch))
            try:
                self._outbox.ack(self.sink.name, batch.last)
            except StoreError as exc:
                # Delivered but not remembered: sent again after a restart (same record ids), unless a later
                # batch's acknowledgement covers it first.
                self._failures.failing("ack", f"cannot record delivery: {exc}")
                self._pause(0.5)
            self._publish_backlog(now=False)


@dataclass(frozen=True)
class Prepared:
    """A batch ready to send: its records, and the sink's encoding of them (or the error encoding raised)."""

    batch: Batch
    payload: object | None = None
    error: Exception | None = None


#: The longest Retry-After honoured: a peer asking for an hour would otherwise hold the whole backlog.
MAX_RETRY_AFTER = 600.0


def retry_wait(exc: BaseException, backoff: float) -> float:
    """How long to wait after a failed send: the peer's Retry-After (a sink error's `retry_after`, e.g. from
    an HTTP 429), capped at MAX_RETRY_AFTER, when it gave one; the backoff's delay otherwise."""
    retry_after = getattr(exc, "retry_after", None)
    if isinstance(retry_after, (int, float)) and retry_after >= 0:
        return min(float(retry_after), MAX_RETRY_AFTER)
    return backoff


#: After the drain timeout, how long workers get to notice the stop (one in a backoff wait ends at once).
HALT_GRACE = 0.2


def stop_workers(workers: Sequence[DeliveryWorker], drain_timeout: float) -> list[str]:
    """Let every worker deliver what is waiting, all at once, for `drain_timeout` seconds in total, then
    stop them; returns the sinks still busy. A sink that hangs is left to its daemon thread: its records
    were never acknowledged, so they stay in the outbox and go out after the next start."""
    for worker in workers:
        worker._begin_drain()
    deadline = time.monotonic() + drain_timeout
    for worker in workers:
        worker._thread.join(max(0.0, deadline - time.monotonic()))
    for worker in workers:
        worker._halt()
    deadline = time.monotonic() + HALT_GRACE
    for worker in workers:
        worker._thread.join(max(0.0, deadline - time.monotonic()))
    return [worker.sink.name for worker in workers if worker._thread.is_alive()]


def log_left(workers: Sequence[DeliveryWorker]) -> None:
    """One line at stop: the records each sink leaves in the outbox (a warning when any are left, saying whether
    they survive the exit)."""
    if not workers:
        return
    left: list[str] = []
    waiting = False
    for worker in workers:
        try:
            records = worker._outbox.backlog(worker.sink.name).records
        except StoreError as exc:
            left.append(f"{worker.sink.name} unknown ({exc})")
            waiting = True
            continue
        left.append(f"{worker.sink.name} {records}")
        waiting = waiting or records > 0
    outbox = workers[0]._outbox
    if not waiting:
        log.info("records left in the outbox at stop: %s", ", ".join(left))
    elif outbox.state_dir is not None and outbox.writable:
        log.warning("records left in the outbox at stop: %s; delivered after the next start", ", ".join(left))
    else:
        log.warning("records left in the outbox at stop: %s; lost at exit: the outbox is in memory (no state dir, "
                    "or one that could not be written)", ", ".join(left))


def close_sinks(sinks: Sequence[Sink], timeout: float = 1.0) -> list[str]:
    """Close every sink at once, for `timeout` seconds in total (a client library may wait on a dead
    peer while closing); returns the sinks that had not finished."""
    def close(sink: Sink) -> None:
        try:
            sink.close()
        except Exception as exc:  # closing is best effort: the process is stopping either way
            log.warning("closing sink %s: %s", sink.name, exc)

    threads = [threading.Thread(target=close, args=(sink,), name=f"close-{sink.name}", daemon=True)
               for sink in sinks]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [sink.name for sink, thread in zip(sinks, threads, strict=True) if thread.is_alive()]


def finish_delivery(workers: Sequence[DeliveryWorker], sinks: Sequence[Sink], drain_timeout: float) -> None:
    """At stop: drain every sink at once within `drain_timeout` (so it bounds the whole stop, however many sinks
    hang), then close them, saying which did not finish and what each leaves in the outbox."""
    for name in stop_workers(workers, drain_timeout):
        log.warning("still delivering to %s after --drain-timeout %g s; its records stay in the outbox "
                    "and are delivered after the next start", name, drain_timeout)
    log_left(workers)
    for name in close_sinks(sinks):
        log.warning("sink %s did not close within 1 s; leaving it", name)
