"""Approving the fleet's events by policy: decided here, acknowledged through ARM, recorded in the outbox.

`FleetApprover` is a source of the active replica's term (forewarn.sources): every `tick` seconds it reads the
open events from the committer and asks the policy (forewarn.approval.policy, in fleet mode, with the event's
place: subscription, resource group, scale set, VMs) what to do with each Scheduled one. An event the policy
approves, once its delay, `approve_within` and maintenance windows allow and within `max_approvals_per_hour`,
is acknowledged through ARM (forewarn.fleet.acknowledge; the events of one target together, where the
api-version has the list form), and each VM in its Resources gets an `approved` record naming the rule.
Acknowledgements go out through forewarn.fleet.acks: a small pool, one call per target at a time, a backoff per
target counted from the end of its failed call, so a target ARM keeps failing never holds back another. Before
any is sent, the events about to be acknowledged are written into the Lease (`publish`), so a successor that
takes over after a kill -9 never acknowledges them a second time.

Each step reads one `FleetView` (the open events, the term's complete snapshots and the tracker's endings, taken
at one moment) and decides everything from it. What the rule's node actions applied is undone only once the
event is known to be over (a final status, or missing from two complete snapshots of this term), and only
where this instance applied it: every ledger entry names its owner (forewarn.owner), and this instance's is its
scope and Lease. Until the term's first complete snapshot, nothing is done to nodes at all.

Safety, as in the per-VM agent: without a policy there is no approver, so nothing is acknowledged; an event no
rule matches is held; only Scheduled events are approved; `--dry-run` (or the policy's `dry_run`) records
what would be approved and sends nothing. An acknowledgement that fails is tried again after its target's backoff
while the event stays Scheduled; one ARM refuses for good (404: the event is gone, 403: no right) is not tried
again for that event, and says why once. Only the Lease holder acknowledges: the committer's `active()` is asked
before every call.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter as Tally
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from forewarn.approval.policy import Place, Policy, Rule, decide, first_match
from forewarn.fleet.acks import AckResult, AckRounds
from forewarn.fleet.armid import COMPUTE_NAMESPACE, VIRTUAL_MACHINE_SCALE_SETS, parse_arm_id
from forewarn.fleet.feed import FleetEvent, vm_ids
from forewarn.fleet.nodes import NodeIndex
from forewarn.fleet.records import FLEET_INCARNATION, fleet_vm
from forewarn.fleet.scope import FleetScope
from forewarn.fleet.tracker import FleetChange, FleetView, event_key
from forewarn.logs import StateLog
from forewarn.owner import LEGACY
from forewarn.records import Record, approval_record
from forewarn.tracker import Outcome

if TYPE_CHECKING:
    from forewarn.fleet.nodeactions import FleetNodes

log = logging.getLogger(__name__)

#: The event types after which the VM is gone (Spot eviction, deletion): `after_eviction` follows them.
GONE_TYPES = ("Preempt", "Terminate")
#: How often the open events are looked at (delays, windows and NotBefore move with the clock).
DEFAULT_TICK = 1.0


@dataclass
class _Work:
    """Work done once per event before its approval (the rule's node actions, its prepare hooks)."""

    state: str = ""                   # "" (not begun), running, ok, failed
    future: Future[bool] | None = None

    def begin(self, future: Future[bool]) -> None:
        self.state, self.future = "running", future

    def finished(self) -> bool:
        """Whether it has ended (ok or failed), looking at the work under way."""
        if self.state == "running" and self.future is not None and self.future.done():
            self.state = "ok" if self.future.result() else "failed"
        return self.state in ("ok", "failed")


@dataclass
class _Track:
    first_seen: float
    event: FleetEvent
    stage: str = "waiting"       # waiting, sending, approved (acknowledged), decided (dry run), refused (ARM said no)
    attempts: int = 0
    next_attempt: float = 0.0
    said: str = ""
    acting: _Work = field(default_factory=lambda: _Work())      # the rule's node actions
    nodes: dict[str, str] = field(default_factory=dict)         # ... on which nodes (node -> VM ID)
    preparing: _Work = field(default_factory=lambda: _Work())   # the rule's prepare hooks
    place: Place | None = None                                  # where `event` is (computed once per event)
    listed: bool = True                                         # Resource Graph listed it when its actions began


def place_of(event: FleetEvent) -> Place:
    """Where `event` is, for the policy's fleet keys."""
    target = parse_arm_id(event.resource_id)
    scale_set = target.name if target.is_type(COMPUTE_NAMESPACE, VIRTUAL_MACHINE_SCALE_SETS) else ""
    vms = tuple(parse_arm_id(vm).name for vm in vm_ids(event))
    return Place(event.subscription_id, event.resource_group, scale_set, vms)


class FleetApprover:
    """Approves by `policy` the open events of `view()` (FleetCommitter.view) within `scope`, through
    `acknowledger` (anything with `acknowledge(target, event_ids)`), while `active()`; `record` commits
    records (the outbox)."""

    name = "approver"

    def __init__(self, policy: Policy, acknowledger: Any, view: Callable[[], FleetView],
                 record: Callable[[Sequence[Record]], object], approvals: Any, dry_run: bool = False,
                 active: Callable[[], bool] = lambda: True, clock: Callable[[], float] = time.time,
                 tick: float = DEFAULT_TICK, nodes: FleetNodes | None = None, hook_runs: Any = None,
                 scope: FleetScope | None = None, held: Any = None,
                 publish: Callable[[], bool] = lambda: True) -> None:
        self.policy = policy
        self.nodes = nodes             # node actions (forewarn.fleet.nodeactions); None when no rule has any
        self.view = view
        self.scope = scope or FleetScope()
        self.hook_runs = hook_runs     # the azure_scheduled_events_hook_runs_total counter, or None
        self.held = held               # FleetMetrics' gauges of undos held back, or None
        self.publish = publish         # writes handover() into the Lease now; True once it is there
        self._hooks = ThreadPoolExecutor(max_workers=2, thread_name_prefix="fleet-hooks")
        self.acknowledger = acknowledger
        self.record = record
        self.approvals = approvals     # the azure_scheduled_events_approvals_total counter
        self.dry_run = dry_run or policy.dry_run
        self.active = active
        self.clock = clock
        self.tick = tick
        self._tracks: dict[tuple[str, str], _Track] = {}
        self._digests: dict[bytes, _Track] = {}   # the same tracks by handover.key_digest
        self._recent: deque[float] = deque()   # approvals within the last hour, for max_approvals_per_hour
        self._acks: AckRounds | None = None    # the term's acknowledgements (made at the first step)
        self._cap_said = False
        self._lock = threading.Lock()          # the tracks, between `step` and the Lease thread's `handover`
        self._wake = threading.Event()         # set by a commit (or the stop): the next step comes at once
        self._counts: Tally[str] = Tally()     # events in progress by group (scale set, availability set, VM)
        self._last_start = float("-inf")       # when the last event went in progress (rollout.stagger)
        self._nodes_state = StateLog(log, "Kubernetes nodes")
        self._waiting_said = False             # said that nothing is done to nodes before a complete snapshot
        self._reconciled_at = -1               # the term's complete snapshots at the last read of the ledgers
        self._held_said: set[tuple[str, str, str]] = set()   # (node, ledger key, reason) already recorded
        self._held_said_state = False   # the hold of every action (FleetView.held) was logged
        self._ended: list[FleetChange] = []    # events that ended, from the committer: undone on their nodes
        self._inherited: set[bytes] = set()    # events the previous Lease holder approved

    def ended(self, changes: Sequence[FleetChange]) -> None:
        """Events that ended (the committer's `removed` changes, after its commit): what this instance's entries
        on nodes hold for them is undone at the next step that may touch nodes, also when this replica never
        acted for them (its predecessor under the same Lease did); after a Preempt or Terminate that completed,
        the rule's `after_eviction` is carried out."""
        self._recover(changes)
        if self.nodes is not None:
            with self._lock:
                self._ended.extend(changes)

    # --- the Lease's handover (forewarn.fleet.handover) -----------------------------------------------
    def inherit(self, annotation: str | None) -> None:
        """At the start of a term: the events the previous holder approved are not approved again."""
        from forewarn.fleet.handover import decode

        inherited = decode(annotation)
        with self._lock:
            self._inherited = set(inherited)
            self._reconciled_at = -1
            # This replica may have held the Lease before, with tracks of its own: what another holder approved
            # since is approved for them too (found by the state machine in tests/test_fleet_interleavings.py).
            for digest, track in self._digests.items():
                if digest in self._inherited and track.stage in ("waiting", "sending"):
                    track.stage = "approved"
                    self._say(track, track.event, "approved by the previous active replica")
        if inherited:
            log.info("the previous active replica approved %d event(s); they are not approved again", len(inherited))

    def handover(self) -> str:
        """The events approved in this term (and those inherited), for the Lease."""
        from forewarn.fleet.handover import encode

        with self._lock:
            return encode({digest for digest, track in self._digests.items()
                           if track.stage in ("sending", "approved", "decided")} | self._inherited)

    def wake(self) -> None:
        """Look at the open events now rather than at the next tick (the committer, after a commit)."""
        self._wake.set()

    def _wake_at(self, stop: threading.Event) -> None:
        stop.wait()
        self._wake.set()

    def run(self, stop: threading.Event) -> None:
        self._hooks = ThreadPoolExecutor(max_workers=2, thread_name_prefix="fleet-hooks")   # one per term
        if self.nodes is not None:
            self.nodes.begin(stop)
        threading.Thread(target=self._wake_at, args=(stop,), name="approver-stop", daemon=True).start()
        try:
            while not stop.is_set():
                self._wake.clear()
                try:
                    self.step(stop)
                except Exception:  # a bug must not end the approvals of the term
                    log.exception("the fleet approver failed; trying again at the next tick")
                self._wake.wait(self.tick)
        finally:
            if self.nodes is not None:
                self.nodes.end()
            self._hooks.shutdown(wait=False, cancel_futures=True)
            acks, self._acks = self._acks, None
            if acks is not None:
                acks.close(wait=False)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until the work started so far is done: node actions, undos and hooks, and acknowledgements
        (answered, their records written); False if some is still under way after `timeout` seconds."""
        end = time.monotonic() + timeout
        if self.nodes is not None and not self.nodes.wait_idle(timeout):
            return False
        with self._lock:
            futures = [work.future for track in self._tracks.values() for work in (track.acting, track.preparing)
                       if work.future is not None]
        if wait(futures, timeout=max(0.0, end - time.monotonic())).not_done:
            return False
        acks = self._acks
        return acks is None or acks.wait_idle(max(0.0, end - time.monotonic()))

    def step(self, stop: threading.Event | None = None) -> None:
        """One look at the open events: decide, then acknowledge what is due, target by target. A replica that
        is not the active one (its term ending) starts nothing: no node action, undo or acknowledgement.
        Everything is decided from one view, read first; the nodes are read after it, so a ledger entry this
        instance wrote is never newer than the view that made it write it."""
        if not self.active():
            return
        view = self.view()
        if view.held is not None:
            # The open events are not known (FleetCommitter.reload_failed): an event missing from this view may
            # be open, so nothing is approved, done or undone until they are.
            if not self._held_said_state:
                log.warning("every approval, node action and undo is held: %s", view.held)
                self._held_said_state = True
                self._say_held_nodes(view.held)
            self._set_held(waiting=1)
            return
        if self._held_said_state:
            log.info("the open events are known again: approvals, node actions and undos go ahead")
            self._held_said_state = False
        events = {event_key(event): event for event in view.open_events if self.scope.contains(event)}
        index = self._node_index(view)   # Kubernetes requests, outside the lock
        with self._lock:
            due = self._decide(view, events, index)
            sending = self._to_send(due)
        if not sending or (stop is not None and stop.is_set()) or not self.active():
            self._unsend(sending)
            return
        if self.dry_run:
            for target, batch in sending:
                self._approved(target, batch)
            return
        if not self.publish():
            log.warning("cannot write the events about to be acknowledged into the Lease; not acknowledging them "
                        "now (a successor could acknowledge them again): trying at the next step")
            self._unsend(sending)
            return
        if self._acks is None:
            self._acks = AckRounds(self.acknowledger, self.clock, stop)
        for target, batch in sending:
            self._acks.send(target, [event.event.event_id for event, _ in batch],
                            functools.partial(self._acknowledged, target, batch))

    def _to_send(self, due: dict[str, list[tuple[FleetEvent, str]]]) -> list[tuple[str, list[tuple[FleetEvent, str]]]]:
        """The batches to acknowledge now, their tracks moved to `sending` (under the lock): targets whose
        acknowledgement is under way or backing off wait, and the hourly cap holds back what exceeds it."""
        now = self.clock()
        sending = []
        for target, batch in due.items():
            if self._acks is not None and not self._acks.ready(target, now):
                for event, _ in batch:
                    self._say(self._tracks[event_key(event)], event, self._acks.waiting(target, now))
                continue
            batch = self._within_cap(batch, now)
            if not batch:
                continue
            self._recent.extend([now] * len(batch))   # counted against the cap now; given back if not approved
            for event, _ in batch:
                self._tracks[event_key(event)].stage = "sending"
            sending.append((target, batch))
        return sending

    def _unsend(self, sending: Sequence[tuple[str, list[tuple[FleetEvent, str]]]]) -> None:
        """Batches that were not sent after all: back to waiting, and out of the hourly count."""
        with self._lock:
            for _, batch in sending:
                for event, _ in batch:
                    track = self._tracks.get(event_key(event))
                    if track is not None and track.stage == "sending":
                        track.stage = "waiting"
                    self._give_back()

    def _give_back(self) -> None:
        if self._recent:
            self._recent.pop()

    def _decide(self, view: FleetView, events: dict[tuple[str, str], FleetEvent],
                index: NodeIndex | None) -> dict[str, list[tuple[FleetEvent, str]]]:
        from forewarn.fleet.handover import key_digest

        now = self.clock()
        for key in [key for key in self._tracks if key not in events]:
            gone = self._tracks[key]
            if not view.over(gone.event.event_id, gone.listed):
                continue   # not open in this view, yet not known to be over (a commit that failed): kept
            if gone.nodes and self.nodes is not None and index is None:
                continue   # over, but the nodes cannot be touched now: undone at a later step
            del self._tracks[key]   # over: what its node actions applied is undone, then it is forgotten
            if gone.nodes and self.nodes is not None:
                self.nodes.undo(gone.event.event, gone.nodes, self.dry_run, gone.event, legacy=True)
        live = {id(track) for track in self._tracks.values()}
        self._digests = {digest: track for digest, track in self._digests.items() if id(track) in live}
        self._counts = Tally(track.event.resource_id.lower() for track in self._tracks.values()
                             if self._in_progress(track))
        due: dict[str, list[tuple[FleetEvent, str]]] = {}
        for key, fleet_event in events.items():
            if fleet_event.event.status != "Scheduled":
                continue
            if view.ended(fleet_event.event_id):
                # Ended after this step's view was read (a commit while the nodes were listed): its undo may be
                # under way already, so nothing starts for it now (endings are final, so asking late is safe).
                continue
            track = self._tracks.get(key)
            if track is None:
                track = self._tracks[key] = _Track(first_seen=now, event=fleet_event)
                digest = key_digest(fleet_event)
                self._digests[digest] = track
                if digest in self._inherited:
                    track.stage = "approved"
                    self._say(track, fleet_event, "approved by the previous active replica")
            if track.stage != "waiting" or now < track.next_attempt:
                continue
            if track.place is None or track.event is not fleet_event:
                track.event, track.place = fleet_event, place_of(fleet_event)
            decision = decide(self.policy, fleet_event.event, None, now, track.first_seen, track.place)
            if decision.rule is not None and decision.rule.node and not self._acted(view, track, decision.rule,
                                                                                     index):
                continue
            if decision.action != "approve" or decision.rule is None:
                self._say(track, fleet_event, decision.reason)
                continue
            if decision.rule.prepare and not self._prepared(track, decision.rule):
                continue
            if decision.earliest is not None and now < decision.earliest:
                self._say(track, fleet_event, f"{decision.reason}; not before "
                          f"{datetime.fromtimestamp(decision.earliest, tz=timezone.utc):%H:%M:%S}Z")
                continue
            if not self._in_progress(track) and not self._may_start(track, now):
                continue
            due.setdefault(fleet_event.resource_id, []).append((fleet_event, decision.rule.name))
        return due

    # --- hooks ---------------------------------------------------------------------------------------------
    def _prepared(self, track: _Track, rule: Rule) -> bool:
        """Whether the rule's prepare hooks are done with (run once per event, after its node actions, for the
        event as a whole: its first VM stands for the VM in the hook's input); a failure holds the event
        unless the rule says on_hook_failure: approve."""
        if track.preparing.state == "":
            self._say(track, track.event, f"rule {rule.name}: running {len(rule.prepare)} prepare hook(s)")
            track.preparing.begin(self._hooks.submit(self._run_hooks, rule.prepare, "prepare", track.event,
                                                     rule.name))
            return False
        if not track.preparing.finished():
            return False
        if track.preparing.state == "failed" and rule.on_hook_failure == "hold":
            self._say(track, track.event, f"rule {rule.name}: a prepare hook failed; holding")
            return False
        return True

    def _run_hooks(self, hooks: Sequence[Any], kind: str, event: FleetEvent, rule: str | None) -> bool:
        from forewarn.approval.hooks import run_hook

        vms = vm_ids(event)
        vm = fleet_vm(event, vms[0]) if vms else fleet_vm(event, event.resource_id)
        for hook in hooks:
            result = run_hook(hook, kind, event.event, vm, rule)
            if self.hook_runs is not None:
                self.hook_runs.labels(kind, result).inc()
            if result != "success":
                return False
        return True

    def _recover(self, changes: Sequence[FleetChange]) -> None:
        """The policy's recover hooks, once for each event that completed (none between two terms)."""
        for change in changes:
            if change.outcome is Outcome.COMPLETED and self.policy.recover:
                try:
                    self._hooks.submit(self._run_hooks, self.policy.recover, "recover", change.event, None)
                except RuntimeError:   # the term ended meanwhile: its pool is shut down
                    log.warning("event %s completed as this replica stopped being the active one: its recover "
                                "hooks are not run", change.event.event.event_id)

    # --- rollout (the policy's `rollout`, fleet mode) -------------------------------------------------
    @staticmethod
    def _in_progress(track: _Track) -> bool:
        """Whether the event counts against the rollout limits: its node actions begun, or it approved."""
        return track.acting.state != "" or track.stage in ("sending", "approved", "decided")

    def _may_start(self, track: _Track, now: float) -> bool:
        """Whether one more event may go in progress now (and, if so, it is counted as going): within the
        rollout limits, fleet-wide and for its scale set or availability set, and `stagger` after the last."""
        rollout = self.policy.rollout
        if rollout is None:
            return True
        group = track.event.resource_id.lower()
        why = None
        if rollout.max_in_progress is not None and sum(self._counts.values()) >= rollout.max_in_progress:
            why = f"rollout: {sum(self._counts.values())} event(s) in progress across the fleet (max_in_progress)"
        elif rollout.max_in_progress_per_group is not None and self._counts[group] >= rollout.max_in_progress_per_group:
            why = f"rollout: {self._counts[group]} event(s) of its group in progress (max_in_progress_per_group)"
        elif rollout.stagger and now < self._last_start + rollout.stagger:
            why = f"rollout: staggered, {self._last_start + rollout.stagger - now:.0f} s after the last"
        if why is not None:
            self._say(track, track.event, f"{why}; waiting")
            return False
        self._counts[group] += 1
        self._last_start = now
        return True

    def _node_index(self, view: FleetView) -> NodeIndex | None:
        """The cluster's nodes (None: no node actions, the API cannot be read now, or this term has no complete
        snapshot yet, so nothing may be done to nodes). Undoes this instance's entries for the events that
        ended and, when the nodes were read afresh, for every event `view` knows to be over."""
        if self.nodes is None:
            return None
        if not view.ready_for_nodes:
            if not self._waiting_said:
                log.warning("no complete Resource Graph snapshot in this term yet: nothing is done to nodes (no node "
                            "action, no undo) until one is committed")
                self._waiting_said = True
            self._set_held(waiting=1)
            return None
        if self._waiting_said:
            log.info("a complete Resource Graph snapshot was committed: node actions and undos go ahead")
            self._waiting_said = False
        from forewarn.node.kube import KubeError

        try:
            # Each complete snapshot may make an entry's event known to be over: the ledgers are read again then,
            # not only every `refresh` seconds.
            index, fresh = self.nodes.index(fresh=view.complete_snapshots != self._reconciled_at)
        except KubeError as exc:
            self._nodes_state.failing(str(exc.code or "error"), f"{exc}; node actions wait")
            return None
        self._nodes_state.ok()
        with self._lock:
            ended, self._ended = self._ended, []
            tracked = {key for key, track in self._tracks.items() if track.nodes}
        for change in ended:   # known over: a final status, or missing from two complete snapshots in a row
            event = change.event
            holding = self._holding(index, event.event.event_id)
            if holding and event_key(event) not in tracked:   # tracked ones are undone by _decide, from its track
                self.nodes.undo(event.event, holding, self.dry_run, None, legacy=True)
            if change.outcome is Outcome.COMPLETED and event.event.event_type in GONE_TYPES:
                seen = change.previous or event
                rule, _ = first_match(self.policy, seen.event, None, self.clock(), place_of(seen))
                if rule is not None and rule.after_eviction:
                    self.nodes.after_eviction(event, rule, self.nodes.nodes_of(event, index), self.dry_run)
        if fresh:
            self._reconciled_at = view.complete_snapshots
            mine = self.nodes.owner.id
            from forewarn.fleet.gone import mark_is_mine

            back = sorted(node for node, mark in index.out_of_service.items() if mark_is_mine(mark, mine))
            if back:
                self.nodes.back_in_service(back, self.dry_run)
            self._reconcile(view, index)
        return index

    def _holding(self, index: NodeIndex, event_id: str) -> dict[str, str]:
        """The nodes whose ledger has an entry of this instance (or a legacy one) for `event_id`."""
        mine, wanted = self.nodes.owner.id if self.nodes is not None else "", event_id.lower()
        return {node: "" for node, refs in index.held.items()
                if any(ref.event_id.lower() == wanted and ref.owner_id in (mine, LEGACY) for ref in refs)}

    def _reconcile(self, view: FleetView, index: NodeIndex) -> None:
        """Every ledger entry on the nodes just read, against `view`: this instance's entries for events known
        to be over are undone (left by an earlier term, a killed predecessor, or a missed end); legacy entries
        (written before owners) only when the tracker knows their event ended; everything else is held, and
        said once (a log line, a `held` record for this instance's entries, the gauges)."""
        from forewarn.fleet.nodeactions import left_over

        assert self.nodes is not None
        mine = self.nodes.owner.id
        held: Tally[str] = Tally()
        present = {(node, ref.key) for node, refs in index.held.items() for ref in refs}
        self._held_said = {said for said in self._held_said if said[:2] in present}
        for node, refs in index.held.items():
            for ref in refs:
                if ref.owner_id not in (mine, LEGACY):
                    held["other_owner"] += 1   # the per-VM agent's, or another fleet instance's: never ours to undo
                    continue
                if ref.event_id.lower() in view.open_ids:
                    continue                   # open: its actions are resumed by acting again
                if ref.legacy and not view.ended(ref.event_id):
                    self._hold(node, ref.key, ref.event_id, "legacy", held,
                               "an entry from a version before owners; undone here only once this instance's feeds "
                               "say its event ended (the per-VM agent of the node undoes it when the event leaves "
                               "its IMDS document)")
                    continue
                if not view.over(ref.event_id, ref.listed):
                    self._hold(node, ref.key, ref.event_id, "not_known_over", held,
                               f"not open, but not known to be over either ({view.complete_snapshots} complete "
                               "snapshot(s) in this term; two without it, or a final status, are needed)"
                               if ref.listed else "not open, and known only from the queue or a push (Resource "
                               "Graph never listed it): it is over once a feed says Completed or Canceled")
                    continue
                log.warning("node %s holds what this instance applied for event %s, which is over: undoing it", node,
                            ref.event_id)
                self.nodes.undo(left_over(ref.event_id), {node: ""}, self.dry_run, None, legacy=ref.legacy)
        self._set_held(held)

    def _say_held_nodes(self, why: str) -> None:
        """A `held` record for each node this replica acted on for an event it tracks, once per hold of everything."""
        if self.nodes is None:
            return
        with self._lock:
            acted = [(track.event.event.event_id, node) for track in self._tracks.values() for node in track.nodes]
        for event_id, node in acted:
            try:
                self.nodes.held(event_id, node, f"undo held back (state_unreadable): node {node}, event {event_id}: "
                                f"{why}")
            except Exception:   # the outbox may be what fails: the log line above says it all the same
                log.exception("cannot record the hold of node %s", node)

    def _hold(self, node: str, key: str, event_id: str, reason: str, held: Tally[str], why: str) -> None:
        held[reason] += 1
        if (node, key, reason) in self._held_said:
            return
        self._held_said.add((node, key, reason))
        assert self.nodes is not None
        self.nodes.held(event_id, node, f"undo held back ({reason}): node {node}, entry {key}: {why}")

    def _set_held(self, held: Tally[str] | None = None, waiting: int = 0) -> None:
        if self.held is not None:
            self.held.set(held or Tally(), waiting)

    def _acted(self, view: FleetView, track: _Track, rule: Rule, index: NodeIndex | None) -> bool:
        """Whether the rule's node actions are done with for this event (and the decision may go on): starts
        them on the event's nodes the first time, and says when they failed and the rule holds."""
        assert self.nodes is not None, "a policy with node actions needs FleetNodes"
        event = track.event
        if track.acting.state == "":
            if index is None or not self._may_start(track, self.clock()):
                return False
            track.nodes = self.nodes.nodes_of(event, index)
            self._say(track, event, f"rule {rule.name}: {len(rule.node)} node action(s) on "
                      f"{', '.join(track.nodes) or 'no node of this cluster'}")
            track.listed = view.listed(event_key(event))
            track.acting.begin(self.nodes.act(event, rule, track.nodes, self.dry_run, listed=track.listed))
            return False
        if not track.acting.finished():
            return False
        if track.acting.state == "failed" and rule.on_failure == "hold":
            self._say(track, event, f"rule {rule.name}: a node action failed or was skipped; holding")
            return False
        return True

    def _within_cap(self, batch: list[tuple[FleetEvent, str]], now: float) -> list[tuple[FleetEvent, str]]:
        cap = self.policy.max_approvals_per_hour
        if cap is None:
            return batch
        while self._recent and self._recent[0] <= now - 3600:
            self._recent.popleft()
        room = max(0, cap - len(self._recent))
        if len(batch) > room and not self._cap_said:
            log.warning("approval cap reached (%d per hour): holding %d event(s)", cap, len(batch) - room)
        self._cap_said = len(batch) > room
        return batch[:room]

    def _acknowledged(self, target: str, batch: list[tuple[FleetEvent, str]], result: AckResult) -> None:
        """One acknowledgement's answer (on an AckRounds thread): approved, tried again after the target's
        backoff, or refused for good."""
        if result.ok:
            self._approved(target, batch)
            self.wake()
            return
        with self._lock:
            for event, _ in batch:
                self._give_back()
                track = self._tracks.get(event_key(event))
                if track is None or track.stage != "sending":
                    continue   # ended meanwhile
                track.stage = "waiting"
                if result.stopped:
                    continue
                self.approvals.labels(event.event.event_type, "failed").inc()
                track.attempts += 1
                if result.retryable:
                    track.next_attempt = result.next_attempt
                else:
                    track.stage = "refused"
        if not result.stopped:
            log.error("acknowledging %s on %s failed (%s); %s", ", ".join(e.event.event_id for e, _ in batch),
                      target, result.error, "will try again while Scheduled" if result.retryable
                      else "not tried again")

    def _approved(self, target: str, batch: list[tuple[FleetEvent, str]]) -> None:
        """The batch is acknowledged (or, in a dry run, would be): its tracks, counts, log lines and records."""
        now = self.clock()
        at = datetime.fromtimestamp(now, tz=timezone.utc)
        records: list[Record] = []
        with self._lock:
            for event, _ in batch:
                track = self._tracks.get(event_key(event))
                if track is not None:
                    track.stage = "decided" if self.dry_run else "approved"
        for event, rule in batch:
            self.approvals.labels(event.event.event_type, "dry_run" if self.dry_run else "approved").inc()
            log.warning("%s event %s (%s, NotBefore %s) on %s by rule %s",
                        "DRY RUN: would acknowledge" if self.dry_run else "acknowledged", event.event.event_id,
                        event.event.event_type, event.event.raw.get("NotBefore") or "-", target, rule)
            for vm_resource_id in vm_ids(event):
                records.append(approval_record(event.event, fleet_vm(event, vm_resource_id), rule, self.dry_run,
                                               FLEET_INCARNATION, at))
        self.record(records)

    @staticmethod
    def _say(track: _Track, event: FleetEvent, text: str) -> None:
        if text != track.said:
            track.said = text
            log.info("event %s on %s (%s %s): %s", event.event.event_id, event.resource_id, event.event.event_type,
                     event.event.status, text)
