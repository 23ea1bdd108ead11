"""Prometheus exposition of forewarn's metrics, exactly as named in the public contract.

Counters and the request histogram are ordinary prometheus-client objects, updated where things
happen. Everything that describes the present is rendered at scrape time from the one immutable `View`
(see `forewarn.metrics.view`): `DocumentFamilies` for what changes with the document, `LiveFamilies` for
health and the values that depend on the scrape moment (only `seconds_to_not_before` does), and
`ProcessFamilies` (`forewarn.metrics.process`) for the process itself. A scrape therefore never waits for a
poll, does no I/O but read /proc/self (the kernel's memory, no disk), and always sees one consistent document.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from forewarn import DEFAULT_API_VERSION, __version__
from forewarn.backlog import Backlog
from forewarn.imds.document import EVENT_SOURCES, EVENT_TYPES, Document
from forewarn.metrics.codecs import CODECS
from forewarn.metrics.core import (
    EOF,
    Counter,
    Family,
    FeatureFamilies,
    Gauge,
    Header,
    Histogram,
    LabelSet,
    Registry,
    negotiate,
    number,
)
from forewarn.metrics.events import OpenEvent, event_families
from forewarn.metrics.process import ProcessFamilies
from forewarn.metrics.view import ViewHolder

OUTCOMES = ("completed", "cancelled")
APPROVAL_RESULTS = ("approved", "dry_run", "failed")
HOOK_RESULTS = ("success", "failure", "timeout", "error")
#: Kubernetes node actions (the policy's, and `undo` once the event has left) and their results.
NODE_ACTIONS = ("cordon", "taint", "label", "condition", "event", "drain", "undo", "out_of_service", "delete_node")
#: `skipped`: not done because the node's annotation forewarn.io/node-actions=disabled turns them off.
NODE_ACTION_RESULTS = ("ok", "failed", "dry_run", "skipped")
#: What became of the pods a drain removed: evicted (the Eviction API) or deleted at the deadline.
DRAIN_POD_OUTCOMES = ("evicted", "deleted")


class Metrics:
    """All forewarn metrics in one registry (never the global one, so tests can run many), and `views`,
    the holder of the View they are rendered from."""

    def __init__(self, api_version: str = DEFAULT_API_VERSION, clock: Callable[[], float] = time.time):
        self.registry = Registry()
        self.views = ViewHolder()
        r = self.registry
        self.observed = Counter(
            "azure_scheduled_events_observed_total", "Distinct scheduled events first seen.",
            ["event_type", "event_source"], registry=r)
        self.ended = Counter(
            "azure_scheduled_events_ended_total", "Scheduled events that left the document, by outcome.",
            ["event_type", "outcome"], registry=r)
        # Families of features that may be off, in their place but shown only once turned on (`policy_loaded`).
        self.approval_families = FeatureFamilies(r)
        self.approvals = Counter(
            "azure_scheduled_events_approvals_total", "Approval decisions carried out.",
            ["event_type", "result"], registry=self.approval_families)
        self.imds_requests = Counter(
            "azure_scheduled_events_imds_requests_total",
            "IMDS requests by method and HTTP status (code=error for transport failures).",
            ["method", "code"], registry=r)
        self.imds_duration = Histogram(
            "azure_scheduled_events_imds_request_duration_seconds", "IMDS request latency.", ["method"],
            registry=r, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120))
        self.document_errors = Counter(
            "azure_scheduled_events_document_errors_total",
            "IMDS replies that were not a valid Scheduled Events document.", registry=r)
        self.document_warnings = Counter(
            "azure_scheduled_events_document_warnings_total",
            "Event fields the tolerant parser could not read (the event was kept).", registry=r)
        self.records = Counter(
            "azure_scheduled_events_records_total", "Records delivered, by sink.", ["sink"], registry=r)
        self.record_failures = Counter(
            "azure_scheduled_events_record_failures_total", "Failed delivery attempts, by sink.", ["sink"],
            registry=r)
        self.outbox_dropped = Counter(
            "azure_scheduled_events_outbox_dropped_records_total",
            "Records dropped because the outbox was full (oldest first).", registry=r)
        self.outbox_stored = Gauge(
            "azure_scheduled_events_outbox_stored_records",
            "Records in the outbox, for every sink together (what counts against --outbox-max-records).", registry=r)
        self.outbox_capacity = Gauge(
            "azure_scheduled_events_outbox_capacity_records", "The outbox's bound, --outbox-max-records.", registry=r)
        self.store_errors = Counter(
            "azure_scheduled_events_state_write_errors_total",
            "Failed writes of state or outbox (disk full, read-only state dir).", registry=r)
        # As Prometheus's own prometheus_config_last_reload_successful: 1 while the policy in use is the file's.
        # Without --policy there is nothing to reload: neither is in /metrics (`policy_loaded`).
        self.policy_families = FeatureFamilies(r)
        self.policy_reload_ok = Gauge(
            "azure_scheduled_events_policy_last_reload_successful",
            "1 if the last load of --policy (at start or on SIGHUP) succeeded, 0 if the file was refused and the "
            "previous policy is still in use.", registry=self.policy_families)
        self.policy_reload_ok.set(1)
        self.policy_reload_time = Gauge(
            "azure_scheduled_events_policy_last_reload_success_timestamp_seconds",
            "Unix time of the last successful load of --policy.", registry=self.policy_families)
        self.hook_families = FeatureFamilies(r)
        self.hook_runs = Counter("azure_scheduled_events_hook_runs_total", "Prepare and recover hook runs by result.",
                                 ["hook", "result"], registry=self.hook_families)
        nodes = self.nodes = NodeMetrics(r)
        self.node_actions, self.node_drains = nodes.node_actions, nodes.node_drains
        self.node_drain_blocked_since, self.node_drain_pods = nodes.node_drain_blocked_since, nodes.node_drain_pods
        self.node_drain_records = nodes.node_drain_records
        for hook in ("prepare", "recover"):
            for result in HOOK_RESULTS:
                self.hook_runs.labels(hook, result)
        for event_type in EVENT_TYPES:
            for source in EVENT_SOURCES:
                self.observed.labels(event_type, source)
            for outcome in OUTCOMES:
                self.ended.labels(event_type, outcome)
            for result in APPROVAL_RESULTS:
                self.approvals.labels(event_type, result)
        r.register(LiveFamilies(self.views, api_version, clock))
        r.register(CODECS)
        r.register(ProcessFamilies())  # read at each scrape, with the live families: they are of that moment
        self._rendering = SharedRendering(self.views, r)

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The whole exposition for an Accept header, and its content type."""
        parts, content_type = self._rendering.render(accept)
        return b"".join(parts), content_type

    def render_parts(self, accept: str = "") -> tuple[tuple[bytes, ...], str]:
        """As `render`, the exposition in the parts it is made of: the web server writes them as they are,
        without joining them into one more copy."""
        return self._rendering.render(accept)

    @property
    def renders(self) -> int:
        """Renderings of the whole exposition so far (scrapes that shared one count once)."""
        return self._rendering.renders

    @property
    def document_renders(self) -> int:
        """Renderings of the document families so far (the others reuse the cached text)."""
        return self._rendering.document_renders

    def add_sink(self, name: str) -> None:
        """Make a sink's series visible at zero before its first delivery."""
        self.records.labels(name)
        self.record_failures.labels(name)
        self.views.backlog(name, Backlog(records=0, oldest_created=None))

    def policy_loaded(self, hooks: bool, node_actions: bool) -> None:
        """A policy is in use (at start or after SIGHUP): the approval families show from now on, and those of
        hooks and of node actions once a policy has any. Without --policy none of them is in /metrics."""
        self.approval_families.turn_on()
        self.policy_families.turn_on()
        if hooks:
            self.hook_families.turn_on()
        if node_actions:
            self.nodes.families.turn_on()



class NodeMetrics:
    """The families of Kubernetes node actions, the same in both modes (the per-VM agent acts on its own node,
    fleet mode on the nodes of the VMs its events hit); their help says which (`fleet`)."""

    def __init__(self, registry: Registry, fleet: bool = False) -> None:
        #: Shown once a policy with node actions is in use (`families.turn_on()`).
        self.families = registry = FeatureFamilies(registry)
        drains = "Drains of the nodes of the fleet's VMs in this cluster" if fleet else "Drains of this Kubernetes node"
        self.node_actions = Counter(
            "azure_scheduled_events_node_actions_total",
            "Kubernetes node actions carried out, by action and result.", ["action", "result"], registry=registry)
        self.node_drains = Gauge(
            "azure_scheduled_events_node_drains_in_progress",
            f"{drains} under way " + ("(a sum over those nodes)." if fleet else
                                      "(0 or 1; sum over a cluster for the nodes draining)."), registry=registry)
        self.node_drain_blocked_since = Gauge(
            "azure_scheduled_events_node_drain_blocked_since_timestamp_seconds",
            "Unix time since which " + ("the longest-blocked drain of a node" if fleet else "a drain of this node")
            + " has been blocked by a PodDisruptionBudget; 0 when none is.", registry=registry)
        self.node_drain_pods = Counter(
            "azure_scheduled_events_node_drain_pods_total",
            f"Pods removed by {drains[0].lower() + drains[1:]}: evicted (Eviction API) or deleted at the deadline "
            "(at_deadline: delete).", ["outcome"], registry=registry)
        for outcome in DRAIN_POD_OUTCOMES:
            self.node_drain_pods.labels(outcome)
        self.node_drain_records = Counter(
            "azure_scheduled_events_node_drain_reports_total",
            "Drain lifecycle records written, by phase (started, blocked, deleted, done, failed).", ["phase"],
            registry=registry)
        for phase in ("started", "blocked", "deleted", "done", "failed"):
            self.node_drain_records.labels(phase)
        for action in NODE_ACTIONS:
            for result in NODE_ACTION_RESULTS:
                self.node_actions.labels(action, result)


class SharedRendering:
    """Renders the exposition: the document families from a cache, then the `live` registry, fresh.

    Scrapes that arrive together share one rendering, as long as it began after they arrived (so every
    value is still computed at the scrape's own time): 50 scrapers in phase cost about two renderings,
    not fifty, and leave the poll thread its share of the interpreter."""

    def __init__(self, views: ViewHolder, live: Registry) -> None:
        self._views = views
        self._live = live
        self._documents = DocumentFamilies(views)
        self._cache_lock = threading.Lock()
        self._cache_key: tuple[Any, ...] = ()
        self._cache_text = b""
        self._flight = threading.Condition()
        self._in_flight: set[str] = set()                  # content types being rendered now
        self._done: dict[str, tuple[float, tuple[bytes, ...]]] = {}  # content type -> (start, body) of the last
        self.renders = 0
        self.document_renders = 0

    def render(self, accept: str = "") -> tuple[tuple[bytes, ...], str]:
        """The whole exposition for an Accept header, in parts, and its content type."""
        openmetrics, content_type = negotiate(accept)
        arrived = time.perf_counter()
        with self._flight:
            while True:
                done = self._done.get(content_type)
                if done is not None and done[0] > arrived:
                    return done[1], content_type
                if content_type not in self._in_flight:
                    break
                self._flight.wait()
            self._in_flight.add(content_type)
        body = None
        try:
            started = time.perf_counter()
            body = self._render(openmetrics)
            return body, content_type
        finally:
            with self._flight:
                self._in_flight.discard(content_type)
                if body is not None:
                    self._done[content_type] = (started, body)
                    self.renders += 1
                self._flight.notify_all()

    def _render(self, openmetrics: bool) -> tuple[bytes, ...]:
        """The document families from a text cache that is rebuilt only when the document, the VM or a
        status changes (the view keeps the same objects otherwise), then everything else, fresh."""
        view = self._views.view
        key = (openmetrics, view.document, view.vm, view.status_since)
        with self._cache_lock:
            if len(key) != len(self._cache_key) or any(
                    a is not b for a, b in zip(key, self._cache_key, strict=True)):
                out: list[str] = []
                for family in self._documents.collect():
                    family.write(out, openmetrics)
                self._cache_text = "".join(out).encode()
                self._cache_key = key
                self.document_renders += 1
            cached = self._cache_text
        out = []
        self._live.write(out, openmetrics)
        live = "".join(out).encode()
        return (cached, live, EOF) if openmetrics else (cached, live)


class DocumentFamilies:
    """The families that change only when the document, the VM or an event's status does: the open events'
    (forewarn.metrics.events, shared with fleet mode) and the VM's identity. Their text is rendered once per
    such change (see `SharedRendering`), not once per scrape."""

    def __init__(self, views: ViewHolder) -> None:
        self._views = views

    def collect(self) -> Iterator[Family]:
        view = self._views.view
        yield from event_families(
            OpenEvent(event, event.affects(view.vm.name), view.status_since.get(event.event_id))
            for event in (view.document.events if view.document else ()))
        vm = view.vm
        vm_info = Family("azure_scheduled_events_vm_info", "This VM's identity from instance metadata (1).",
                         labels=["vm_name", "vm_id", "vm_scale_set", "resource_group",
                                 "subscription_id", "location", "zone"])
        vm_info.add([vm.name, vm.vm_id, vm.vm_scale_set, vm.resource_group, vm.subscription_id,
                            vm.location, vm.zone], 1)
        yield vm_info


class LiveFamilies:
    """The families that depend on the scrape moment or on health, written at every scrape.

    A scrape writes their text directly: the headers and the series' names are made once (the countdown's
    once per document), and only the values are formatted then."""

    _COUNTDOWN = Header("azure_scheduled_event_seconds_to_not_before",
                        "Seconds from now until NotBefore (negative once passed).")
    _INCARNATION = Header("azure_scheduled_events_document_incarnation", "Last DocumentIncarnation seen.")
    _IMDS_UP = Header("azure_scheduled_events_imds_up", "1 if the last IMDS poll succeeded, else 0.")
    _LAST_SUCCESS = Header("azure_scheduled_events_imds_last_success_timestamp_seconds",
                           "Unix time of the last successful poll.")
    _OUTBOX = Header("azure_scheduled_events_outbox_records", "Records waiting for delivery, by sink.")
    _OLDEST = Header("azure_scheduled_events_outbox_oldest_record_age_seconds",
                     "Age of the oldest record waiting for the sink (0 when none).")
    _WRITABLE = Header("azure_scheduled_events_state_writable",
                       "1 if the state dir accepts writes, 0 while records are held in memory.")
    _BUILD = Header("azure_scheduled_events_build_info", "forewarn build (1).")
    _COUNTDOWN_LABELS = LabelSet(["event_id", "event_type"])
    _SINK_LABEL = LabelSet(["sink"])

    def __init__(self, views: ViewHolder, api_version: str, clock: Callable[[], float]) -> None:
        self._views = views
        self._clock = clock
        #: The countdown's series (text up to the value, NotBefore) for the document they were written for,
        #: and NotBefore in whole seconds when every one is (as IMDS writes it): only the values change from
        #: one scrape to the next.
        self._countdown: tuple[Document | None, tuple[tuple[str, float], ...], tuple[tuple[str, int], ...] | None] \
            = (None, (), None)
        self._sinks: dict[str, tuple[str, str]] = {}  # sink -> its series of the two outbox families
        build = self._BUILD.name + LabelSet(["version", "api_version"]).text([__version__, api_version])
        self._build_sample = f"{build} {number(1)}\n"

    def collect(self) -> Iterator[LiveFamilies]:
        yield self

    def write(self, out: list[str], openmetrics: bool) -> None:
        view = self._views.view
        now = self._clock()
        document, series, seconds = self._countdown
        if document is not view.document:
            name = self._COUNTDOWN.name
            series = tuple((f"{name}{self._COUNTDOWN_LABELS.text([event.event_id, event.event_type])} ",
                            event.not_before.timestamp())
                           for event in (view.document.events if view.document else ())
                           if event.not_before is not None)
            seconds = tuple((text, int(at)) for text, at in series) if all(
                at.is_integer() for _, at in series) else None
            self._countdown = (view.document, series, seconds)
        out.append(self._COUNTDOWN.text(openmetrics))
        # To the millisecond: it is written at every scrape, and more digits would tell nothing. Always finite:
        # NotBefore is a datetime's timestamp and the clock a Unix time.
        if seconds is None:
            out.extend([f"{text}{not_before - now:.3f}\n" for text, not_before in series])
        else:
            # Whole seconds from NotBefore and the same milliseconds for all: the fraction is formatted once,
            # and each series writes an integer (a float's formatting was 40% of a 100-event render).
            whole, ms = divmod(round(now * 1000), 1000)
            ahead, behind, borrow = f".{(1000 - ms) % 1000:03d}\n", f".{ms:03d}\n", 1 if ms else 0
            out.extend([f"{text}{at - whole - borrow}{ahead}" if at > whole or not ms else
                        f"{text}-{whole - at}{behind}" for text, at in seconds])
        out.append(self._INCARNATION.text(openmetrics))
        if view.document is not None:
            out.append(f"{self._INCARNATION.name} {number(view.document.incarnation)}\n")
        out.append(self._IMDS_UP.text(openmetrics))
        out.append(f"{self._IMDS_UP.name} {number(1 if view.imds_up else 0)}\n")
        out.append(self._LAST_SUCCESS.text(openmetrics))
        if view.last_success is not None:
            out.append(f"{self._LAST_SUCCESS.name} {number(view.last_success)}\n")
        records: list[str] = [self._OUTBOX.text(openmetrics)]
        ages: list[str] = [self._OLDEST.text(openmetrics)]
        for sink, backlog in sorted(view.backlogs.items()):
            names = self._sinks.get(sink)
            if names is None:
                labels = self._SINK_LABEL.text([sink])
                names = self._sinks[sink] = (f"{self._OUTBOX.name}{labels} ", f"{self._OLDEST.name}{labels} ")
            records.append(f"{names[0]}{number(backlog.records)}\n")
            age = now - backlog.oldest_created if backlog.oldest_created is not None else 0.0
            ages.append(f"{names[1]}{number(max(age, 0.0))}\n")
        out.extend(records)
        out.extend(ages)
        out.append(self._WRITABLE.text(openmetrics))
        out.append(f"{self._WRITABLE.name} {number(1 if view.store_writable else 0)}\n")
        out.append(self._BUILD.text(openmetrics))
        out.append(self._build_sample)
