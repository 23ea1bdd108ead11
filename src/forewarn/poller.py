"""The poller: poll IMDS, track changes, publish metrics, spool records, hand changes on.

One poll, from the wire to every consumer:
    client.get_scheduled_events() -> Document -> Tracker.apply() -> [Change]
        -> metrics View (scrape-time collector) and counters
        -> records -> Store.commit() with the document (outbox) -> delivery workers -> sinks
        -> change listeners (the approver)
Polling happens on the main thread at a fixed cadence; delivery, the HTTP server and the simulator
have threads of their own, so nothing they do can delay a poll.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol

from forewarn.imds.client import ImdsClient, ImdsError, Stopped
from forewarn.imds.document import Document, DocumentError
from forewarn.imds.instance import VmInfo
from forewarn.logs import StateLog
from forewarn.metrics import Metrics
from forewarn.outbox.delivery import DeliveryWorker, StoreRef
from forewarn.outbox.store import DB_FILE, Store, StoreError
from forewarn.records import Record, to_record
from forewarn.tracker import Change, ChangeKind, Tracker

log = logging.getLogger(__name__)

#: While the state dir is unusable, how often to try it again.
STORE_RETRY_SECONDS = 30.0
#: Until instance metadata has been read once, how often to try again.
COMPUTE_RETRY_SECONDS = 60.0
#: While IMDS fails, polls are at least this far apart (at most 2 requests/s during an outage).
OUTAGE_PACE = 0.5
#: Distinct document warnings remembered so that each is logged once; the set is reset beyond this.
MAX_REMEMBERED_WARNINGS = 1000


class ChangeListener(Protocol):
    def on_changes(self, document: Document, changes: Sequence[Change], vm: VmInfo) -> None: ...


class Poller:
    """The poll loop and what it feeds. Everything with I/O is passed in, so tests can drive it."""

    def __init__(
        self,
        client: ImdsClient,
        metrics: Metrics,
        store: Store,
        state_dir: Path | None,
        workers: Sequence[DeliveryWorker] = (),
        stores: StoreRef | None = None,
        vm_name: str | None = None,
        poll_interval: float = 1.0,
        max_backoff: float = 10.0,
        compute_refresh: float = 3600.0,
        store_writable: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.metrics = metrics
        self.stores = stores or StoreRef(store)
        self.state_dir = state_dir
        self.workers = list(workers)
        self.vm_name = vm_name
        self.vm = VmInfo().with_name(vm_name)
        if poll_interval < client.shortest_poll_interval:
            # Polls leave one request per window to approvals and instance metadata; closer polls would
            # queue on the rate limiter in bursts, so space them evenly at the fastest sustainable pace.
            log.info("polling every %.3g s rather than %g s: IMDS allows 5 requests/s and one is kept for "
                     "approvals", client.shortest_poll_interval, poll_interval)
            poll_interval = client.shortest_poll_interval
        self.poll_interval = poll_interval
        self.max_backoff = max(max_backoff, poll_interval)
        self.compute_refresh = compute_refresh
        self.clock = clock
        self.listeners: list[ChangeListener] = []
        self.tracker = Tracker(self._load_history())
        self._failures = 0
        self._imds_log = StateLog(log, "IMDS")
        self._store_log = StateLog(log, "state dir")
        self._warned: set[str] = set()
        self._spool_lock = threading.Lock()
        self._next_compute = 0.0
        self._store_writable = store_writable
        self._next_store_retry = clock() + STORE_RETRY_SECONDS
        self._status_since: dict[str, tuple[str, float]] = {}
        if self.tracker.current is not None:
            self._track_status(self.tracker.current, clock())
        self.metrics.views.update(vm=self.vm, store_writable=store_writable, document=self.tracker.current,
                                  status_since=self._since_view())

    @property
    def store(self) -> Store:
        return self.stores.store

    def _load_history(self) -> Document | None:
        try:
            document = self.store.load_document()
        except StoreError as exc:
            log.error("cannot read saved state (%s); starting without history", exc)
            return None
        if document is not None:
            log.info("resuming from saved state: incarnation %d with %d event(s)",
                     document.incarnation, len(document.events))
        return document

    # --- one poll -----------------------------------------------------------------------------
    def poll_once(self) -> float:
        """Poll IMDS once and pass on what changed; returns the seconds to wait before the next poll."""
        now = self.clock()
        if now >= self._next_compute:
            self._refresh_compute(now)
        if not self._store_writable and now >= self._next_store_retry:
            with self._spool_lock:
                self._try_disk_store()
        try:
            document = self.client.get_scheduled_events()
        except Stopped:
            return 0.0
        except ImdsError as exc:
            return self._poll_failed(exc.kind, str(exc), exc.retry_after, retryable=exc.retryable)
        except DocumentError as exc:
            self.metrics.document_errors.inc()
            return self._poll_failed("document", f"reply is not a valid document: {exc}", None, retryable=True)
        self._failures = 0
        self._imds_log.ok()
        self.handle_document(document, self.clock())
        return self.poll_interval

    def _poll_failed(self, key: str, message: str, retry_after: float | None, retryable: bool) -> float:
        """The wait before the next poll after a failed one.

        Outages of IMDS are measured in seconds (410 while it updates, 5xx, resets), and a Spot eviction
        gives 30 s or less: backing off by the number of failures left forewarn blind for up to the cap
        after IMDS recovered. So a failed poll is retried at the normal pace, never faster than
        OUTAGE_PACE (IMDS is per host and not shared, so there is no herd to spread), and later only when
        IMDS asks for it with Retry-After (capped by --imds-max-backoff).
        """
        self._failures += 1
        self.metrics.views.update(imds_up=False)
        kept = len(self.tracker.current.events) if self.tracker.current else 0
        self._imds_log.failing(key, f"{message}; keeping the last known {kept} event(s)")
        delay = max(self.poll_interval, OUTAGE_PACE)
        if retryable and retry_after is not None:
            delay = max(delay, min(retry_after, self.max_backoff))
        return delay

    def handle_document(self, document: Document, now: float) -> list[Change]:
        """Everything that follows from one good document."""
        for warning in document.warnings:
            self.metrics.document_warnings.inc()
            if warning not in self._warned:
                if len(self._warned) >= MAX_REMEMBERED_WARNINGS:
                    self._warned.clear()  # a reply that changes every second cannot grow memory
                self._warned.add(warning)
                log.warning("document: %s (event kept)", warning)
        changes = self.tracker.apply(document)
        if changes:
            self._track_status(document, now)
            self.metrics.views.update(document=self.tracker.current, imds_up=True, last_success=now,
                                      status_since=self._since_view())
            self._report(document, changes, now)
        else:
            self.metrics.views.update(document=self.tracker.current, imds_up=True, last_success=now)
        # Listeners see every good poll: approval timing depends on the clock, not only on changes.
        for listener in self.listeners:
            try:
                listener.on_changes(document, changes, self.vm)
            except Exception:
                log.exception("change listener %s failed", type(listener).__name__)
        return changes

    def _track_status(self, document: Document, now: float) -> None:
        """Remember since when each event has had its current status (for the stuck-event alert)."""
        previous = self._status_since
        self._status_since = {
            event.event_id: previous[event.event_id]
            if event.event_id in previous and previous[event.event_id][0] == event.status else (event.status, now)
            for event in document.events
        }

    def _since_view(self) -> dict[str, float]:
        return {event_id: since for event_id, (_, since) in self._status_since.items()}

    def _report(self, document: Document, changes: Sequence[Change], now: float) -> None:
        observed_at = datetime.fromtimestamp(now, tz=timezone.utc)
        records = []
        for change in changes:
            event = change.event
            log.info("event %s %s: %s %s (NotBefore %s, resources %s)", event.event_id, change.kind,
                     event.event_type, event.status, event.raw.get("NotBefore") or "-",
                     ",".join(event.resources) or "-")
            if change.kind is ChangeKind.ADDED:
                self.metrics.observed.labels(event.event_type, event.source or "").inc()
            elif change.kind is ChangeKind.REMOVED:
                self.metrics.ended.labels(event.event_type, str(change.outcome)).inc()
            records.append(to_record(change, self.vm, observed_at))
        self.spool(records, document)

    def spool(self, records: Sequence[Record], document: Document | None = None) -> None:
        """Put records in the outbox, with the document they came from when given, then wake the workers.

        Other threads (the approver) spool without a document: only the poll loop moves the saved state
        forward, and only together with the records of that document's changes.
        """
        with self._spool_lock:
            try:
                dropped = self.store.commit(document, records)
            except StoreError as exc:
                self.metrics.store_errors.inc()
                self._degrade(str(exc))
                dropped = self.store.commit(document, records)
            if dropped:
                self.metrics.outbox_dropped.inc(dropped)
                log.error("outbox full (%d records): dropped the %d oldest", self.store.max_records, dropped)
        for worker in self.workers:
            worker.wake()

    # --- when the state dir fails -------------------------------------------------------------
    def _degrade(self, reason: str) -> None:
        """Move the outbox into memory so records keep flowing while the disk cannot take them."""
        self._store_log.failing("write", f"cannot write state ({reason}); holding records in memory "
                                "until it can, retrying every %g s" % STORE_RETRY_SECONDS)
        old = self.store
        memory = Store(None, [w.sink.name for w in self.workers], old.max_records)
        try:
            rows, cursors = old.dump()
            memory.adopt(rows, cursors, self.tracker.current)
        except StoreError as exc:
            log.error("could not carry the outbox over to memory (%s); records waiting on disk are "
                      "delivered once it recovers", exc)
        self.stores.store = memory
        # Closing every connection releases any lock a failed write left behind, so the disk store can be
        # opened again as soon as there is room.
        old.close()
        self._store_writable = False
        self._next_store_retry = self.clock() + STORE_RETRY_SECONDS
        self.metrics.views.update(store_writable=False)

    def _try_disk_store(self) -> None:
        self._next_store_retry = self.clock() + STORE_RETRY_SECONDS
        if self.state_dir is None:
            return
        memory = self.store
        disk = None
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            disk = Store(self.state_dir / DB_FILE, [w.sink.name for w in self.workers], memory.max_records)
            rows, cursors = memory.dump()
            disk.adopt(rows, cursors, self.tracker.current)
        except (OSError, StoreError) as exc:
            log.debug("state dir still unusable: %s", exc)
            if disk is not None:
                disk.close()
            return
        self.stores.store = disk
        self._store_writable = True
        self._store_log.ok()
        self.metrics.views.update(store_writable=True)
        for worker in self.workers:
            worker.wake()

    # --- instance metadata --------------------------------------------------------------------
    def _refresh_compute(self, now: float) -> None:
        try:
            info = self.client.get_compute()
        except (ImdsError, DocumentError) as exc:
            level = logging.WARNING if not self.vm.vm_id else logging.DEBUG
            log.log(level, "cannot read instance metadata (%s); retrying in %g s", exc, COMPUTE_RETRY_SECONDS)
            self._next_compute = now + COMPUTE_RETRY_SECONDS
            return
        vm = info.with_name(self.vm_name)
        if vm != self.vm:
            log.info("this VM: name=%s scale_set=%s location=%s", vm.name or "-", vm.vm_scale_set or "-",
                     vm.location or "-")
        self.vm = vm
        self.metrics.views.update(vm=vm)
        self._next_compute = now + self.compute_refresh

    # --- the loop -----------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Poll at a steady cadence until `stop` is set; setting it also ends a request under way."""
        if self.client.stop is None:
            self.client.stop = stop
        next_poll = time.monotonic()
        while not stop.is_set():
            started = time.monotonic()
            delay = self.poll_once()
            finished = time.monotonic()
            next_poll = max(next_poll + delay, finished)
            if delay != self.poll_interval or finished - started > delay / 2:
                # A retry, or a poll that took long (a slow reply, a wait for the request budget): count
                # the next interval from now, rather than catching up with a poll right after this one.
                next_poll = finished + delay
            stop.wait(max(0.0, next_poll - time.monotonic()))
