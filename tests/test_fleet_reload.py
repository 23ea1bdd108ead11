"""What fleet mode does after a commit fails and its tracker is read back from the saved state (#38's review): the
term's complete snapshots start again, so an event the saved state lacks is not taken as over; a state that cannot
be read holds every action until it can; the saved rows keep that Resource Graph listed an event; with a policy, a
full outbox takes the news over its bound, so the policy still sees new events; the sources stay ready while they
wait for room."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from forewarn.approval.policy import parse_policy
from forewarn.fleet.approval import FleetApprover
from forewarn.fleet.feed import FleetEvent, parse_event_grid, parse_resource_graph_row
from forewarn.fleet.metrics import FleetMetrics
from forewarn.fleet.service import FleetCommitter, fleet_overflow, wait_for_room
from forewarn.fleet.state import OPEN, PREFIX, all_rows, changed_state, load, row_key
from forewarn.fleet.tracker import FleetTracker, FleetView, event_key
from forewarn.outbox.outbox import Outbox, OutboxFull, Overflow, StoreError
from forewarn.poller import OutboxMetrics
from forewarn.records import JsonRecords, Record
from forewarn.tracker import ChangeKind
from test_fleet_service import SUBS, grid, row

DRY_RUN_POLICY = """
rules:
  - name: reboots
    action: approve
    match: {event_type: [Reboot]}
"""


def listed(n: int) -> FleetEvent:
    return parse_resource_graph_row(row(SUBS[n % 3], n))


class Fleet:
    """A committer over an outbox of `bound` records in memory, with its own clock and a sink "s"."""

    def __init__(self, bound: int, overflow: Overflow = "refuse") -> None:
        self.metrics = FleetMetrics(["resourcegraph"])
        self.outbox = Outbox(None, ["s"], max_records=bound, observer=OutboxMetrics(self.metrics,
                             self.metrics.outbox_refused), overflow=overflow)
        self.now = 1000.0
        self.committer = FleetCommitter(self.outbox, self.metrics, clock=lambda: self.now)
        self.committer.snapshots_expected = True

    def snapshot(self, events: Sequence[FleetEvent]) -> None:
        self.now += 10
        self.committer.snapshot(events, started_at=self.now - 5, complete=True)

    def drain(self) -> None:
        batch = self.outbox.take("s", 100_000)
        if batch.last:
            self.outbox.ack("s", batch.last)


def test_a_reload_that_cannot_read_a_row_holds_every_action_and_one_that_can_restarts_the_snapshots() -> None:
    """E and M open, two complete snapshots in this term. E's saved row is damaged, then a snapshot is cut short
    by the full outbox: the reload refuses the damaged row, so the tracker in memory is kept, no event is over,
    nothing may be done to nodes and no commit goes in. Once the row reads again, the reload goes through, and M,
    which the saved state lacks now, is not over before two complete snapshots taken after the reload lack it."""
    fleet = Fleet(bound=150)
    committer, outbox = fleet.committer, fleet.outbox
    e, m = listed(0), listed(1)
    try:
        fleet.snapshot([e, m])
        fleet.snapshot([e, m])
        fleet.drain()
        assert committer.complete_snapshots == 2
        outbox.append([], state={row_key(OPEN, event_key(e)): "{not json"})
        with pytest.raises(OutboxFull):   # its first slice of 100 fits, the second does not
            fleet.snapshot([e, m, *(listed(n) for n in range(2, 250))])
        view = committer.view()
        assert view.held is not None and "not json" not in view.held and "row" in view.held
        assert not view.over(e.event_id) and not view.over(m.event_id) and not view.ready_for_nodes
        with pytest.raises(StoreError):
            committer.news([listed(300)])
        assert committer.view().held is not None
        # The row repaired, M's lost: the next commit reads the state back first.
        fleet.drain()
        outbox.append([], state={**all_rows(FleetTracker([e])), row_key(OPEN, event_key(m)): None})
        committer.news([])
        view = committer.view()
        assert view.held is None and view.complete_snapshots == 0 and view.ready_for_nodes is False
        assert event_key(e) in {event_key(event) for event in view.open_events}
        assert not view.over(m.event_id), "M is over after a reload, with no complete snapshot since"
        fleet.snapshot([e])
        assert not committer.view().over(m.event_id)
        fleet.snapshot([e])
        assert committer.view().over(m.event_id)
    finally:
        outbox.close()


def test_a_state_the_store_cannot_read_back_holds_every_action() -> None:
    fleet = Fleet(bound=150)
    committer, outbox = fleet.committer, fleet.outbox
    e = listed(0)
    fleet.snapshot([e])
    fleet.snapshot([e])
    outbox.close()   # every read and write of the store fails from now on
    with pytest.raises(StoreError):
        committer.news([listed(1)])
    view = committer.view()
    assert view.held is not None and view.complete_snapshots == 0
    assert not view.over(e.event_id) and not view.over(listed(1).event_id) and not view.ready_for_nodes
    with pytest.raises(StoreError):
        fleet.snapshot([e])


def test_the_approver_holds_every_approval_while_the_open_events_are_not_known() -> None:
    event = listed(0)
    records: list[Record] = []
    held: list[str | None] = ["the saved fleet state cannot be read"]
    approver = FleetApprover(parse_policy(DRY_RUN_POLICY, fleet=True), None,
                             lambda: FleetView((event,), held=held[0]), records.extend,
                             FleetMetrics(["resourcegraph"]).approvals, dry_run=True)
    approver.step(threading.Event())
    assert records == []
    held[0] = None
    approver.step(threading.Event())
    assert [(r.data["policy_rule"], r.data["dry_run"]) for r in records] == [("reboots", True)]


def pushed(n: int) -> FleetEvent:
    (event,) = parse_event_grid(json.dumps([grid(SUBS[n % 3], n, "Scheduled", f"d-{n}")]).encode()).events
    return event


def test_that_resource_graph_listed_an_event_survives_a_restart_so_its_absence_still_ends_it(tmp_path: Path) -> None:
    """An event first pushed, then listed by a snapshot without a change: the saved row says it was listed, so the
    tracker read back ends it once two complete snapshots lack it. A row saved before `listed` was (no such key)
    reads as not listed: such an event waits for its final status."""
    outbox = Outbox(tmp_path, ["s"])
    try:
        tracker = FleetTracker()
        e = pushed(0)
        assert e.origin == "eventgrid" and listed(0).origin == "resourcegraph"
        outbox.append([], state=changed_state(tracker.apply(e, now=1), tracker))
        changes = tracker.apply_snapshot([listed(0)], started_at=2, now=2, complete=False)
        assert changes == [] and tracker.was_listed(event_key(e))
        outbox.append([], state=changed_state(changes, tracker))
        restarted = load(outbox.load_states(PREFIX), now=3)
        assert restarted.was_listed(event_key(e))
        ended = [change for when in (10, 20)
                 for change in restarted.apply_snapshot([], started_at=when, now=when, complete=True)]
        assert [(change.kind, change.event.event_id) for change in ended] == [(ChangeKind.REMOVED, e.event_id)]
        # A row written without `listed`: not listed, so never ended by its absence.
        key = row_key(OPEN, event_key(e))
        old = json.loads(outbox.load_states(PREFIX)[key])
        del old["listed"]
        outbox.append([], state={key: json.dumps(old)})
        older = load(outbox.load_states(PREFIX), now=3)
        assert not older.was_listed(event_key(e))
        assert [change for when in (10, 20) for change in older.apply_snapshot([], when, when, complete=True)] == []
    finally:
        outbox.close()


def test_a_snapshot_that_lists_a_pushed_event_unchanged_saves_that_it_did() -> None:
    fleet = Fleet(bound=150)
    try:
        fleet.committer.news([pushed(0)])
        fleet.snapshot([listed(0)])
        assert load(fleet.outbox.load_states(PREFIX), now=0).was_listed(event_key(pushed(0)))
    finally:
        fleet.outbox.close()


def test_with_a_policy_a_full_outbox_takes_news_over_its_bound_and_a_new_event_is_approved() -> None:
    """A sink that takes nothing and an outbox of 5 records, full. Without a policy, the news of a new Reboot is
    refused (back-pressure); with one, it goes in over the bound (shown by the outbox's count), the tracker has
    it, and the policy approves it (dry run, as --dry-run does)."""
    policy = parse_policy(DRY_RUN_POLICY, fleet=True)
    assert fleet_overflow(None) == "refuse"
    without = Fleet(bound=5, overflow=fleet_overflow(None))
    try:
        without.committer.news([listed(n) for n in range(5)])
        with pytest.raises(OutboxFull):
            without.committer.news([listed(5)])
    finally:
        without.outbox.close()
    fleet = Fleet(bound=5, overflow=fleet_overflow(policy))
    committer, outbox = fleet.committer, fleet.outbox
    committer.snapshots_expected = False
    approvals = fleet.metrics.approvals
    approver = FleetApprover(policy, None, committer.view, lambda records: outbox.append(records, overflow="exceed"),
                             approvals, dry_run=True, clock=lambda: fleet.now)
    try:
        committer.news([listed(n) for n in range(5)])
        assert outbox.stored == 5
        new = listed(5)
        assert [change.kind for change in committer.news([new])] == [ChangeKind.ADDED]
        approver.step(threading.Event())
        assert approvals.labels("Reboot", "dry_run").value == 6
        text = fleet.metrics.render()[0].decode()
        assert "azure_scheduled_events_outbox_stored_records 12.0" in text   # 6 changes, 6 decisions
        subjects = [record.subject for record in outbox.take("s", 100).records]
        assert subjects.count(new.event_id) == 2   # its `added` and its decision
    finally:
        outbox.close()


def test_a_source_waiting_for_room_stays_ready() -> None:
    """wait_for_room tells that the source is alive every second while it waits (QueueReader and
    ResourceGraphSource pass `source_succeeded`), so /readyz stays ready however long the sinks take."""
    fleet = Fleet(bound=4)
    beats: list[float] = []
    stop = threading.Event()
    try:
        fleet.committer.news([listed(n) for n in range(4)])
        with pytest.raises(OutboxFull) as refused:
            fleet.committer.news([listed(9)])
        waiter = threading.Thread(target=wait_for_room, args=(fleet.outbox, refused.value, stop, "a test",
                                                              lambda: beats.append(time.monotonic())))
        waiter.start()
        deadline = time.monotonic() + 10
        while len(beats) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(beats) >= 2 and waiter.is_alive()
        fleet.drain()
        waiter.join(5)
        assert not waiter.is_alive()
    finally:
        stop.set()
        fleet.outbox.close()


def test_refuse_if_full_reads_the_store_not_a_count_another_writer_left_behind(tmp_path: Path) -> None:
    """Two outboxes on one state dir: what one acknowledges, the other's count does not see; its refusal must."""
    writer = Outbox(tmp_path, ["s"], max_records=4, overflow="refuse")
    other = Outbox(tmp_path, ["s"], max_records=4, overflow="refuse")
    try:
        writer.append(JsonRecords([f'{{"n": {n}}}' for n in range(4)]))
        with pytest.raises(OutboxFull):
            writer.refuse_if_full()
        other.ack("s", other.take("s", 10).last)
        assert writer.stored == 4
        writer.refuse_if_full()
    finally:
        writer.close()
        other.close()
