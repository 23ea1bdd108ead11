"""The fleet tracker: one state per (resource, EventId) that only moves forward, whichever feed, order or
repeat the news comes in; ended events stay ended; snapshots end what they no longer list, twice in a row."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

from hypothesis import given, settings
from hypothesis import strategies as st

from forewarn.fleet.feed import FleetEvent
from forewarn.fleet.tracker import MAX_DELIVERY_IDS, EndedBy, FleetTracker, fingerprint
from forewarn.imds.document import Event
from forewarn.tracker import ChangeKind, Outcome

SUB = "11111111-2222-3333-4444-555555555555"
VMSS = f"/subscriptions/{SUB}/resourceGroups/rg-a/providers/Microsoft.Compute/virtualMachineScaleSets/pool"
NOT_BEFORE = datetime(2026, 11, 24, 12, 0, tzinfo=timezone.utc)


def news(status: str = "Scheduled", event_id: str = "E-1", resource: str = VMSS, delivery: str | None = None,
         not_before: datetime | None = NOT_BEFORE, resources: tuple[str, ...] = ("pool_0", "pool_1"),
         origin: str = "eventgrid") -> FleetEvent:
    raw = {"EventId": event_id, "EventType": "Reboot", "EventStatus": status, "Resources": list(resources)}
    event = Event(event_id=event_id, event_type="Reboot", status=status, resource_type="VirtualMachine",
                  resources=resources, not_before=not_before if status == "Scheduled" else None,
                  description="Host maintenance", source="Platform", duration_seconds=-1, raw=raw)
    return FleetEvent(resource_id=resource, subscription_id=SUB, resource_group="rg-a", event=event,
                      origin=origin, delivery_id=delivery)


def kinds(changes: list) -> list[str]:
    return [str(change.kind) for change in changes]


def test_the_lifecycle_gives_added_updated_removed() -> None:
    tracker = FleetTracker()
    assert kinds(tracker.apply(news("Scheduled"), now=1)) == ["added"]
    changes = tracker.apply(news("Started"), now=2)
    assert kinds(changes) == ["updated"] and changes[0].previous is not None
    assert changes[0].previous.status == "Scheduled"
    (ended,) = tracker.apply(news("Completed"), now=3)
    assert (ended.kind, ended.outcome, ended.ended_by) == (ChangeKind.REMOVED, Outcome.COMPLETED, EndedBy.STATUS)
    assert tracker.open_events == []


def test_statuses_only_move_forward_and_nothing_follows_the_end() -> None:
    tracker = FleetTracker()
    tracker.apply(news("Scheduled"), now=1)
    tracker.apply(news("Started"), now=2)
    assert tracker.apply(news("Scheduled"), now=3) == []          # late news
    assert [e.status for e in tracker.open_events] == ["Started"]
    assert kinds(tracker.apply(news("Canceled"), now=4)) == ["removed"]
    for status in ("Scheduled", "Started", "Completed", "Canceled"):
        assert tracker.apply(news(status), now=5) == []          # after the end
    assert tracker.stale == 5


def test_the_same_news_from_another_feed_or_in_another_case_is_no_change() -> None:
    tracker = FleetTracker()
    tracker.apply(news(delivery="d-1"), now=1)
    assert tracker.apply(news(delivery="d-1"), now=2) == []                 # Event Grid's repeat
    assert tracker.duplicates == 1
    assert tracker.apply(news(origin="resourcegraph"), now=3) == []          # the snapshot's copy
    assert tracker.apply(news(resource=VMSS.upper(), event_id="e-1"), now=4) == []  # ARM IDs ignore case
    moved = tracker.apply(news(not_before=NOT_BEFORE + timedelta(minutes=5)), now=5)
    assert kinds(moved) == ["updated"]                                       # a documented field changed


def test_an_event_first_heard_of_at_its_end_is_one_removed_record() -> None:
    tracker = FleetTracker()
    (change,) = tracker.apply(news("Canceled"), now=1)
    assert (change.kind, change.previous, change.outcome) == (ChangeKind.REMOVED, None, Outcome.CANCELLED)
    assert tracker.apply(news("Canceled", delivery="another"), now=2) == []


def test_ended_events_survive_a_restart() -> None:
    before = FleetTracker()
    before.apply(news("Scheduled", event_id="E-open"), now=1)
    before.apply(news("Completed", event_id="E-done"), now=1)
    after = FleetTracker(before.open_events, before.ended_keys, now=10)
    assert after.apply(news("Completed", event_id="E-done"), now=11) == []   # not reported twice
    assert after.apply(news("Scheduled", event_id="E-open"), now=11) == []   # known and unchanged
    assert kinds(after.apply(news("Started", event_id="E-open"), now=12)) == ["updated"]


def test_a_snapshot_ends_an_event_missing_twice_in_a_row_and_says_so() -> None:
    tracker = FleetTracker()
    tracker.apply(news("Started", event_id="E-gone"), now=1)
    tracker.apply(news("Scheduled", event_id="E-stays"), now=1)
    stays = news("Scheduled", event_id="E-stays", origin="resourcegraph")
    gone = news("Started", event_id="E-gone", origin="resourcegraph")
    assert tracker.apply_snapshot([stays, gone], started_at=3, now=4) == []  # Resource Graph lists both
    assert tracker.apply_snapshot([stays], started_at=5, now=6) == []       # missing once: kept
    assert tracker.apply_snapshot([stays], started_at=7, now=8, complete=False) == []  # a partial one: no count
    (ended,) = tracker.apply_snapshot([stays], started_at=9, now=10)
    assert ended.event.event_id == "E-gone" and ended.ended_by is EndedBy.MISSING
    assert ended.outcome is Outcome.COMPLETED  # it had started
    assert [e.event_id for e in tracker.open_events] == ["E-stays"]


def test_an_event_resource_graph_never_listed_is_not_ended_by_its_absence_but_by_its_final_status() -> None:
    """Resource Graph's lag behind the queue and the push is not documented: an event known only from them
    is not over because snapshots lack it, however many; its Completed or Canceled ends it."""
    tracker = FleetTracker()
    tracker.apply(news("Scheduled", event_id="E-new"), now=1)
    for start in range(2, 12, 2):
        assert tracker.apply_snapshot([], started_at=start, now=start + 1) == []
    assert [e.event_id for e in tracker.open_events] == ["E-new"]
    (ended,) = tracker.apply(news("Completed", event_id="E-new"), now=20)
    assert ended.ended_by is EndedBy.STATUS and tracker.has_ended("e-new")


def test_a_snapshot_does_not_end_what_came_by_push_while_it_ran() -> None:
    tracker = FleetTracker()
    tracker.apply_snapshot([news(event_id="E-new", origin="resourcegraph")], started_at=1, now=2)
    tracker.apply(news("Scheduled", event_id="E-new", not_before=NOT_BEFORE + timedelta(minutes=5)), now=5.5)
    assert tracker.apply_snapshot([], started_at=5, now=6) == []
    assert tracker.apply_snapshot([], started_at=7, now=8) == []           # first miss counted here
    (ended,) = tracker.apply_snapshot([], started_at=9, now=10)
    assert ended.outcome is Outcome.CANCELLED  # it never started


def test_a_listed_event_resets_its_misses() -> None:
    tracker = FleetTracker()
    tracker.apply(news(origin="resourcegraph"), now=1)
    tracker.apply_snapshot([], started_at=2, now=3)
    tracker.apply_snapshot([news(origin="resourcegraph")], started_at=4, now=5)
    assert tracker.apply_snapshot([], started_at=6, now=7) == []
    assert len(tracker.open_events) == 1


def test_delivery_ids_are_remembered_within_a_bound() -> None:
    tracker = FleetTracker()
    for number in range(MAX_DELIVERY_IDS + 10):
        tracker.apply(news(delivery=f"d-{number}", event_id=f"E-{number % 3}"), now=1)
    assert len(tracker._deliveries) == MAX_DELIVERY_IDS


STATUSES = ("Scheduled", "Started", "Completed", "Canceled")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(STATUSES), st.integers(0, 3)), min_size=1, max_size=12),
       st.randoms(use_true_random=False))
def test_any_order_and_repeats_give_at_most_one_record_per_change_and_one_end(
        sequence: list[tuple[str, int]], rng: random.Random) -> None:
    """Whatever order and repeats the feeds deliver in, the changes of one event are: at most one added, no
    status going backwards, at most one removed and nothing after it; the same change twice is one change."""
    tracker = FleetTracker()
    seen: list = []
    for status, copy in sequence:
        delivery = f"{status}-{copy}" if rng.random() < 0.5 else None
        seen += tracker.apply(news(status, delivery=delivery), now=1)
    assert kinds(seen).count("added") <= 1 and kinds(seen).count("removed") <= 1
    if "removed" in kinds(seen):
        assert kinds(seen)[-1] == "removed"
    ranks = [{"Scheduled": 0, "Started": 1}.get(c.event.status, 2) for c in seen]
    assert ranks == sorted(ranks)
    fingerprints = [c.fingerprint for c in seen]
    assert len(fingerprints) == len(set(fingerprints))


def test_the_fingerprint_is_the_documented_fields_only() -> None:
    one, other = news(origin="eventgrid", delivery="x"), news(origin="resourcegraph")
    assert fingerprint(one) == fingerprint(other)
    assert fingerprint(news("Started")) != fingerprint(one)
