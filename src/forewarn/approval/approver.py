"""Carry out the policy: act on the node, run prepare hooks, elect the approving VM, start events, confirm.

Called after every good poll with the document and its changes. All slow work (hooks, the start request)
runs on a small thread pool, so polling and metrics never wait for it; the next poll picks up the results.
Every approval, sent or dry-run, becomes an `approved` record naming the rule that caused it.

Each event the approver has seen has one `Track`, whose `Stage` says how far it got; `Track.move` is the
only place a stage changes, and `STAGES` lists every step it may take.

A rule's node actions (cordon, drain, ...) run first, once per event, on the pool through the `NodeActor`
(only for events that affect this VM); each outcome becomes a `node_action` record and a count. What they
applied is undone when the event leaves the document, completed or cancelled; an undo that fails (an API
error) is tried again at later polls, with backoff, for up to UNDO_RETRY_FOR. Once per start, after the first
good document, the approver also asks the actor what the node still holds (`NodeActor.pending`) and undoes,
the same way, what belongs to events no longer in the document: an undo still failing when forewarn stopped,
or an event that ended while it was down, is not lost.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import Enum

from forewarn.approval.actor import ActionOutcome, DrainProgress, NodeActor, recording_report
from forewarn.approval.hooks import run_hook
from forewarn.approval.policy import Hook, Policy, Rule, decide
from forewarn.approval.starter import Starter, StartError
from forewarn.imds.document import Document, Event
from forewarn.imds.instance import VmInfo
from forewarn.metrics import Metrics
from forewarn.records import Record, approval_record
from forewarn.retry import Backoff
from forewarn.tracker import Change, ChangeKind, Outcome

log = logging.getLogger(__name__)

#: How long an approved event may stay Scheduled before the approval is sent again.
CONFIRM_AFTER = 30.0
#: How long a failed undo of node actions is tried again (at later polls, with backoff) before giving up.
UNDO_RETRY_FOR = 3600.0


class Stage(str, Enum):
    """How far the approval of one event got. Whether the policy holds or approves an event is decided
    again at every poll (a reload, a window or the event itself may change the answer), so a hold is a
    decision, logged, not a stage."""

    WAITING = "waiting"            # seen; not approved yet, and no node action nor prepare hook has run
    ACTING = "acting"              # its rule's node actions are running (a drain may take minutes)
    ACTED = "acted"                # every node action succeeded: on to prepare hooks and the decision
    ACT_FAILED = "act_failed"      # a node action failed: held, unless the rule says on_failure: approve
    PREPARING = "preparing"        # its rule's prepare hooks are running
    PREPARED = "prepared"          # the prepare hooks succeeded: approved when the policy allows
    HOOK_FAILED = "hook_failed"    # a prepare hook failed: held, unless the rule says on_hook_failure: approve
    STARTING = "starting"          # the Starter was asked to start it, and has not answered yet
    START_FAILED = "start_failed"  # the Starter failed: asked again after a backoff, if the policy still approves
    APPROVED = "approved"          # started; asked again while it stays Scheduled (see CONFIRM_AFTER)
    DECIDED = "decided"            # dry run: recorded as approved, never sent

    def __str__(self) -> str:
        return self.value


#: Every step a stage may take. An event that leaves the document is simply forgotten, from any stage.
STAGES: dict[Stage, frozenset[Stage]] = {
    Stage.WAITING: frozenset({Stage.ACTING, Stage.PREPARING, Stage.STARTING, Stage.DECIDED}),
    Stage.ACTING: frozenset({Stage.ACTED, Stage.ACT_FAILED}),
    Stage.ACTED: frozenset({Stage.PREPARING, Stage.STARTING, Stage.DECIDED}),
    Stage.ACT_FAILED: frozenset({Stage.PREPARING, Stage.STARTING, Stage.DECIDED}),
    Stage.PREPARING: frozenset({Stage.PREPARED, Stage.HOOK_FAILED}),
    Stage.PREPARED: frozenset({Stage.STARTING, Stage.DECIDED}),
    Stage.HOOK_FAILED: frozenset({Stage.STARTING, Stage.DECIDED}),
    Stage.STARTING: frozenset({Stage.APPROVED, Stage.START_FAILED}),
    Stage.START_FAILED: frozenset({Stage.STARTING, Stage.DECIDED}),
    Stage.APPROVED: frozenset(),
    Stage.DECIDED: frozenset(),
}


@dataclass
class Track:
    """What the approver knows about one event."""

    first_seen: float
    stage: Stage = Stage.WAITING
    rule: str = ""                    # the rule that approved it, once one did
    approved_at: float | None = None  # when the Starter last accepted it
    attempts: int = 0                 # start requests made, for the backoff after a failed one
    next_attempt: float = 0.0         # no start request before this moment
    said: str = ""                    # the last decision logged, to log each change once

    def move(self, to: Stage) -> None:
        if to not in STAGES[self.stage]:
            raise AssertionError(f"approval stage {self.stage} cannot become {to}")
        self.stage = to


@dataclass
class Undo:
    """The undo of one ended event's node actions, until it succeeds (or UNDO_RETRY_FOR has passed)."""

    event: Event
    vm: VmInfo
    incarnation: int
    first_try: float
    attempts: int = 0
    next_attempt: float = 0.0
    running: bool = True              # on the pool now: not handed on again meanwhile


def left_over(event_id: str, vm: VmInfo) -> Event:
    """The event a node still holds something for, known by its id only: it is no longer in the document,
    so its type and status are unknown (empty in the records of its undo). It affected this VM, or nothing
    would have been applied to its node."""
    return Event(event_id=event_id, event_type="", status="", resource_type="", resources=(vm.name,) if vm.name
                 else (), not_before=None, raw={"EventId": event_id, "EventType": "", "EventStatus": ""})


#: Events the policy may still approve at this poll: the ones not approved yet, nor under way.
_OPEN = (Stage.WAITING, Stage.ACTED, Stage.ACT_FAILED, Stage.PREPARED, Stage.HOOK_FAILED, Stage.START_FAILED)


class Approver:
    def __init__(self, policy: Policy, starter: Starter, metrics: Metrics,
                 record: Callable[[Sequence[Record]], None], dry_run: bool = False,
                 clock: Callable[[], float] = time.time, workers: int = 4,
                 actor: NodeActor | None = None) -> None:
        self.policy = policy
        self.actor = actor            # carries out node actions; None without --node-name
        self.starter = starter
        self.metrics = metrics
        self.record = record
        self.dry_run = dry_run or policy.dry_run
        self.clock = clock
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="approver")
        self._lock = threading.Lock()
        # Hooks and start requests handed to the pool and not done yet. Its own lock: a future may finish
        # (and drop out) on any thread, also while the main lock is held.
        self._pending: set[Future[object]] = set()
        self._pending_lock = threading.Lock()
        self._tracks: dict[str, Track] = {}
        self._request: Future[object] | None = None  # the start request under way: one at a time
        self._approvals: collections.deque[float] = collections.deque()
        self._backoff = Backoff(base=2.0, cap=30.0)
        # Undos that failed (an API error): tried again at later polls, so one transient error never
        # leaves the node cordoned by forewarn. By event id.
        self._undos: dict[str, Undo] = {}
        self._undo_backoff = Backoff(base=1.0, cap=30.0)
        # What the node still holds from before this start is undone once (see `_reconcile`); until then,
        # the ids of events whose undo was handed on here, so it does not undo (or report) them twice.
        self._reconciled = False
        self._reconciling = False
        self._reconcile_attempts = 0
        self._first_reconcile: float | None = None
        self._next_reconcile = 0.0
        self._undone_here: set[str] = set()
        self._document_ids: frozenset[str] = frozenset()
        self._cap_logged = False
        self._incarnation = 0
        metrics.policy_loaded(hooks=policy.uses_hooks, node_actions=actor is not None)

    def close(self) -> None:
        if self.actor is not None:
            self.actor.close()   # a drain under way stops waiting; the next start resumes it
        self._pool.shutdown(wait=False, cancel_futures=True)

    def replace_policy(self, policy: Policy, dry_run: bool = False) -> None:
        """Decide by `policy` from the next poll on (SIGHUP). Hooks and start requests already on the pool
        finish as they began. `dry_run` is --dry-run, which a policy can add to but not take away."""
        with self._lock:
            self.policy = policy
            self.dry_run = dry_run or policy.dry_run
        self.metrics.policy_loaded(hooks=policy.uses_hooks, node_actions=self.actor is not None)

    def stage(self, event_id: str) -> Stage | None:
        """How far the approval of `event_id` got (None: not in the last document seen)."""
        with self._lock:
            track = self._tracks.get(event_id)
            return track.stage if track is not None else None

    def idle(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the hooks and start requests handed to the pool so far (none
        of them hands on more work); True when all have finished."""
        with self._pending_lock:
            pending = set(self._pending)
        return not wait(pending, timeout=timeout).not_done

    def _submit(self, work: Callable[..., object], *args: object) -> Future[object]:
        """Run `work(*args)` on the pool, keeping its future until it is done (see `idle`)."""
        future = self._pool.submit(work, *args)
        with self._pending_lock:
            self._pending.add(future)
        future.add_done_callback(self._done)
        return future

    def _done(self, future: Future[object]) -> None:
        with self._pending_lock:
            self._pending.discard(future)

    # --- called by the poll loop after every good poll -----------------------------------------
    def on_changes(self, document: Document, changes: Sequence[Change], vm: VmInfo) -> None:
        now = self.clock()
        records: list[Record] = []
        with self._lock:
            self._incarnation = document.incarnation
            self._document_ids = frozenset(event.event_id for event in document.events)
            for change in changes:
                if change.kind is ChangeKind.REMOVED:
                    self._tracks.pop(change.event.event_id, None)
                    if self.actor is not None and change.event.affects(vm.name):
                        # Also after a restart (no track): the node's annotation says what there is to undo.
                        undo = Undo(change.event, vm, change.incarnation, first_try=now)
                        self._undos[change.event.event_id] = undo
                        if not self._reconciled:
                            self._undone_here.add(change.event.event_id)
                        self._submit(self._undo, undo)
                    if change.outcome is Outcome.COMPLETED and change.event.affects(vm.name) and self.policy.recover:
                        self._submit(self._run_hooks, self.policy.recover, "recover", change.event, vm, None)
            if (self.actor is not None and not self._reconciled and not self._reconciling
                    and now >= self._next_reconcile):
                self._reconciling = True
                self._submit(self._reconcile, vm, document.incarnation)
            for undo in self._undos.values():
                if not undo.running and now >= undo.next_attempt:
                    undo.running = True
                    self._submit(self._undo, undo)
            # One start request at a time: the answer to the one under way may change what to ask next.
            busy = self._request is not None and not self._request.done()
            batch: list[tuple[Event, str]] = []
            for event in document.events:
                track = self._tracks.setdefault(event.event_id, Track(first_seen=now))
                rule_name = self._consider(event, track, vm, now, busy)
                if rule_name is not None:
                    batch.append((event, rule_name))
            batch = self._within_cap(batch, now)
            if batch and self.dry_run:
                for event, _ in batch:
                    self._tracks[event.event_id].move(Stage.DECIDED)
                records = self._approved(batch, document.incarnation, vm, dry_run=True)
            elif batch:
                for event, rule_name in batch:
                    track = self._tracks[event.event_id]
                    if track.stage is not Stage.APPROVED:  # an approved one is only asked again
                        track.move(Stage.STARTING)
                        track.rule = rule_name
                    track.attempts += 1
                self._request = self._submit(self._start, batch, document.incarnation, vm)
        # Outside the lock: the outbox may be slow (a disk) and the start request's thread needs the lock.
        if records:
            self.record(records)

    def _say(self, track: Track, event: Event, text: str, level: int = logging.INFO) -> None:
        if text != track.said:
            track.said = text
            log.log(level, "event %s (%s %s): %s", event.event_id, event.event_type, event.status, text)

    def _consider(self, event: Event, track: Track, vm: VmInfo, now: float, busy: bool) -> str | None:
        """The rule to start `event` by now, or None; starts prepare hooks on the way. `busy`: a start
        request is under way, so none is made now (hooks still start, decisions are still logged)."""
        if event.status != "Scheduled":
            if track.stage is Stage.APPROVED:
                self._say(track, event, f"approval confirmed: {event.status}")
            return None
        if track.stage is Stage.APPROVED:
            # Asking again sends a request: never in a dry run (a reload may have turned one on).
            return None if busy or self.dry_run else self._recheck(event, track, now)
        if track.stage not in _OPEN:
            return None
        decision = decide(self.policy, event, vm.name, now, track.first_seen)
        rule = decision.rule
        if rule is not None and rule.node and event.affects(vm.name):
            if self.actor is None:
                self._say(track, event, f"rule {rule.name} has node actions but no --node-name is set; holding",
                          logging.WARNING)
                return None
            if track.stage is Stage.WAITING:
                # Before prepare hooks and the decision: a hold rule acts too (Preempt: nothing to approve).
                track.move(Stage.ACTING)
                self._say(track, event, f"rule {rule.name}: {len(rule.node)} node action(s) on {self.actor.node}")
                self._submit(self._act, rule, event, vm, track, self._incarnation)
                return None
            if track.stage is Stage.ACT_FAILED and rule.on_failure == "hold":
                self._say(track, event, f"rule {rule.name}: a node action failed (or the node's annotation "
                          "turned them off); holding", logging.WARNING)
                return None
        prepares = rule is not None and rule.action == "approve" and bool(rule.prepare)
        if prepares and event.affects(vm.name) and track.stage in (Stage.WAITING, Stage.ACTED, Stage.ACT_FAILED):
            # Every affected VM prepares itself, leader or not: the leader's approval releases them all.
            assert rule is not None
            track.move(Stage.PREPARING)
            self._say(track, event, f"rule {rule.name}: running {len(rule.prepare)} prepare hook(s)")
            self._submit(self._prepare, rule, event, vm, track)
            return None
        if decision.action != "approve":
            self._say(track, event, decision.reason)
            return None
        assert rule is not None
        if rule.prepare and track.stage is Stage.HOOK_FAILED and rule.on_hook_failure == "hold":
            self._say(track, event, f"rule {rule.name}: a prepare hook failed; holding", logging.WARNING)
            return None
        if decision.earliest is not None and now < decision.earliest:
            self._say(track, event, f"{decision.reason}; not before "
                      f"{datetime.fromtimestamp(decision.earliest, tz=timezone.utc):%H:%M:%S}Z")
            return None
        if busy or now < track.next_attempt:
            return None
        return rule.name

    def _recheck(self, event: Event, track: Track, now: float) -> str | None:
        """An approved event still Scheduled: ask again after a while, while NotBefore is ahead."""
        assert track.approved_at is not None
        ahead = event.not_before is None or event.not_before.timestamp() > now
        if ahead and now - track.approved_at >= CONFIRM_AFTER and now >= track.next_attempt:
            self._say(track, event, f"still Scheduled {now - track.approved_at:.0f} s after approval; asking again")
            track.next_attempt = now + CONFIRM_AFTER
            return track.rule
        return None

    def _within_cap(self, batch: list[tuple[Event, str]], now: float) -> list[tuple[Event, str]]:
        """`batch` without the new approvals that would exceed max_approvals_per_hour (asking again for an
        approved event is not a new approval)."""
        cap = self.policy.max_approvals_per_hour
        if cap is None:
            return batch
        again = [item for item in batch if self._tracks[item[0].event_id].stage is Stage.APPROVED]
        fresh = [item for item in batch if self._tracks[item[0].event_id].stage is not Stage.APPROVED]
        while self._approvals and self._approvals[0] <= now - 3600:
            self._approvals.popleft()
        room = max(0, cap - len(self._approvals))
        if len(fresh) > room:
            if not self._cap_logged:
                log.warning("approval cap reached (%d per hour): holding %d event(s)", cap, len(fresh) - room)
                self._cap_logged = True
            fresh = fresh[:room]
        else:
            self._cap_logged = False
        self._approvals.extend([now] * len(fresh))
        return fresh + again

    # --- work on the pool ----------------------------------------------------------------------
    def _run_hooks(self, hooks: Sequence[Hook], kind: str, event: Event, vm: VmInfo, rule: str | None) -> bool:
        for hook in hooks:
            result = run_hook(hook, kind, event, vm, rule)
            self.metrics.hook_runs.labels(kind, result).inc()
            if result != "success":
                return False
        return True

    def _act(self, rule: Rule, event: Event, vm: VmInfo, track: Track, incarnation: int) -> None:
        assert self.actor is not None
        ok = False
        try:
            ok = self.actor.act(rule.node, event, self.dry_run, self._reporter(event, vm, rule.name, incarnation))
        except Exception:  # a bug must not leave the event acting forever: it counts as a failed action
            log.exception("node actions for event %s failed unexpectedly", event.event_id)
        with self._lock:
            if self._tracks.get(event.event_id) is track:
                track.move(Stage.ACTED if ok else Stage.ACT_FAILED)

    def _undo(self, undo: Undo) -> None:
        assert self.actor is not None
        event = undo.event
        report = self._reporter(event, undo.vm, None, undo.incarnation)
        failed = False

        def noting(outcome: ActionOutcome | DrainProgress) -> None:
            nonlocal failed
            failed = failed or (isinstance(outcome, ActionOutcome) and outcome.result == "failed")
            report(outcome)

        try:
            self.actor.undo(event.event_id, self.dry_run, noting)
        except Exception:
            log.exception("undoing the node actions of event %s failed unexpectedly", event.event_id)
            failed = True
        with self._lock:
            now = self.clock()
            if self._undos.get(event.event_id) is not undo:
                return
            if not failed:
                del self._undos[event.event_id]
                return
            undo.attempts += 1
            undo.running = False
            undo.next_attempt = now + self._undo_backoff.delay(undo.attempts - 1)
            if undo.next_attempt - undo.first_try > UNDO_RETRY_FOR:
                del self._undos[event.event_id]
                log.error("undoing the node actions of event %s still fails after %d attempts in %.0f s; giving "
                          "up: the node keeps what the annotation forewarn.io/applied lists for it", event.event_id,
                          undo.attempts, now - undo.first_try)
            else:
                log.warning("will try the undo of event %s again in %.0f s (attempt %d failed)", event.event_id,
                            undo.next_attempt - now, undo.attempts)

    def _reconcile(self, vm: VmInfo, incarnation: int) -> None:
        """Once per start: undo what the node holds for events no longer in the document (through `_undos`,
        so with the same retries, records and counts as any undo). Tried again at later polls, with backoff,
        while the node cannot be read, for up to UNDO_RETRY_FOR."""
        assert self.actor is not None
        try:
            held = list(self.actor.pending())
        except Exception as exc:  # an API error (or a bug): nothing is undone yet, so try again later
            with self._lock:
                now = self.clock()
                self._reconciling = False
                self._reconcile_attempts += 1
                first = self._first_reconcile = self._first_reconcile or now
                self._next_reconcile = now + self._undo_backoff.delay(self._reconcile_attempts - 1)
                given_up = self._next_reconcile - first > UNDO_RETRY_FOR
                if given_up:
                    self._reconciled = True
                    self._undone_here.clear()
            if given_up:
                log.error("cannot read what node %s holds from before this start (%s), still after %d attempts in "
                          "%.0f s; giving up: what the annotation forewarn.io/applied lists for events no longer in "
                          "the document stays", self.actor.node, exc, self._reconcile_attempts, now - first)
            else:
                log.warning("cannot read what node %s holds from before this start (%s); trying again in %.0f s",
                            self.actor.node, exc, self._next_reconcile - now)
            return
        with self._lock:
            now = self.clock()
            skipped = self._document_ids | self._undos.keys() | self._undone_here
            stale = [event_id for event_id in held if event_id not in skipped]
            for event_id in stale:
                undo = Undo(left_over(event_id, vm), vm, incarnation, first_try=now)
                self._undos[event_id] = undo
                self._submit(self._undo, undo)
            self._reconciled = True
            self._reconciling = False
            self._undone_here.clear()
            kept = [event_id for event_id in held if event_id in self._document_ids]
        if stale:
            log.warning("node %s still holds what forewarn applied for %d event(s) no longer in the document "
                        "(%s): undoing it", self.actor.node, len(stale), ", ".join(stale))
        if kept:
            log.info("node %s holds what forewarn applied for %s, still in the document: kept", self.actor.node,
                     ", ".join(kept))

    def _reporter(self, event: Event, vm: VmInfo, rule: str | None,
                  incarnation: int) -> Callable[[ActionOutcome | DrainProgress], None]:
        """Counts and records each outcome, and each step of a drain, as it comes (on the pool thread,
        outside the lock)."""
        assert self.actor is not None
        return recording_report(self.metrics, self.record, event, vm, self.actor.node, rule, incarnation, self.clock)

    def _prepare(self, rule: Rule, event: Event, vm: VmInfo, track: Track) -> None:
        ok = self._run_hooks(rule.prepare, "prepare", event, vm, rule.name)
        with self._lock:
            track.move(Stage.PREPARED if ok else Stage.HOOK_FAILED)

    def _start(self, batch: list[tuple[Event, str]], incarnation: int, vm: VmInfo) -> None:
        ids = [event.event_id for event, _ in batch]
        try:
            self.starter.start(ids)
        except StartError as exc:
            with self._lock:
                now = self.clock()
                for event, _ in batch:
                    self.metrics.approvals.labels(event.event_type, "failed").inc()
                    track = self._tracks.get(event.event_id)
                    if track is None or track.stage not in (Stage.STARTING, Stage.APPROVED):
                        continue  # left the document meanwhile (and may be back as a new event)
                    if track.stage is Stage.STARTING:
                        track.move(Stage.START_FAILED)
                    track.next_attempt = now + self._backoff.delay(track.attempts - 1)
            log.error("approval of %s failed (%s); will retry while the event is Scheduled and NotBefore "
                      "is ahead", ", ".join(ids), exc)
            return
        with self._lock:
            now = self.clock()
            fresh = []
            for event, rule in batch:
                track = self._tracks.get(event.event_id)
                if track is None or track.stage not in (Stage.STARTING, Stage.APPROVED):
                    continue  # left the document meanwhile (and may be back as a new event)
                if track.stage is Stage.STARTING:
                    track.move(Stage.APPROVED)
                    fresh.append((event, rule))
                track.approved_at = now
            records = self._approved(fresh, incarnation, vm, dry_run=False)
        if records:
            self.record(records)

    def _approved(self, batch: list[tuple[Event, str]], incarnation: int, vm: VmInfo,
                  dry_run: bool) -> list[Record]:
        """Count, log and build the records of the approvals in `batch` (the caller spools them)."""
        at = datetime.fromtimestamp(self.clock(), tz=timezone.utc)
        records = []
        for event, rule in batch:
            self.metrics.approvals.labels(event.event_type, "dry_run" if dry_run else "approved").inc()
            log.warning("%s event %s (%s, NotBefore %s) by rule %s", "DRY RUN: would approve" if dry_run
                        else "approved", event.event_id, event.event_type, event.raw.get("NotBefore") or "-", rule)
            records.append(approval_record(event, vm, rule, dry_run, incarnation, at))
        return records
