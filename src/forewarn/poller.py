"""The poller: poll IMDS, track changes, publish metrics, spool records, hand changes on.

One poll, from the wire to every consumer:
    client.get_scheduled_events() -> Document -> Tracker.apply() -> [Change]
        -> metrics View (scrape-time collector) and counters
        -> records -> Outbox.append() with the document -> delivery workers -> sinks
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
from typing import Any, Protocol

from forewarn.backlog import Backlog
from forewarn.imds.client import ImdsClient, ImdsError, Stopped
from forewarn.imds.document import Document, DocumentError
from forewarn.imds.instance import VmInfo
from forewarn.logs import StateLog
from forewarn.metrics import Metrics
from forewarn.outbox.delivery import DeliveryObserver
from forewarn.outbox.outbox import Outbox, OutboxObserver, StoreError
from forewarn.records import to_record
from forewarn.sources import StopSignal
from forewarn.tracker import Change, ChangeKind, Tracker

log = logging.getLogger(__name__)

#: Until instance metadata has been read once, how often to try again.
COMPUTE_RETRY_SECONDS = 60.0
#: While IMDS fails, polls are at least this far apart (at most 2 requests/s during an outage).
OUTAGE_PACE = 0.5
#: Distinct document warnings remembered so that each is logged once; the set is reset beyond this.
MAX_REMEMBERED_WARNINGS = 1000


class ChangeListener(Protocol):
    def on_changes(self, document: Document, changes: Sequence[Change], vm: VmInfo) -> None: ...


class StoreView(Protocol):
    def store_writable(self, writable: bool) -> None: ...

    def backlog(self, sink: str, backlog: Backlog) -> None: ...


class StoreMetrics(Protocol):
    """What the outbox's and the delivery workers' observers report to: the per-VM agent's Metrics, or
    fleet mode's."""

    @property
    def views(self) -> StoreView: ...

    @property
    def store_errors(self) -> Any: ...  # prometheus_client Counters

    @property
    def outbox_dropped(self) -> Any: ...

    @property
    def outbox_stored(self) -> Any: ...

    @property
    def outbox_capacity(self) -> Any: ...

    @property
    def records(self) -> Any: ...

    @property
    def record_failures(self) -> Any: ...


class OutboxMetrics(OutboxObserver):
    """The outbox's storage events as metrics: failed writes, dropped and refused records, how full it is, and the
    state_writable gauge."""

    def __init__(self, metrics: StoreMetrics, refused: Any = None) -> None:
        self._metrics = metrics
        self._refused = refused  # fleet mode's outbox_refused counter: only its outbox refuses commits

    def write_failed(self) -> None:
        self._metrics.store_errors.inc()

    def records_dropped(self, count: int) -> None:
        self._metrics.outbox_dropped.inc(count)

    def stored_changed(self, stored: int, capacity: int) -> None:
        self._metrics.outbox_stored.set(stored)
        self._metrics.outbox_capacity.set(capacity)

    def commit_refused(self) -> None:
        if self._refused is not None:
            self._refused.inc()

    def writable_changed(self, writable: bool) -> None:
        self._metrics.views.store_writable(writable)


class DeliveryMetrics(DeliveryObserver):
    """What the delivery workers report, as metrics: records_total, record_failures_total and the
    outbox_records gauge of each sink."""

    def __init__(self, metrics: StoreMetrics) -> None:
        self._metrics = metrics

    def delivered(self, sink: str, count: int) -> None:
        self._metrics.records.labels(sink).inc(count)

    def delivery_failed(self, sink: str) -> None:
        self._metrics.record_failures.labels(sink).inc()

    def backlog(self, sink: str, backlog: Backlog) -> None:
        self._metrics.views.backlog(sink, backlog)


class Poller:
    """The poll loop and what it feeds (the Source of `forewarn run`, forewarn.sources). Everything with I/O is
    passed in, so tests can drive it."""

    name = "imds"

    def __init__(
        self,
        client: ImdsClient,
        metrics: Metrics,
        outbox: Outbox,
        vm_name: str | None = None,
        poll_interval: float = 1.0,
        max_backoff: float = 10.0,
        compute_refresh: float = 3600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.metrics = metrics
        self.outbox = outbox
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
        #: The document of the last good poll. The client hands back this very object when a reply's bytes
        #: equal the last good reply's (ImdsClient._parse_events), which is how a poll knows nothing changed.
        self._last_good: Document | None = None
        self._imds_log = StateLog(log, "IMDS")
        self._warned: set[str] = set()
        self._next_compute = 0.0
        self._status_since: dict[str, tuple[str, float]] = {}
        if self.tracker.current is not None:
            self._track_status(self.tracker.current, clock())
        self.metrics.views.vm_known(self.vm)
        self.metrics.views.store_writable(outbox.writable)
        self.metrics.views.document_resumed(self.tracker.current, self._since_view())

    def _load_history(self) -> Document | None:
        try:
            document = self.outbox.load_document()
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
        try:
            document = self.client.get_scheduled_events()
        except Stopped:
            return 0.0
        except ImdsError as exc:
            return self._poll_failed(exc.kind, str(exc), exc.retry_after, retryable=exc.retryable)
        except DocumentError as exc:
            self.metrics.document_errors.inc()
            return self._poll_failed("document", f"reply is not a valid document: {exc}", None, retryable=True)
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
        self.metrics.views.imds_failed()
        kept = len(self.tracker.current.events) if self.tracker.current else 0
        self._imds_log.failing(key, f"{message}; keeping the last known {kept} event(s)")
        delay = max(self.poll_interval, OUTAGE_PACE)
        if retryable and retry_after is not None:
            delay = max(delay, min(retry_after, self.max_backoff))
        return delay

    def handle_document(self, document: Document, now: float) -> list[Change]:
        """Everything that follows from one good document."""
        if document.warnings:
            self._count_warnings(document.warnings)
        if document is self._last_good:
            # The same reply as the last good poll: the diff would be empty and the saved state is already
            # this document, so only what every good poll does is left (the view's health and clock, the
            # listeners). Nearly every poll takes this path.
            changes: list[Change] = []
            self.metrics.views.document_seen(self.tracker.current, now)
        else:
            self._last_good = document
            changes = self.tracker.apply(document)
            if changes:
                self._track_status(document, now)
                self.metrics.views.document_seen(self.tracker.current, now, self._since_view())
                self._report(document, changes, now)
            else:
                self.metrics.views.document_seen(self.tracker.current, now)
        self._tell_listeners(document, changes)
        return changes

    def _count_warnings(self, warnings: Sequence[str]) -> None:
        """Every good poll counts its document's warnings; each distinct one is logged once."""
        for warning in warnings:
            self.metrics.document_warnings.inc()
            if warning not in self._warned:
                if len(self._warned) >= MAX_REMEMBERED_WARNINGS:
                    self._warned.clear()  # a reply that changes every second cannot grow memory
                self._warned.add(warning)
                log.warning("document: %s (event kept)", warning)

    def _tell_listeners(self, document: Document, changes: Sequence[Change]) -> None:
        # Listeners see every good poll: approval timing depends on the clock, not only on changes.
        for listener in self.listeners:
            try:
                listener.on_changes(document, changes, self.vm)
            except Exception:
                log.exception("change listener %s failed", type(listener).__name__)

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
        self.outbox.append(records, document)

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
        self.metrics.views.vm_known(vm)
        self._next_compute = now + self.compute_refresh

    # --- the loop -----------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Poll at a steady cadence until `stop` is set; setting it also ends a request under way."""
        if self.client.stop is None:
            self.client.stop = stop
        pause = stop.pause if isinstance(stop, StopSignal) else stop.wait
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
            pause(max(0.0, next_poll - time.monotonic()))
