"""Fleet mode's metrics: the per-VM agent's event families with the VM's place as labels, and source health.

Per event and VM (present while the event is open): the families of forewarn.metrics.events, the very code
that renders the per-VM agent's (`azure_scheduled_event_info`, `..._not_before_timestamp_seconds`,
`..._duration_seconds`, `..._status_since_timestamp_seconds`), with `vm`, `vm_scale_set`, `resource_group` and
`subscription_id` added (`affects_this_vm` is always "true": a fleet series is about a VM the event acts on).
The per-VM agent's scrape-time countdown is left out: at 10,000 series it would be rendered at every scrape;
`not_before_timestamp_seconds - time()` in PromQL gives it. Aggregates: `azure_scheduled_events{event_type,
event_status, event_source}` counts events (not VMs) as the per-VM agent does,
`azure_scheduled_events_by_scope` the same by `subscription_id` and `resource_group`, and
`azure_scheduled_events_vms` the VMs by scale set too. The per-VM families show at most `max_vms` VMs
(--metrics-max-vms; `azure_scheduled_events_per_vm_left_out` counts the rest); the aggregates always count every
event and VM. Counters and delivery
families keep their names. Source health is new: `azure_scheduled_events_source_up{source}`,
`..._source_last_success_timestamp_seconds`, the queue's message counts, the events outside the scope, Resource
Graph's quota and the last reconcile's duration.

The scrape reads an immutable snapshot that the service replaces after each commit: no lock is held
while rendering, and a scrape never waits for a source.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

from forewarn import __version__
from forewarn.backlog import Backlog
from forewarn.fleet.feed import FleetEvent
from forewarn.fleet.tracker import STATUS_RANK, event_key
from forewarn.imds.document import EVENT_TYPES
from forewarn.metrics.codecs import CODECS
from forewarn.metrics.core import EOF, Counter, Family, FeatureFamilies, Gauge, Registry, encode, negotiate
from forewarn.metrics.events import PLACE_LABELS, OpenEvent, event_families
from forewarn.metrics.exposition import NodeMetrics
from forewarn.metrics.process import ProcessFamilies
from forewarn.web.server import Request, Response, Stream

PUSH_RESULTS = ("accepted", "validated", "unauthorized", "invalid", "failed")
#: VMs whose per-VM series /metrics shows by default (--metrics-max-vms): about 40,000 series, 11 MB of text
#: (0.4 MB gzip) per scrape, rendered in 0.3 s on one core (bench/fleet.py).
DEFAULT_MAX_VMS = 10_000
#: The sources whose events are checked against the scope here; Resource Graph's query holds the scope itself.
SCOPED_SOURCES = ("queue", "eventgrid")


@dataclass(frozen=True)
class SourceHealth:
    up: bool | None = None            # None: not configured, or not tried yet
    last_success: float | None = None


@dataclass(frozen=True)
class FleetView:
    events: tuple[FleetEvent, ...] = ()
    events_version: int = 0  # raised with every change of `events`: the key of the rendering cache
    sources: dict[str, SourceHealth] = field(default_factory=dict)
    backlogs: dict[str, Backlog] = field(default_factory=dict)
    quota_remaining: float | None = None
    reconcile_seconds: float | None = None
    commit_seconds: float | None = None
    #: (resource, EventId) -> (status, when it was first seen in that status)
    status_since: dict[tuple[str, str], tuple[str, float]] = field(default_factory=dict)


class UndoHeld:
    """Why fleet mode holds back undos on nodes now: the ledger entries it left alone at its last read of the
    nodes, by reason, and whether it waits for the term's first complete snapshot before touching any node."""

    REASONS = ("other_owner", "legacy", "not_known_over")

    def __init__(self, registry: Registry) -> None:
        self.entries = Gauge("azure_scheduled_events_fleet_undo_held",
                             "Node ledger entries whose undo this instance holds back, at its last read of the nodes, "
                             "by reason: other_owner (the per-VM agent's or another fleet instance's: never undone "
                             "here), legacy (written before owners; undone once the feeds say its event ended), "
                             "not_known_over (not open, not known to be over yet).", ["reason"], registry=registry)
        for reason in self.REASONS:
            self.entries.labels(reason)
        self.waiting = Gauge("azure_scheduled_events_fleet_nodes_waiting_for_snapshot",
                             "1 while the active replica does nothing to nodes (no node action, no undo) because its "
                             "term has no complete Resource Graph snapshot yet, or because its saved state could "
                             "not be read back.", registry=registry)

    def set(self, held: Mapping[str, int], waiting: int) -> None:
        self.waiting.set(waiting)
        if not waiting:
            for reason in self.REASONS:
                self.entries.labels(reason).set(held.get(reason, 0))


class FleetMetrics:
    """The registry of `forewarn fleet`, and the operations that change what it shows."""

    def __init__(self, sources: Sequence[str], api_version: str = "", max_vms: int = DEFAULT_MAX_VMS) -> None:
        self.api_version = api_version
        #: VMs whose per-VM series are shown at most (0: all); the aggregates always count every one.
        self.max_vms = max_vms
        #: Whether this replica is the active one (holds the Lease; always without one), read at scrape time.
        self.active: Callable[[], bool] = lambda: True
        self.registry = Registry()
        self._lock = threading.Lock()
        self._render_lock = threading.Lock()
        self._cached_key: tuple[int, bool] | None = None
        self._cached = _Compressed((), 0)
        self._view = FleetView(sources={name: SourceHealth() for name in sources})
        self.views = self  # what the delivery workers report backlogs to (DeliveryMetrics)
        r = self.registry
        self.observed = Counter("azure_scheduled_events_observed_total", "Distinct events first seen.",
                                ["event_type", "event_source"], registry=r)
        self.ended = Counter("azure_scheduled_events_ended_total", "Events that ended, by outcome.",
                             ["event_type", "outcome"], registry=r)
        self.records = Counter("azure_scheduled_events_records_total", "Records delivered, by sink.", ["sink"],
                               registry=r)
        self.record_failures = Counter("azure_scheduled_events_record_failures_total",
                                       "Failed delivery attempts, by sink (each is retried).", ["sink"], registry=r)
        self.outbox_dropped = Counter("azure_scheduled_events_outbox_dropped_records_total",
                                      "Records dropped because the outbox was full.", registry=r)
        self.outbox_stored = Gauge("azure_scheduled_events_outbox_stored_records",
                                   "Records in the outbox, for every sink together (what counts against "
                                   "--outbox-max-records).", registry=r)
        self.outbox_capacity = Gauge("azure_scheduled_events_outbox_capacity_records",
                                     "The outbox's bound, --outbox-max-records.", registry=r)
        self.outbox_refused = Counter("azure_scheduled_events_outbox_refused_commits_total",
                                      "Commits the full outbox refused: the source keeps its news and brings it "
                                      "again once the sinks have taken records (nothing is dropped).", registry=r)
        self.store_errors = Counter("azure_scheduled_events_state_write_errors_total",
                                    "Failed writes of state or outbox.", registry=r)
        self.state_writable = Gauge("azure_scheduled_events_state_writable",
                                    "0 while the state dir cannot be written and the outbox is in memory.",
                                    registry=r)
        self.state_writable.set(1)
        self.source_errors = Counter("azure_scheduled_events_source_errors_total",
                                     "Failed reads of a source, by source.", ["source"], registry=r)
        # The families of a source or of the Lease exist only where it is configured (as those of a policy).
        queue = self._feature(r, "queue" in sources)
        self.queue_messages = Counter("azure_scheduled_events_queue_messages_total",
                                      "Queue messages, by what became of them: received, deleted, poisoned "
                                      "(moved to the poison queue), unreadable.", ["result"], registry=queue)
        self.duplicates = Counter("azure_scheduled_events_duplicates_total",
                                  "News dropped as a repeat: the same delivery, or nothing new.", registry=r)
        # Families of features that may be off, in their place but shown only once turned on (`policy_loaded`).
        self.approval_families = FeatureFamilies(r)
        self.approvals = Counter("azure_scheduled_events_approvals_total",
                                 "Approval decisions carried out through ARM's acknowledge call, by result.",
                                 ["event_type", "result"], registry=self.approval_families)
        self.hook_families = FeatureFamilies(r)
        self.hook_runs = Counter("azure_scheduled_events_hook_runs_total", "Prepare and recover hook runs by result.",
                                 ["hook", "result"], registry=self.hook_families)
        for hook in ("prepare", "recover"):
            for result in ("success", "failure", "timeout", "error"):
                self.hook_runs.labels(hook, result)
        self.nodes = NodeMetrics(r, fleet=True)
        self.vms_without_node = Counter("azure_scheduled_events_fleet_vms_without_node_total",
                                        "VMs of events with node actions that are no node of this cluster (left "
                                        "alone).", registry=self.nodes.families)
        self.undo_held = UndoHeld(self.nodes.families)
        self.lease_families = self._feature(r, False)  # turned on by `lease_in_use`
        self.handed_over = Counter("azure_scheduled_events_handover_skipped_total",
                                   "Changes not announced because the previous active replica had announced them "
                                   "(the Lease's handover).", registry=self.lease_families)
        self.feed_lag = Gauge("azure_scheduled_events_feed_lag_seconds",
                              "From the Event Grid event's time to forewarn reading it, for the last one read.",
                              registry=queue)
        self.push_requests = Counter("azure_scheduled_events_eventgrid_push_requests_total",
                                     "Event Grid push requests, by result: accepted (committed), validated (a "
                                     "handshake), unauthorized, invalid, failed (not committed: retried).",
                                     ["result"], registry=self._feature(r, "eventgrid" in sources))
        scoped = [name for name in SCOPED_SOURCES if name in sources]
        self.out_of_scope = Counter("azure_scheduled_events_out_of_scope_total",
                                    "Events from the queue or an Event Grid push outside this instance's scope "
                                    "(--subscription, --resource-group): not recorded, by source.", ["source"],
                                    registry=self._feature(r, bool(scoped)))
        for name in sources:
            self.source_errors.labels(name)
        for name in scoped:
            self.out_of_scope.labels(name)
        for event_type in EVENT_TYPES:
            for result in ("approved", "dry_run", "failed"):
                self.approvals.labels(event_type, result)
        for result in PUSH_RESULTS:
            self.push_requests.labels(result)
        for result in ("received", "deleted", "poisoned", "unreadable"):
            self.queue_messages.labels(result)
        r.register(_ViewCollector(self))
        r.register(CODECS)
        r.register(ProcessFamilies())

    @staticmethod
    def _feature(registry: Registry, on: bool) -> FeatureFamilies:
        families = FeatureFamilies(registry)
        if on:
            families.turn_on()
        return families

    # --- operations named for facts ----------------------------------------------------------------
    @property
    def view(self) -> FleetView:
        return self._view

    def events_now(self, events: Sequence[FleetEvent], now: float | None = None) -> None:
        """`events` are the open ones as of `now`: an event whose status is new to the metrics is in it
        since `now` (since the start, after a restart, as in the per-VM agent)."""
        now = time.time() if now is None else now
        with self._lock:
            before = self._view.status_since
            since = {}
            for fleet_event in events:
                key = event_key(fleet_event)
                status, at = before.get(key, ("", now))
                since[key] = (fleet_event.event.status, at if status == fleet_event.event.status else now)
            self._view = replace(self._view, events=tuple(events), events_version=self._view.events_version + 1,
                                 status_since=since)

    def source_succeeded(self, source: str, at: float) -> None:
        with self._lock:
            self._view = replace(self._view, sources={**self._view.sources, source: SourceHealth(True, at)})

    def source_failed(self, source: str) -> None:
        self.source_errors.labels(source).inc()
        with self._lock:
            last = self._view.sources.get(source, SourceHealth()).last_success
            self._view = replace(self._view, sources={**self._view.sources, source: SourceHealth(False, last)})

    def left_out_of_scope(self, source: str, count: int) -> None:
        self.out_of_scope.labels(source).inc(count)

    def reconciled(self, seconds: float, quota_remaining: float | None, commit_seconds: float | None = None) -> None:
        """A Resource Graph snapshot: `seconds` its read, `commit_seconds` the commit of what it brought."""
        with self._lock:
            self._view = replace(self._view, reconcile_seconds=seconds, quota_remaining=quota_remaining,
                                 commit_seconds=commit_seconds)

    def backlog(self, sink: str, backlog: Backlog) -> None:
        with self._lock:
            self._view = replace(self._view, backlogs={**self._view.backlogs, sink: backlog})

    def store_writable(self, writable: bool) -> None:
        self.state_writable.set(1 if writable else 0)

    def add_sink(self, name: str) -> None:
        self.records.labels(name)
        self.record_failures.labels(name)
        self.backlog(name, Backlog(records=0, oldest_created=None))

    def lease_in_use(self) -> None:
        """Replicas share a Lease (--lease-name): the handover's family shows."""
        self.lease_families.turn_on()

    def policy_loaded(self, hooks: bool, node_actions: bool) -> None:
        """A policy is in use: the approval (acknowledge) families show, and those of hooks and of node actions
        when it has any. Without --policy none of them is in /metrics."""
        self.approval_families.turn_on()
        if hooks:
            self.hook_families.turn_on()
        if node_actions:
            self.nodes.families.turn_on()

    def last_success(self) -> float | None:
        """The newest success of any source (readiness)."""
        times = [health.last_success for health in self._view.sources.values() if health.last_success]
        return max(times) if times else None

    def respond(self, request: Request) -> Response:
        """/metrics. The open events' families are kept compressed (see `_events_text`); a client that takes
        gzip (Prometheus always does) gets them as they are, followed by the live families as a second gzip
        member, and any other client gets them inflated on the way out, part after part."""
        openmetrics, content_type = negotiate(request.headers.get("Accept", ""))
        events, live = self._events_text(openmetrics), self._live_text(openmetrics)
        if takes_gzip(request.headers.get("Accept-Encoding", "")):
            deflate = zlib.compressobj(1, zlib.DEFLATED, _GZIP)
            return Response(200, (*events.parts, deflate.compress(live) + deflate.flush()), content_type,
                            {"Content-Encoding": "gzip", "Vary": "Accept-Encoding"})
        return Response(200, Stream(events.length + len(live), lambda: _inflate(events, live)), content_type,
                        {"Vary": "Accept-Encoding"})

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The whole exposition, uncompressed, for an Accept header (tests and tools; /metrics uses respond)."""
        openmetrics, content_type = negotiate(accept)
        return b"".join(_inflate(self._events_text(openmetrics), self._live_text(openmetrics))), content_type

    def _events_text(self, openmetrics: bool) -> _Compressed:
        """The open events' families, from a cache kept until they change. They are most of the exposition
        and most of its cost: 40,000 series for 2,000 events on 5 VMs each, 11 MB, about half a second to
        write. Kept as one gzip member (about a fiftieth of that: the lines differ in a few labels), written
        and compressed one 64 KiB part at a time, so the whole text is never in memory at once."""
        view = self._view
        with self._render_lock:
            if self._cached_key != (view.events_version, openmetrics):
                self._cached = _Compressed((), 0)  # not kept beside its successor while that is written
                families = _EventFamilies(view.events, {key: at for key, (_, at) in view.status_since.items()},
                                          self.max_vms)
                self._cached = _compress(_encode(families.collect(), openmetrics))
                self._cached_key = (view.events_version, openmetrics)
            return self._cached

    def _live_text(self, openmetrics: bool) -> bytes:
        out: list[str] = []
        self.registry.write(out, openmetrics)
        if openmetrics:
            out.append(EOF.decode())
        return "".join(out).encode()


#: zlib's window bits for a gzip member (16 + the largest window).
_GZIP = 31


@dataclass(frozen=True)
class _Compressed:
    parts: tuple[bytes, ...]  # one gzip member
    length: int               # its text's length, uncompressed


def takes_gzip(accept_encoding: str) -> bool:
    """Whether an Accept-Encoding header takes gzip (and does not refuse it with q=0)."""
    for offer in accept_encoding.split(","):
        coding, *params = (item.strip().lower() for item in offer.split(";"))
        if coding in ("gzip", "x-gzip"):
            return not any(param.replace(" ", "") in ("q=0", "q=0.0", "q=0.00", "q=0.000") for param in params)
    return False


def _encode(families: Iterator[Family], openmetrics: bool) -> Iterator[bytes]:
    """Families as UTF-8 parts, one family at a time, each let go once it is written."""
    for family in families:
        out: list[str] = []
        family.write(out, openmetrics)
        del family
        yield from encode(out)
        del out


def _compress(parts: Iterator[bytes]) -> _Compressed:
    deflate = zlib.compressobj(1, zlib.DEFLATED, _GZIP)
    compressed, length = [], 0
    for part in parts:
        length += len(part)
        if chunk := deflate.compress(part):
            compressed.append(chunk)
    compressed.append(deflate.flush())
    return _Compressed(tuple(compressed), length)


def _inflate(events: _Compressed, live: bytes) -> Iterator[bytes]:
    """The cached families uncompressed, at most 256 KiB at a time, then the live families."""
    inflate = zlib.decompressobj(_GZIP)
    for part in events.parts:
        data = part
        while data:
            if text := inflate.decompress(data, 1 << 18):
                yield text
            data = inflate.unconsumed_tail
    if rest := inflate.flush():
        yield rest
    yield live


class _EventFamilies:
    """The families of the open events, rendered once per change of the events (FleetMetrics.render): the
    per-VM agent's (forewarn.metrics.events) once per VM an event acts on, for at most `max_vms` VMs (0: all),
    and the aggregates, which count every open event and VM whatever the limit."""

    def __init__(self, events: Sequence[FleetEvent], status_since: Mapping[tuple[str, str], float],
                 max_vms: int = 0) -> None:
        self._events = events
        self._status_since = status_since
        self._max_vms = max_vms

    def collect(self) -> Iterator[Family]:
        by_scope: Tally[tuple[str, str, str, str]] = Tally()
        vms_by_place: Tally[tuple[str, str, str, str, str]] = Tally()
        shown = per_vm_shown(self._events, self._max_vms)
        rows = []
        left_out_events = left_out_vms = 0
        for fleet_event in self._events:
            event = fleet_event.event
            by_scope[(event.event_type, event.status, fleet_event.subscription_id, fleet_event.resource_group)] += 1
            vms = fleet_event.vms
            vms_by_place[(event.event_type, event.status, fleet_event.subscription_id, fleet_event.resource_group,
                          vms.scale_set)] += len(vms.names)
            if id(fleet_event) in shown:
                places = tuple((name, vms.scale_set, fleet_event.resource_group, fleet_event.subscription_id)
                               for name in vms.names)
            else:  # counted by the aggregates, no per-VM series
                places = ()
                left_out_events += 1
                left_out_vms += len(vms.names)
            rows.append(OpenEvent(event, True, self._status_since.get(event_key(fleet_event)), places))
        yield from event_families(rows, PLACE_LABELS)
        del rows
        scoped = Family("azure_scheduled_events_by_scope",
                        "Open events by type, status, subscription and resource group.",
                        labels=["event_type", "event_status", "subscription_id", "resource_group"])
        for scope_key, count in sorted(by_scope.items()):
            scoped.add(list(scope_key), count)
        yield scoped
        vms_family = Family("azure_scheduled_events_vms",
                            "VMs that open events act on (one per event and VM), by type, status, subscription, "
                            "resource group and scale set (\"\" for VMs outside one).",
                            labels=["event_type", "event_status", "subscription_id", "resource_group",
                                    "vm_scale_set"])
        for place_key, count in sorted(vms_by_place.items()):
            vms_family.add(list(place_key), count)
        yield vms_family
        left_out = Family("azure_scheduled_events_per_vm_left_out",
                          "Open events and their VMs whose per-VM series are left out of /metrics by "
                          "--metrics-max-vms (the aggregates count them), by unit: events, vms.", labels=["unit"])
        left_out.add(["events"], left_out_events)
        left_out.add(["vms"], left_out_vms)
        yield left_out


def per_vm_shown(events: Sequence[FleetEvent], max_vms: int) -> set[int]:
    """The events (their id()) whose per-VM series are shown: all when `max_vms` is 0 or their VMs fit, else, in
    the order an operator acts in (Started before Scheduled, then the earliest NotBefore, then EventId), each
    event whose VMs still fit within `max_vms`. An event is shown whole or not at all, and one too large for the
    room left is passed over, not the end: the smaller events after it are still shown."""
    if not max_vms or sum(len(event.vms.names) for event in events) <= max_vms:
        return {id(event) for event in events}
    ordered = sorted(events, key=lambda e: (-STATUS_RANK.get(e.status, 0),
                                            e.event.not_before.timestamp() if e.event.not_before else float("inf"),
                                            e.event_id.lower(), e.resource_id.lower()))
    shown, used = set(), 0
    for event in ordered:
        if used + len(event.vms.names) > max_vms:
            continue
        used += len(event.vms.names)
        shown.add(id(event))
    return shown


class _ViewCollector:
    """The families computed from the view at scrape time: health, delivery, the replica's role."""

    def __init__(self, metrics: FleetMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Family]:
        view = self._metrics.view
        up = Family("azure_scheduled_events_source_up", "1 if the source's last read succeeded.",
                    labels=["source"])
        last = Family("azure_scheduled_events_source_last_success_timestamp_seconds",
                      "Time of the source's last successful read.", labels=["source"])
        for name, health in sorted(view.sources.items()):
            up.add([name], 1 if health.up else 0)
            if health.last_success is not None:
                last.add([name], health.last_success)
        yield up
        yield last
        if view.quota_remaining is not None:
            yield Family("azure_scheduled_events_resourcegraph_quota_remaining",
                         "Resource Graph queries left in the current throttling window.",
                         value=view.quota_remaining)
        if view.reconcile_seconds is not None:
            yield Family("azure_scheduled_events_reconcile_duration_seconds",
                         "How long the last Resource Graph snapshot's read took (every page).",
                         value=view.reconcile_seconds)
        if view.commit_seconds is not None:
            yield Family("azure_scheduled_events_reconcile_commit_duration_seconds",
                         "How long the commit of the last Resource Graph snapshot took: the tracker, the records and "
                         "the outbox's transactions, after the read.", value=view.commit_seconds)
        waiting = Family("azure_scheduled_events_outbox_records", "Records waiting for the sink.",
                         labels=["sink"])
        oldest = Family("azure_scheduled_events_outbox_oldest_record_age_seconds",
                        "Age of the oldest waiting record, 0 if none.", labels=["sink"])
        now = time.time()
        for sink, backlog in sorted(view.backlogs.items()):
            waiting.add([sink], backlog.records)
            oldest.add([sink], max(0.0, now - backlog.oldest_created) if backlog.oldest_created else 0.0)
        yield waiting
        yield oldest
        yield Family("azure_scheduled_events_fleet_active", "1 on the replica that reads the sources "
                     "and publishes (the Lease holder), 0 on a standby.",
                     value=1 if self._metrics.active() else 0)
        build = Family("azure_scheduled_events_build_info", "forewarn's version (1); in fleet mode "
                       "api_version is Resource Graph's.", labels=["version", "api_version", "mode"])
        build.add([__version__, self._metrics.api_version, "fleet"], 1)
        yield build
