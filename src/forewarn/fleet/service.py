"""`forewarn fleet`: the central service. Build the parts from FleetSettings, run the sources, stop cleanly.

    Resource Graph snapshot (every --reconcile-interval) --\\
                                                           +-> FleetTracker -> records -> Outbox.append(records,
    Storage queue (Event Grid deliveries) ----------------/         state={"fleet": tracker}) -> sinks
                                                                   -> FleetMetrics (the scrape's view)

Each source runs on a thread of its own and hands its news to `FleetCommitter`, which applies it to the
tracker and commits the changes' records together with the tracker's state in one outbox transaction. Only
then does the queue source delete the message: a SIGKILL at any point loses no message and, thanks to the
saved state and the records' content-derived ids, reports no change twice.

Event Grid pushes (`--eventgrid-path`, `add_push`) are a third source into the same committer. With
`--lease-name` one replica is active (forewarn.fleet.lease): only the holder reads and commits, and it writes
into the Lease what surely went out and what it approved, so a successor announces neither again and never
acknowledges an event twice; without it, run one replica.
With `--policy`, the active replica approves events through ARM and runs the policy's node actions
(`FleetApprover`, `FleetNodes`), only for events within its scope and under an owner made of its scope and
its Lease (docs/fleet.md).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forewarn import __version__
from forewarn.config import FLEET_OPTIONS, ConfigError, FleetSettings, redact_url
from forewarn.fleet import handover
from forewarn.fleet.feed import FeedError, FleetEvent, parse_resource_graph_row
from forewarn.fleet.metrics import FleetMetrics
from forewarn.fleet.records import change_texts
from forewarn.fleet.scope import FleetScope, ScopeGate
from forewarn.fleet.state import PREFIX, StateError, changed_state, load
from forewarn.fleet.tracker import FleetChange, FleetTracker, FleetView, event_key
from forewarn.logs import StateLog
from forewarn.outbox.delivery import DeliveryWorker, finish_delivery
from forewarn.outbox.outbox import Outbox, OutboxFull, Overflow, StoreError
from forewarn.owner import Owner
from forewarn.poller import DeliveryMetrics, OutboxMetrics
from forewarn.records import JsonRecords, Record
from forewarn.signals import handle_signals, ignore_stop_signals
from forewarn.sinks import build_sinks
from forewarn.sources import STOP_WAIT, Source, Term
from forewarn.tracker import ChangeKind
from forewarn.web.endpoints import add_metrics_endpoints, readiness_check
from forewarn.web.server import HttpServer
from forewarn.web.setup import web_gate, web_server

if TYPE_CHECKING:
    from forewarn.approval.policy import Policy
    from forewarn.fleet.approval import FleetApprover
    from forewarn.simulator.fleet import FleetSimulation

log = logging.getLogger(__name__)



#: Changes committed in one transaction at most (a first snapshot of a large fleet is thousands). Each slice's
#: records and their JSON are built at once, and CPython keeps the memory they took after they are freed:
#: 100 changes on scale sets of 5 VMs are 500 records, and the first snapshot of 2,000 such events grows the
#: service by 4 MiB instead of 13 MiB with slices of 500 (bench/fleet.py; the runs are in the git history of
#: docs/performance.md).
COMMIT_SLICE = 100
#: Records per delivery batch: one read of the outbox, one send and one acknowledgement each. While a snapshot
#: commits, each acknowledgement waits for a slice's transaction to end, so delivery takes one batch per slice:
#: with batches smaller than a slice's records (100 changes of 5 VMs, 500) it fell behind and delivered 80% of a
#: first snapshot of 100,000 VMs after the commit, about 1 s more (bench/fleet.py --vms). 500 keeps up, for 1 MiB
#: more resident than 100 with the file sink (docs/performance.md, "Fleet mode at 10,000, ... VMs").
DELIVERY_BATCH = 500


class NotActive(Exception):
    """This replica does not hold the Lease: it commits nothing (a queue message stays for the active one)."""


class FleetCommitter:
    """The one writer of the tracker and the saved state: news in, records and state out, atomically.
    `active()` is asked under the lock before every commit: a source thread that outlived its replica's
    term (a snapshot under way when the Lease was lost) commits nothing."""

    def __init__(self, outbox: Outbox, metrics: FleetMetrics, clock: Callable[[], float] = time.time,
                 active: Callable[[], bool] = lambda: True) -> None:
        self.outbox = outbox
        self.metrics = metrics
        self.clock = clock
        self.active = active
        self._lock = threading.Lock()
        #: Digests of what the previous Lease holder announced (forewarn.fleet.handover), not announced again.
        self._inherited: set[bytes] = set()
        #: Complete snapshots committed in this term (each started after the term began): after one, the open
        #: events are all known; an event missing from two of them is over (FleetView).
        self.complete_snapshots = 0
        self._term_started = float("-inf")
        #: Whether Resource Graph is a source (set by run_fleet): then nothing is done to nodes before the term's
        #: first complete snapshot.
        self.snapshots_expected = False
        #: Called with the changes that ended events, after each commit (the approver undoes their node actions).
        self.on_ended: Callable[[list[FleetChange]], None] = lambda changes: None
        #: Called after each commit that changed something (the approver looks at once).
        self.on_committed: Callable[[], None] = lambda: None
        #: Why the tracker could not be read back after a commit failed (None: it was): until it can, the tracker
        #: in memory holds news that is not committed, so nothing is committed and no action is taken (FleetView).
        self.reload_failed: str | None = None
        self.tracker = self._restore()
        metrics.events_now(self.tracker.open_events, self.clock())

    def _restore(self) -> FleetTracker:
        """The tracker as last committed, at start."""
        try:
            rows = self.outbox.load_states(PREFIX)
        except StoreError as exc:
            log.error("cannot read the saved fleet state (%s); starting without it", exc)
            return FleetTracker()
        tracker = load(rows, now=self.clock())
        if rows:
            log.info("resuming from saved state: %d open event(s), %d ended remembered",
                     len(tracker.open_events), len(tracker.ended_keys))
        return tracker

    def _reload(self) -> bool:
        """After a commit that failed: back to the tracker as last committed, so the same news, brought again, is a
        change again. The term's complete snapshots start again with it: the reloaded tracker has lost its counts of
        missing snapshots, and an event it lacks must not look over (FleetView.over) before two complete snapshots
        taken from now lack it too. A state that cannot be read (the store fails, or a row is damaged: leaving the
        row out would make its event look over) keeps the tracker in memory and holds every action; each commit
        tries again first. Returns whether the reload succeeded."""
        now = self.clock()
        self.complete_snapshots = 0
        self._term_started = now
        try:
            tracker = load(self.outbox.load_states(PREFIX), now=now, strict=True)
        except (StoreError, StateError) as exc:
            if self.reload_failed is None:
                log.error("cannot read the saved fleet state back after a failed commit (%s): nothing is committed "
                          "and no approval, node action or undo is taken until it can be read", exc)
            self.reload_failed = str(exc) or type(exc).__name__
            return False
        if self.reload_failed is not None:
            log.info("the saved fleet state is read again: commits and actions resume")
        self.tracker, self.reload_failed = tracker, None
        return True

    def _check_state(self) -> None:
        """StoreError while the tracker could not be read back (then nothing is applied to it), after trying again."""
        if self.reload_failed is not None and not self._reload():
            raise StoreError(f"the saved fleet state cannot be read ({self.reload_failed}); nothing is committed "
                             "until it can")

    def view(self) -> FleetView:
        """The open events, the term's complete snapshots and the tracker's memory of endings, at one moment
        (the approver reads this once per step)."""
        with self._lock:
            tracker = self.tracker
            return FleetView(tuple(tracker.open_events), self.complete_snapshots, self.snapshots_expected,
                             tracker.has_ended, tracker.was_listed, held=self.reload_failed)

    def known(self, event: FleetEvent) -> FleetEvent:
        """The tracker's own object for an open event equal to `event`, else `event`. A snapshot lists mostly what
        the tracker holds already: with this, it keeps one page of new objects at a time instead of a second copy of
        the fleet (about 25 MiB at 20,000 events). Read without the lock: equal events stand for each other, so an
        answer that is a moment old is as good."""
        held = self.tracker.open_event(event_key(event))
        return held if held is not None and held == event else event

    def news(self, events: Sequence[FleetEvent]) -> list[FleetChange]:
        """Events from a push or a queue message; returns once their changes are committed (or raises)."""
        with self._lock:
            if not self.active():
                raise NotActive("this replica does not hold the Lease")
            self._check_state()
            self._check_room()
            now = self.clock()
            changes: list[FleetChange] = []
            repeats = 0
            for event in events:
                found = self.tracker.apply(event, now)
                repeats += not found
                changes += found
            self._commit(changes, now)
            if repeats:  # counted once committed: a delivery the outbox refused comes again and is counted then
                self.metrics.duplicates.inc(repeats)
            return changes

    def snapshot(self, events: Sequence[FleetEvent], started_at: float, complete: bool) -> list[FleetChange]:
        with self._lock:
            if not self.active():
                raise NotActive("this replica does not hold the Lease")
            self._check_state()
            self._check_room()
            now = self.clock()
            changes = self.tracker.apply_snapshot(events, started_at, now, complete)
            self._commit(changes, now)
            if complete:  # what the predecessor announced and is not open now has ended: no longer needed
                self._inherited.clear()
                # A snapshot read before this term began (a source thread of an earlier term) is not counted:
                # "missing from two complete snapshots" must mean two views taken while this replica acted.
                self.complete_snapshots += started_at >= self._term_started
            return changes

    def _check_room(self) -> None:
        """OutboxFull at once while the outbox is full: news applied to the tracker only to be refused by the
        outbox would cost a reload of the saved state to undo (docs/fleet.md, "A full outbox")."""
        self.outbox.refuse_if_full()

    # --- the Lease's handover (forewarn.fleet.handover) ---------------------------------------------------
    def inherit(self, annotation: str | None) -> None:
        """At the start of a term: what the previous holder announced, from the Lease it left."""
        inherited = handover.decode(annotation)
        with self._lock:
            self._inherited = set(inherited)
            self.complete_snapshots = 0
            self._term_started = self.clock()
        if inherited:
            log.info("the previous active replica announced %d open event(s); their news is not announced again",
                     len(inherited))

    def handover(self) -> str | None:
        """What this replica has announced, for the Lease; None (leave it as it is) while a sink still has
        records to deliver, since those die with this replica's outbox and must be announced again."""
        if any(self.outbox.backlog(sink).records for sink in self.outbox.sinks):
            return None
        with self._lock:
            digests = {handover.digest(event) for event in self.tracker.open_events} | self._inherited
        return handover.encode(digests)

    def _announced_before(self, change: FleetChange) -> bool:
        return change.kind is not ChangeKind.REMOVED and handover.digest(change.event) in self._inherited

    def _commit(self, changes: Sequence[FleetChange], now: float) -> None:
        if not changes:
            if self.tracker.listing_unsaved:   # a snapshot listed an event it changed nothing of: saved all the same
                try:
                    self.outbox.append([], state=changed_state((), self.tracker))
                except Exception:
                    self._reload()
                    raise
            return
        observed_at = datetime.fromtimestamp(now, tz=timezone.utc)
        # A large snapshot goes in slices, each with its own records and rows: the memory of one slice at a
        # time, and a stop between two slices leaves a consistent state (what was not committed is news again).
        for start in range(0, len(changes), COMMIT_SLICE):
            part = changes[start:start + COMMIT_SLICE]
            known = [change for change in part if self._inherited and self._announced_before(change)]
            skip = {id(change) for change in known}
            records = JsonRecords([text for change in part if id(change) not in skip
                                   for text in change_texts(change, observed_at)])
            try:
                self.outbox.append(records, state=changed_state(part, self.tracker))
            except Exception:
                # Not committed (a full outbox refused it, or the disk failed): back to the committed state, so
                # the same news, delivered again (the queue message was not deleted, the next snapshot lists it),
                # is a change again and is not lost. The slices before this one stand: their listeners, log
                # lines and counts are due all the same (an ended event's node actions are undone).
                self._reload()
                self._committed(changes[:start], self.clock())
                raise
            if known:
                self._inherited.difference_update(handover.digest(change.event) for change in known)
                self.metrics.handed_over.inc(len(known))
        self._committed(changes, now)

    def _committed(self, changes: Sequence[FleetChange], now: float) -> None:
        """What follows the commit of `changes`: the listeners, a log line and the counts of each, the gauges."""
        ended = [change for change in changes if change.kind is ChangeKind.REMOVED]
        try:   # the listeners' troubles are theirs: the commit stands
            if ended:
                self.on_ended(ended)
            self.on_committed()
        except Exception:
            log.exception("a listener of the fleet's commits failed")
        for change in changes:
            event = change.event.event
            log.info("event %s on %s %s: %s %s (NotBefore %s, resources %s)", event.event_id,
                     change.event.resource_id, change.kind, event.event_type, event.status,
                     event.raw.get("NotBefore") or "-", ",".join(event.resources) or "-")
            if change.kind is ChangeKind.ADDED:
                self.metrics.observed.labels(event.event_type, event.source or "").inc()
            elif change.kind is ChangeKind.REMOVED:
                self.metrics.ended.labels(event.event_type, str(change.outcome)).inc()
        self.metrics.events_now(self.tracker.open_events, now)


@dataclass
class ResourceGraphSource:
    """Snapshots of the open events, every `interval` seconds, reconciled into the tracker (a Source)."""

    name = "resourcegraph"

    client: Any  # ResourceGraphClient (imported only when configured)
    subscriptions: Sequence[str]
    management_groups: Sequence[str]
    interval: float
    committer: FleetCommitter
    metrics: FleetMetrics
    #: Only these resource groups' events (all when empty): the query filters them, so no row of another
    #: one is read, and a complete snapshot ends what left them as it ends what ended.
    resource_groups: Sequence[str] = ()

    def run(self, stop: threading.Event) -> None:
        from forewarn.fleet.resourcegraph import ResourceGraphError, Stopped, scheduled_events_query

        query = scheduled_events_query(resource_groups=self.resource_groups)

        state = StateLog(log, "Resource Graph")
        unreadable: set[str] = set()

        def event_of(row: dict[str, Any]) -> FleetEvent | None:
            """A row as its event as soon as its page is read (the page is dropped before the next one)."""
            try:
                return self.committer.known(parse_resource_graph_row(row))
            except FeedError as exc:
                reason = str(exc)[:200]
                if reason not in unreadable and len(unreadable) < 1000:
                    unreadable.add(reason)
                    log.warning("Resource Graph row skipped: %s", reason)
                return None

        while not stop.is_set():
            started = time.time()
            try:
                if self.subscriptions:
                    snapshot = self.client.snapshot(subscriptions=list(self.subscriptions), query=query,
                                                    convert=event_of)
                else:
                    snapshot = self.client.snapshot(management_groups=list(self.management_groups), query=query,
                                                    convert=event_of)
            except Stopped:
                return
            except ResourceGraphError as exc:
                self.metrics.source_failed("resourcegraph")
                state.failing(str(exc.status or "error"), f"{exc}; keeping the last known events")
                stop.wait(self.interval)
                continue
            events: list[FleetEvent] = list(snapshot.rows)
            complete = not snapshot.warnings and snapshot.left_out == 0
            for warning in snapshot.warnings:
                log.warning("Resource Graph: %s (no event is ended from this snapshot)", warning)
            seconds, quota_remaining = snapshot.seconds, snapshot.quota_remaining
            del snapshot
            committing = time.monotonic()
            try:
                self.committer.snapshot(events, started, complete)
            except NotActive:
                return
            except OutboxFull as exc:
                # What fitted is committed; the rest is news again in the next snapshot, taken once the sinks
                # have made room for it. Not counted complete, so no event is ended by its absence from it.
                # Resource Graph itself answered: the source stays up (and /readyz ready); the alert on the
                # outbox tells the operator. The commit is timed all the same: the slices that went in are
                # the costliest commits there are.
                del events
                state.ok()
                self.metrics.source_succeeded("resourcegraph", time.time())
                self.metrics.reconciled(seconds, quota_remaining, time.monotonic() - committing)
                wait_for_room(self.committer.outbox, exc, stop, "the rest of this Resource Graph snapshot",
                              lambda: self.metrics.source_succeeded("resourcegraph", time.time()))
                continue
            except Exception:
                log.exception("cannot commit a Resource Graph snapshot; the next one tries again")
                self.metrics.source_failed("resourcegraph")
                del events
                stop.wait(self.interval)
                continue
            # Until the next snapshot, the tracker holds the events it needs; not this list of all of them.
            del events
            state.ok()
            self.metrics.source_succeeded("resourcegraph", time.time())
            self.metrics.reconciled(seconds, quota_remaining, time.monotonic() - committing)
            stop.wait(self.interval)


@dataclass
class QueueReader:
    """Event Grid deliveries from a Storage queue: committed first, deleted after (a Source)."""

    name = "queue"

    source: Any  # QueueSource (imported only when configured)
    committer: FleetCommitter
    metrics: FleetMetrics
    gate: ScopeGate
    #: The refusal of a full outbox, until there is room again (no message is received meanwhile).
    full: OutboxFull | None = None

    def _commit_then_delete(self, deliveries: Sequence[Any]) -> None:
        """The events of one receive committed in one transaction, then each message deleted: a message
        leaves the queue only once its change is on disk, and a receive of 32 costs one commit, not 32.
        Events outside the scope are left out, and a message of only such events is deleted all the same:
        it was never this instance's (instances with other scopes read queues of their own)."""
        now = time.time()
        events = [event for delivery in deliveries for event in delivery.events]
        try:
            # Even with nothing left to commit: a standby's news() refuses, and the messages stay for the holder.
            self.gate.admit(events, "queue", self.committer.news)
        except NotActive:
            return  # the term is over: the messages come back to the active replica
        except OutboxFull as exc:
            # Back in the queue after their visibility timeout; no more are received until there is room.
            self.full = exc
            return
        except Exception:
            log.exception("cannot commit %d queue message(s); they stay in the queue", len(deliveries))
            return
        self.source.delete_all(deliveries)
        times = [event.event_time.timestamp() for event in events if event.event_time is not None]
        if times:
            self.metrics.feed_lag.set(max(0.0, now - max(times)))

    def run(self, stop: threading.Event) -> None:
        counted = {"received": 0, "deleted": 0, "poisoned": 0, "unreadable": 0}
        while not stop.is_set():
            deliveries = self.source.poll(stop)
            if deliveries and not stop.is_set():
                self._commit_then_delete(deliveries)
            if self.full is not None:
                # The queue answered: the source is up while it waits (/readyz), as the snapshot's is.
                wait_for_room(self.committer.outbox, self.full, stop, f"{len(deliveries)} queue message(s)",
                              lambda: self.metrics.source_succeeded("queue", time.time()))
                self.full = None
            stats = self.source.stats
            for result, total in (("received", stats.received), ("deleted", stats.deleted),
                                  ("poisoned", stats.poisoned), ("unreadable", stats.parse_failures)):
                if total > counted[result]:
                    self.metrics.queue_messages.labels(result).inc(total - counted[result])
                    counted[result] = total
            if stats.state == "ok" and stats.last_success is not None:
                self.metrics.source_succeeded("queue", stats.last_success)
            elif stats.state == "unavailable":
                self.metrics.source_failed("queue")


def wait_for_room(outbox: Outbox, refused: OutboxFull, stop: threading.Event, what: str,
                  alive: Callable[[], None] = lambda: None) -> None:
    """Back-pressure on a source whose commit the full outbox refused: wait, reading nothing new, until the
    refused commit fits and half the outbox is free (so the next attempt takes more than one slice), or stop.
    `alive` is called every second meanwhile: the source is waiting, not failing, and /readyz must say so
    however long the sinks take (--ready-window)."""
    room = max(0, min(outbox.max_records // 2, outbox.max_records - refused.adding))
    log.warning("outbox full (%d of %d records): %s not committed; waiting for the sinks to take records "
                "(nothing is dropped)", refused.stored, outbox.max_records, what)
    started = time.monotonic()
    while not stop.is_set():
        alive()
        if outbox.wait_for_room(room, timeout=1.0):
            log.info("outbox has room again after %.0f s", time.monotonic() - started)
            return


def run_fleet(settings: FleetSettings) -> int:
    """`forewarn fleet`: build everything, run the sources until SIGTERM/SIGINT, return the exit code. With
    --simulate, against the simulated fleet (forewarn.simulator.fleet) over the same clients and routes."""
    if not settings.simulate:
        return _run_fleet(settings, None)
    from forewarn.simulator.fleet import start_fleet_simulation

    settings, simulation = start_fleet_simulation(settings)
    try:
        return _run_fleet(settings, simulation)
    finally:
        simulation.stop()


def _run_fleet(settings: FleetSettings, simulation: FleetSimulation | None) -> int:
    if not (settings.subscription or settings.management_group or settings.queue_url or settings.eventgrid_path):
        raise ConfigError("forewarn fleet needs a source: --subscription or --management-group (Resource "
                          "Graph), and/or --queue-url (Event Grid through a Storage queue), and/or "
                          "--eventgrid-path (Event Grid push)")
    if settings.eventgrid_path and not settings.eventgrid_secret:
        raise ConfigError("--eventgrid-path needs a shared secret: set FOREWARN_EVENTGRID_SECRET or "
                          "--eventgrid-secret-file (make one with: openssl rand -hex 32)")
    if settings.subscription and settings.management_group:
        raise ConfigError("--subscription and --management-group: give one scope or the other")
    # --resource-group narrows whichever scope there is: alone (queue and push only), it means those
    # resource groups in every subscription the queue or push brings.
    scope = fleet_scope(settings)
    policy = load_fleet_policy(settings)
    if simulation is not None and policy is not None and policy.uses_node_actions:
        raise ConfigError(f"--policy {settings.policy}: its node actions need a Kubernetes cluster, which --simulate "
                          "does not play; try the simulator with a policy without `node` actions")
    stop = threading.Event()
    handle_signals(stop)
    log.info("forewarn %s fleet starting with %s", __version__, json.dumps(
        {k: v for k, v in settings.redacted(FLEET_OPTIONS).items() if k in {o.dest for o in FLEET_OPTIONS}},
        sort_keys=True))
    sources = (["resourcegraph"] if settings.subscription or settings.management_group else []) + \
        (["queue"] if settings.queue_url else []) + (["eventgrid"] if settings.eventgrid_path else [])
    metrics = FleetMetrics(sources, api_version=settings.resource_graph_api_version,
                           max_vms=settings.metrics_max_vms)
    gate = ScopeGate(scope, metrics.left_out_of_scope)
    sinks = build_sinks(settings.sink, settings)
    server = web_server(settings, web_gate(settings))
    elector = build_elector(settings)
    if elector is not None:
        metrics.lease_in_use()
    metrics.active = (lambda: elector.is_leader) if elector is not None else (lambda: True)
    sources_ready = readiness_check(metrics.last_success, settings.ready_window, what="read of a source")

    def ready() -> tuple[bool, str]:
        """A standby is ready (it serves its metrics, and rollouts must not wait for it to lead)."""
        if elector is not None and not elector.is_leader:
            return True, "standby: another replica holds the Lease"
        return sources_ready()

    add_metrics_endpoints(server, metrics.respond, ready)
    state_dir = Path(settings.state_dir) if settings.state_dir else None
    outbox = Outbox(state_dir, [sink.name for sink in sinks], settings.outbox_max_records,
                    OutboxMetrics(metrics, metrics.outbox_refused), overflow=fleet_overflow(policy))
    workers = [DeliveryWorker(sink, outbox, DeliveryMetrics(metrics), batch_size=DELIVERY_BATCH) for sink in sinks]
    for sink in sinks:
        metrics.add_sink(sink.name)
    committer = FleetCommitter(outbox, metrics, active=metrics.active)
    committer.snapshots_expected = "resourcegraph" in sources
    runners: list[Source] = []
    closers: list[Callable[[], None]] = []
    if "resourcegraph" in sources:
        client = build_resource_graph(settings, stop, simulation)
        closers.append(client.close)
        runners.append(ResourceGraphSource(client, settings.subscription, settings.management_group,
                                           settings.reconcile_interval, committer, metrics, scope.resource_groups))
    if "queue" in sources:
        queue = build_queue(settings)
        closers.append(queue.close)
        runners.append(QueueReader(queue, committer, metrics, gate))
    if "eventgrid" in sources:
        add_push(settings, server, committer, metrics, gate, plain_ok=simulation is not None)
    approver: FleetApprover | None = None
    if policy is not None:
        from forewarn.fleet.approval import FleetApprover

        acknowledger = build_acknowledger(settings, stop, simulation)
        closers.append(acknowledger.close)

        def record(records: Sequence[Record]) -> None:
            """Records of decisions and node actions already taken: never refused, never pushing others out."""
            committer.outbox.append(records, overflow="exceed")

        owner = fleet_owner(settings, elector)
        approver = FleetApprover(policy, acknowledger, committer.view, record, metrics.approvals,
                                 dry_run=settings.dry_run, active=committer.active,
                                 nodes=build_fleet_nodes(settings, record, metrics, owner) if policy.uses_node_actions
                                 else None, hook_runs=metrics.hook_runs, scope=scope,
                                 held=metrics.undo_held)
        metrics.policy_loaded(hooks=policy.uses_hooks, node_actions=policy.uses_node_actions)
        committer.on_ended, committer.on_committed = approver.ended, approver.wake
        runners.append(approver)

    server.start()
    if simulation is not None:   # Event Grid's deliveries, once the route listens
        assert settings.eventgrid_path is not None and settings.eventgrid_secret is not None
        simulation.push_to(server.url + settings.eventgrid_path, settings.eventgrid_secret)
    for worker in workers:
        worker.start()
    term = Term(runners)
    log.info("forewarn %s fleet: sources %s; metrics on %s/metrics; sinks: %s%s", __version__, ", ".join(sources),
             server.url, ", ".join(s.name for s in sinks) or "none (metrics only)",
             f"; Lease {settings.lease_name} as {elector.identity}" if elector is not None else "")
    lease_thread = None
    if elector is not None:
        def handover_notes() -> dict[str, str]:
            """What this term announced (not while a sink has a backlog: those records must be announced again)
            and approved or is about to (always: an acknowledgement must never be sent twice), for the Lease."""
            notes = {}
            announced = committer.handover()
            if announced is not None:
                notes[handover.ANNOTATION] = announced
            if approver is not None:
                notes[handover.APPROVED_ANNOTATION] = approver.handover()
            return notes

        def begin_term() -> None:
            committer.inherit(elector.inherited.get(handover.ANNOTATION))
            if approver is not None:
                approver.inherit(elector.inherited.get(handover.APPROVED_ANNOTATION))
            term.start()

        elector.handover = handover_notes
        if approver is not None:
            approver.publish = elector.publish

        lease_thread = threading.Thread(target=elector.run, args=(stop, begin_term, term.stop), name="fleet-lease",
                                        daemon=True)
        lease_thread.start()
    else:
        term.start()
    try:
        stop.wait()
    finally:
        stop.set()
        if lease_thread is not None:  # it ends the term and releases the Lease, so a successor starts at once
            lease_thread.join(STOP_WAIT + settings.lease_seconds / 3 + 1)
        term.stop()
        finish_delivery(workers, sinks, settings.drain_timeout)
        for close in closers:
            try:
                close()
            except Exception:  # a source that fails to close must not keep the rest open
                log.exception("closing a source failed")
        outbox.close()
        server.stop()
        log.info("stopped")
        ignore_stop_signals()
    return 0


def fleet_overflow(policy: Policy | None) -> Overflow:
    """What a full outbox does to the sources' commits. Without a policy, it refuses them (back-pressure: the
    sources keep their news and bring it again once the sinks have taken records). With one, it takes them over
    its bound: news held back would freeze what the policy sees, and a new Reboot would be neither approved nor
    drained before its NotBefore because a sink is down (docs/fleet.md, "A full outbox")."""
    return "exceed" if policy is not None else "refuse"


def load_fleet_policy(settings: FleetSettings) -> Policy | None:
    """The approval policy in fleet mode, or None (then nothing is acknowledged). The policy's libraries
    (jsonschema, yaml) are imported only when there is one."""
    if not settings.policy:
        return None
    from forewarn.approval.policy import PolicyError, load_policy

    try:
        policy = load_policy(settings.policy, fleet=True)
    except PolicyError as exc:
        raise ConfigError(str(exc)) from None
    log.info("approval policy %s: %d rule(s)%s", settings.policy, len(policy.rules),
             "; DRY RUN: nothing is acknowledged" if settings.dry_run or policy.dry_run else "")
    return policy


def arm_credential(settings: FleetSettings, simulation: FleetSimulation | None) -> Any:
    """The credential for ARM: the simulated fleet's own (no azure-identity needed), else build_credential's."""
    return simulation.credential if simulation is not None else build_credential(settings)


def build_credential(settings: FleetSettings) -> Any:
    """azure-identity's credential for ARM: the user-assigned managed identity --arm-client-id names, else
    DefaultAzureCredential (workload identity, managed identity, ...)."""
    try:
        from azure.identity import DefaultAzureCredential, ManagedIdentityCredential
    except ImportError as exc:
        raise ConfigError(f"Resource Graph and acknowledgements need azure-identity: pip install "
                          f"'forewarn[fleet]' ({exc})") from None
    if settings.arm_client_id:
        return ManagedIdentityCredential(client_id=settings.arm_client_id)
    return DefaultAzureCredential(exclude_interactive_browser_credential=True)


def fleet_scope(settings: FleetSettings) -> FleetScope:
    """This instance's scope: the events it records and acts on (forewarn.fleet.scope)."""
    return FleetScope.of(settings.subscription, settings.management_group, settings.resource_group)


def fleet_owner(settings: FleetSettings, elector: Any) -> Owner:
    """The owner its node actions' ledger entries name: its scope and its Lease (`namespace/name`), so that the
    replicas under one Lease share them and another instance in the same cluster never takes them."""
    return fleet_scope(settings).owner(f"{elector.namespace}/{elector.name}" if elector is not None else "")


def build_fleet_nodes(settings: FleetSettings, record: Callable[[Sequence[Any]], object],
                      metrics: FleetMetrics, owner: Owner) -> Any:
    """Node actions from fleet mode (a policy rule with `node`): a Kubernetes client per term, from --kubeconfig
    or the in-cluster service account; checked now, so a missing one stops start-up."""
    try:
        from forewarn.fleet.nodeactions import FleetNodes
        from forewarn.node.kube import KubeError, make_client
    except ImportError as exc:
        raise ConfigError(f"the policy's node actions need lightkube: pip install 'forewarn[fleet]' ({exc})") from None
    try:
        make_client(settings.kubeconfig).close()
    except KubeError as exc:
        raise ConfigError(f"the policy has node actions, which need the Kubernetes API: {exc}") from None
    return FleetNodes(lambda stop: make_client(settings.kubeconfig, stop=stop), record, metrics, owner=owner)


def build_acknowledger(settings: FleetSettings, stop: threading.Event,
                       simulation: FleetSimulation | None = None) -> Any:
    from forewarn.fleet.acknowledge import Acknowledger

    try:
        return Acknowledger(settings.arm_endpoint, arm_credential(settings, simulation),
                            api_version=settings.acknowledge_api_version, timeout=settings.arm_timeout, stop=stop,
                            loopback_http=simulation is not None)
    except ValueError as exc:
        raise ConfigError(f"--arm-endpoint / --acknowledge-api-version: {exc}") from None


def build_elector(settings: FleetSettings) -> Any:
    """The Lease elector when --lease-name is set (lightkube imported only then), else None."""
    if not settings.lease_name:
        return None
    try:
        from forewarn.fleet.lease import LeaseElector
        from forewarn.node.kube import KubeError, make_client
    except ImportError as exc:
        raise ConfigError(f"--lease-name needs lightkube: pip install 'forewarn[fleet]' ({exc})") from None
    renew = settings.lease_seconds / 3
    try:
        # Each request bounded by the renew period: a replica cut off from the API server steps down before
        # another can take over. Not stopped by the stop signal: the release must still go out after it.
        client = make_client(settings.kubeconfig, timeout=renew)
    except KubeError as exc:
        raise ConfigError(str(exc)) from None
    try:
        return LeaseElector(client, settings.lease_namespace or client.namespace, settings.lease_name,
                            lease_seconds=max(1, round(settings.lease_seconds)), renew_every=renew)
    except ValueError as exc:
        raise ConfigError(f"--lease-seconds: {exc}") from None


def add_push(settings: FleetSettings, server: HttpServer, committer: FleetCommitter, metrics: FleetMetrics,
             gate: ScopeGate, plain_ok: bool = False) -> None:
    """The Event Grid push route on the web server: 200 only once the events are committed. Events outside
    the scope are left out and answered 200 as well: any other answer, Event Grid would retry for a day.
    `plain_ok`: no warning about plain HTTP (the simulated fleet pushes over loopback)."""
    from forewarn.fleet.push import add_eventgrid_route

    assert settings.eventgrid_path is not None and settings.eventgrid_secret is not None

    def pushed(result: str) -> None:
        metrics.push_requests.labels(result).inc()
        if result == "accepted":
            metrics.source_succeeded("eventgrid", time.time())
        elif result == "failed":
            metrics.source_failed("eventgrid")

    try:
        add_eventgrid_route(server, settings.eventgrid_path, secret=settings.eventgrid_secret,
                            accept=lambda events: gate.admit(events, "eventgrid", committer.news), on_result=pushed)
    except ValueError as exc:
        raise ConfigError(f"FOREWARN_EVENTGRID_SECRET / --eventgrid-secret-file: {exc}") from None
    if not settings.web_config_file and not plain_ok:
        log.warning("Event Grid push on %s without --web.config.file: plain HTTP, so the shared secret crosses "
                    "the network in clear; Event Grid itself delivers only to https://", settings.eventgrid_path)


def build_resource_graph(settings: FleetSettings, stop: threading.Event,
                         simulation: FleetSimulation | None = None) -> Any:
    """The Resource Graph client, with azure-identity's credential (imported only when configured)."""
    credential = arm_credential(settings, simulation)
    from forewarn.fleet.resourcegraph import ResourceGraphClient

    try:
        return ResourceGraphClient(settings.arm_endpoint, credential, api_version=settings.resource_graph_api_version,
                                   timeout=settings.arm_timeout, max_reply_bytes=settings.arm_max_reply_bytes,
                                   stop=stop, loopback_http=simulation is not None)
    except ValueError as exc:
        raise ConfigError(f"--arm-endpoint {redact_url(settings.arm_endpoint)}: {exc}") from None


def build_queue(settings: FleetSettings) -> Any:
    """The Storage queue source: the connection string when one is set, else azure-identity."""
    try:
        from forewarn.fleet.queue import QueueOptions, QueueSource
    except ImportError as exc:
        raise ConfigError(f"--queue-url needs azure-storage-queue: pip install 'forewarn[fleet]' ({exc})") from None
    assert settings.queue_url is not None
    options = QueueOptions(visibility_timeout=round(settings.queue_visibility_timeout),
                           poll_interval=settings.queue_poll_interval)
    if settings.queue_connection_string:
        name = settings.queue_url.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
        return QueueSource.from_connection_string(settings.queue_connection_string, name, options)
    return QueueSource.from_queue_url(settings.queue_url, client_id=settings.queue_client_id, options=options)
