"""Carry out the policy: run prepare hooks, elect the approving VM, POST StartRequests, confirm.

Called after every good poll with the document and its changes. All slow work (hooks, the POST) runs on
a small thread pool, so polling and metrics never wait for it; the next poll picks up the results.
Every approval, sent or dry-run, becomes an `approved` record naming the rule that caused it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone

from forewarn.approval.hooks import run_hook
from forewarn.approval.policy import Hook, Policy, decide, first_match
from forewarn.imds.client import Backoff, ImdsClient, ImdsError
from forewarn.imds.document import Document, Event
from forewarn.imds.instance import VmInfo
from forewarn.metrics import Metrics
from forewarn.records import Record, to_record
from forewarn.tracker import Change, ChangeKind, Outcome

log = logging.getLogger(__name__)

#: How long an approved event may stay Scheduled before the approval is sent again.
CONFIRM_AFTER = 30.0


@dataclass
class _Track:
    """What the approver knows about one event."""

    first_seen: float
    hooks: str = "none"               # none, running, success, failed
    approved_at: float | None = None  # when IMDS acknowledged our POST
    dry_run_done: bool = False
    attempts: int = 0
    next_attempt: float = 0.0
    said: str = ""                    # the last decision logged, to log each change once
    rule: str = ""                    # the rule that approved it


class Approver:
    def __init__(self, policy: Policy, client: ImdsClient, metrics: Metrics,
                 record: Callable[[Sequence[Record]], None], dry_run: bool = False,
                 clock: Callable[[], float] = time.time, workers: int = 4) -> None:
        self.policy = policy
        self.client = client
        self.metrics = metrics
        self.record = record
        self.dry_run = dry_run or policy.dry_run
        self.clock = clock
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="approver")
        self._lock = threading.Lock()
        self._tracks: dict[str, _Track] = {}
        self._posting = False
        self._approvals: collections.deque[float] = collections.deque()
        self._backoff = Backoff(base=2.0, cap=30.0)
        self._cap_logged = False

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def replace_policy(self, policy: Policy, dry_run: bool = False) -> None:
        """Decide by `policy` from the next poll on (SIGHUP). Hooks and POSTs already on the pool finish
        as they began. `dry_run` is --dry-run, which a policy can add to but not take away."""
        with self._lock:
            self.policy = policy
            self.dry_run = dry_run or policy.dry_run

    # --- called by the collector after every good poll -----------------------------------------
    def on_changes(self, document: Document, changes: Sequence[Change], vm: VmInfo) -> None:
        now = self.clock()
        with self._lock:
            for change in changes:
                if change.kind is ChangeKind.REMOVED:
                    self._tracks.pop(change.event.event_id, None)
                    if change.outcome is Outcome.COMPLETED and change.event.affects(vm.name) and self.policy.recover:
                        self._pool.submit(self._run_hooks, self.policy.recover, "recover", change.event, vm, None)
            batch: list[tuple[Event, str]] = []
            for event in document.events:
                track = self._tracks.setdefault(event.event_id, _Track(first_seen=now))
                rule_name = self._consider(event, track, vm, now)
                if rule_name is not None:
                    batch.append((event, rule_name))
            batch = self._within_cap(batch, now)
            if not batch:
                return
            if self.dry_run:
                for event, _ in batch:
                    self._tracks[event.event_id].dry_run_done = True
                self._approved(batch, document.incarnation, vm, dry_run=True)
            elif not self._posting:
                self._posting = True
                for event, _ in batch:
                    self._tracks[event.event_id].attempts += 1
                self._pool.submit(self._post, batch, document.incarnation, vm)

    def _say(self, track: _Track, event: Event, text: str, level: int = logging.INFO) -> None:
        if text != track.said:
            track.said = text
            log.log(level, "event %s (%s %s): %s", event.event_id, event.event_type, event.status, text)

    def _consider(self, event: Event, track: _Track, vm: VmInfo, now: float) -> str | None:
        """The rule to approve `event` under now, or None; starts prepare hooks on the way."""
        if event.status != "Scheduled":
            if track.approved_at is not None:
                self._say(track, event, f"approval confirmed: {event.status}")
            return None
        if track.dry_run_done:
            return None
        if track.approved_at is not None:
            return self._recheck(event, track, now)
        rule, _ = first_match(self.policy, event, vm.name, now)
        prepares = rule is not None and rule.action == "approve" and bool(rule.prepare)
        if prepares and event.affects(vm.name) and track.hooks == "none":
            # Every affected VM prepares itself, leader or not: the leader's approval releases them all.
            assert rule is not None
            track.hooks = "running"
            self._say(track, event, f"rule {rule.name}: running {len(rule.prepare)} prepare hook(s)")
            self._pool.submit(self._prepare, rule.prepare, event, vm, rule.name, track)
        decision = decide(self.policy, event, vm.name, now, track.first_seen)
        if decision.action != "approve":
            self._say(track, event, decision.reason)
            return None
        assert rule is not None
        if rule.prepare:
            if track.hooks == "running":
                return None
            if track.hooks == "failed" and rule.on_hook_failure == "hold":
                self._say(track, event, f"rule {rule.name}: a prepare hook failed; holding", logging.WARNING)
                return None
        if decision.earliest is not None and now < decision.earliest:
            self._say(track, event, f"{decision.reason}; not before "
                      f"{datetime.fromtimestamp(decision.earliest, tz=timezone.utc):%H:%M:%S}Z")
            return None
        if now < track.next_attempt:
            return None
        return rule.name

    def _recheck(self, event: Event, track: _Track, now: float) -> str | None:
        """An approved event still Scheduled: ask again after a while, while NotBefore is ahead."""
        assert track.approved_at is not None
        ahead = event.not_before is None or event.not_before.timestamp() > now
        if ahead and now - track.approved_at >= CONFIRM_AFTER and now >= track.next_attempt:
            self._say(track, event, f"still Scheduled {now - track.approved_at:.0f} s after approval; asking again")
            track.next_attempt = now + CONFIRM_AFTER
            return track.rule
        return None

    def _within_cap(self, batch: list[tuple[Event, str]], now: float) -> list[tuple[Event, str]]:
        cap = self.policy.max_approvals_per_hour
        retries = [item for item in batch if self._tracks[item[0].event_id].approved_at is not None]
        fresh = [item for item in batch if self._tracks[item[0].event_id].approved_at is None]
        if cap is None:
            return batch
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
        return fresh + retries

    # --- work on the pool ----------------------------------------------------------------------
    def _run_hooks(self, hooks: Sequence[Hook], kind: str, event: Event, vm: VmInfo, rule: str | None) -> bool:
        for hook in hooks:
            result = run_hook(hook, kind, event, vm, rule)
            self.metrics.hook_runs.labels(kind, result).inc()
            if result != "success":
                return False
        return True

    def _prepare(self, hooks: Sequence[Hook], event: Event, vm: VmInfo, rule: str, track: _Track) -> None:
        ok = self._run_hooks(hooks, "prepare", event, vm, rule)
        with self._lock:
            track.hooks = "success" if ok else "failed"

    def _post(self, batch: list[tuple[Event, str]], incarnation: int, vm: VmInfo) -> None:
        ids = [event.event_id for event, _ in batch]
        try:
            self.client.start_events(ids)
        except ImdsError as exc:
            now = self.clock()
            with self._lock:
                self._posting = False
                for event, _ in batch:
                    self.metrics.approvals.labels(event.event_type, "failed").inc()
                    track = self._tracks.get(event.event_id)
                    if track is not None:
                        track.next_attempt = now + self._backoff.delay(track.attempts - 1)
                log.error("approval of %s failed (%s); will retry while the event is Scheduled and NotBefore "
                          "is ahead", ", ".join(ids), exc)
            return
        with self._lock:
            self._posting = False
            now = self.clock()
            fresh = []
            for event, rule in batch:
                track = self._tracks.get(event.event_id)
                if track is not None and track.approved_at is None:
                    fresh.append((event, rule))
                if track is not None:
                    track.approved_at = now
                    track.rule = rule
            self._approved(fresh, incarnation, vm, dry_run=False)

    def _approved(self, batch: list[tuple[Event, str]], incarnation: int, vm: VmInfo, dry_run: bool) -> None:
        if not batch:
            return
        observed = datetime.fromtimestamp(self.clock(), tz=timezone.utc)
        records = []
        for event, rule in batch:
            self.metrics.approvals.labels(event.event_type, "dry_run" if dry_run else "approved").inc()
            log.warning("%s event %s (%s, NotBefore %s) by rule %s", "DRY RUN: would approve" if dry_run
                        else "approved", event.event_id, event.event_type, event.raw.get("NotBefore") or "-", rule)
            change = Change(ChangeKind.APPROVED, event, incarnation)
            records.append(to_record(change, vm, observed, extra={"policy_rule": rule, "dry_run": dry_run}))
        self.record(records)
