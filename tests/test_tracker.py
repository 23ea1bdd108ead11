from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from forewarn.imds.document import parse_document
from forewarn.tracker import ChangeKind, Outcome, Tracker, diff_documents

from strategies import raw_documents


def doc(incarnation: int, *events: dict[str, Any]) -> Any:
    return parse_document({"DocumentIncarnation": incarnation, "Events": list(events)})


def ev(event_id: str, status: str = "Scheduled", **fields: Any) -> dict[str, Any]:
    return {"EventId": event_id, "EventType": "Reboot", "ResourceType": "VirtualMachine", "Resources": ["vm-0"],
            "EventStatus": status, "NotBefore": "" if status == "Started" else "Mon, 11 Apr 2022 22:26:58 GMT",
            "EventSource": "Platform", "DurationInSeconds": -1, **fields}


def test_first_document_reports_every_event_as_added() -> None:
    changes = diff_documents(None, doc(3, ev("a"), ev("b", "Started")))
    assert [(c.kind, c.event.event_id) for c in changes] == [(ChangeKind.ADDED, "a"), (ChangeKind.ADDED, "b")]
    assert all(c.incarnation == 3 for c in changes)


def test_status_change_is_an_update_with_the_previous_status() -> None:
    (change,) = diff_documents(doc(1, ev("a")), doc(2, ev("a", "Started")))
    assert change.kind is ChangeKind.UPDATED
    assert change.previous is not None and change.previous.status == "Scheduled"
    assert change.event.status == "Started"


def test_any_field_change_is_an_update() -> None:
    (change,) = diff_documents(doc(1, ev("a")), doc(2, ev("a", NotBefore="Mon, 11 Apr 2022 23:00:00 GMT")))
    assert change.kind is ChangeKind.UPDATED and change.previous is not None
    assert change.previous.status == change.event.status == "Scheduled"


def test_event_gone_after_started_is_completed() -> None:
    (change,) = diff_documents(doc(2, ev("a", "Started")), doc(3))
    assert change.kind is ChangeKind.REMOVED and change.outcome is Outcome.COMPLETED
    assert change.event.event_id == "a" and change.incarnation == 3


def test_cancelled_event_is_reported_as_cancelled() -> None:
    (change,) = diff_documents(doc(2, ev("a")), doc(3))
    assert change.kind is ChangeKind.REMOVED and change.outcome is Outcome.CANCELLED


def test_same_incarnation_twice_is_a_no_op() -> None:
    tracker = Tracker()
    assert len(tracker.apply(doc(5, ev("a")))) == 1
    assert tracker.apply(doc(5, ev("a"))) == []
    assert tracker.current is not None and tracker.current.incarnation == 5


def test_all_events_of_one_document_are_handled_together() -> None:
    before = doc(1, ev("gone"), ev("stays"), ev("moves"))
    after = doc(2, ev("stays"), ev("moves", "Started"), ev("new"))
    kinds = [(c.kind, c.event.event_id) for c in diff_documents(before, after)]
    assert kinds == [(ChangeKind.REMOVED, "gone"), (ChangeKind.UPDATED, "moves"), (ChangeKind.ADDED, "new")]


def replay(start: dict[str, dict[str, Any]], changes: list[Any]) -> dict[str, dict[str, Any]]:
    state = dict(start)
    for change in changes:
        if change.kind is ChangeKind.REMOVED:
            del state[change.event.event_id]
        else:
            state[change.event.event_id] = dict(change.event.raw)
    return state


@given(st.lists(raw_documents(), min_size=1, max_size=6))
def test_replaying_changes_rebuilds_the_last_document(raws: list[dict[str, Any]]) -> None:
    tracker = Tracker()
    state: dict[str, dict[str, Any]] = {}
    for i, raw in enumerate(raws):
        raw["DocumentIncarnation"] = i + 1
        state = replay(state, tracker.apply(parse_document(raw)))
    assert state == {e["EventId"]: e for e in raws[-1]["Events"]}


@given(raw_documents(incarnation=1), raw_documents(incarnation=2))
def test_each_event_gets_at_most_one_change_per_document(a: dict[str, Any], b: dict[str, Any]) -> None:
    changes = diff_documents(parse_document(a), parse_document(b))
    ids = [c.event.event_id for c in changes]
    assert len(ids) == len(set(ids))
    removed = {c.event.event_id for c in changes if c.kind is ChangeKind.REMOVED}
    assert removed == {e["EventId"] for e in a["Events"]} - {e["EventId"] for e in b["Events"]}
    for change in changes:
        if change.kind is ChangeKind.REMOVED:
            expected = Outcome.CANCELLED if change.event.status == "Scheduled" else Outcome.COMPLETED
            assert change.outcome is expected
