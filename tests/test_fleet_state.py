"""The fleet tracker saved one row per event in the outbox's transaction, and read back: the same open events,
the same ended ones, so a restart reports nothing twice; each commit writes only what its changes touched; a
damaged or hostile row is refused through the feeds' boundary and left out, the rest kept."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from pathlib import Path

import pytest

from forewarn.fleet import tracker as tracker_module
from forewarn.fleet.feed import FleetEvent
from forewarn.fleet.state import ENDED, OPEN, PREFIX, all_rows, changed_state, load, row_key
from forewarn.fleet.tracker import FleetTracker, event_key
from forewarn.imds.document import Event
from forewarn.outbox.outbox import Outbox

SUB = "11111111-2222-3333-4444-555555555555"
VMSS = f"/subscriptions/{SUB}/resourceGroups/rg-a/providers/Microsoft.Compute/virtualMachineScaleSets/pool"


def news(status: str, event_id: str, delivery: str | None = None) -> FleetEvent:
    raw = {"EventId": event_id, "EventType": "Freeze", "EventStatus": status, "ResourceType": "VirtualMachine",
           "Resources": ["pool_0"], "NotBefore": "Tue, 24 Nov 2026 12:00:00 GMT" if status == "Scheduled" else "",
           "Description": "", "EventSource": "Platform", "DurationInSeconds": 9, "Unknown": {"kept": True}}
    event = Event(event_id, "Freeze", status, "VirtualMachine", ("pool_0",),
                  datetime(2026, 11, 24, 12, tzinfo=timezone.utc) if status == "Scheduled" else None,
                  "", "Platform", 9, raw=raw)
    return FleetEvent(VMSS, SUB, "rg-a", event, "eventgrid", delivery_id=delivery, location="westeurope",
                      event_time=datetime(2026, 11, 24, 10, 0, 0, 123456, tzinfo=timezone.utc))


def commit(outbox: Outbox, tracker: FleetTracker, *events: FleetEvent) -> dict[str, str | None]:
    changes = [change for event in events for change in tracker.apply(event, now=1)]
    rows = changed_state(changes, tracker)
    outbox.append([], state=rows)
    return rows


def test_a_restart_from_the_saved_rows_reports_nothing_twice(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path, ["stdout"])
    tracker = FleetTracker()
    commit(outbox, tracker, news("Scheduled", "E-open", delivery="d-1"), news("Started", "E-started"))
    rows = commit(outbox, tracker, news("Canceled", "E-ended"), news("Scheduled", "E-gone"))
    assert set(rows) == {row_key(ENDED, event_key(news("Canceled", "E-ended"))),
                         row_key(OPEN, event_key(news("Scheduled", "E-gone")))}  # only what changed
    rows = commit(outbox, tracker, news("Completed", "E-gone"))
    assert rows[row_key(OPEN, event_key(news("Completed", "E-gone")))] is None       # its row removed
    outbox.close()
    again = load(Outbox(tmp_path, ["stdout"]).load_states(PREFIX), now=5)
    assert sorted(e.event_id for e in again.open_events) == ["E-open", "E-started"]
    restored = next(e for e in again.open_events if e.event_id == "E-open")
    original = next(e for e in tracker.open_events if e.event_id == "E-open")
    assert restored == original  # the same resource, event (fields and raw), feed, delivery id, time
    assert dict(restored.event.raw) == dict(original.event.raw)
    assert again.apply(news("Scheduled", "E-open"), now=6) == []
    assert again.apply(news("Canceled", "E-ended"), now=6) == []
    assert again.apply(news("Completed", "E-gone"), now=6) == []
    assert [str(c.kind) for c in again.apply(news("Completed", "E-started"), now=6)] == ["removed"]


def test_ended_events_the_memory_lets_go_leave_the_saved_state(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracker_module, "MAX_ENDED", 2)
    outbox = Outbox(tmp_path, ["stdout"])
    tracker = FleetTracker()
    for n in range(4):
        commit(outbox, tracker, news("Canceled", f"E-{n}"))
    saved = outbox.load_states(ENDED)
    assert sorted(key.rsplit("\n", 1)[1] for key in saved) == ["e-2", "e-3"]
    outbox.close()


@pytest.mark.parametrize("text, says", [
    ("not json", "saved fleet state"),
    (json.dumps([1]), "not an object"),
    (json.dumps({"id": "/not/an/arm/id", "properties": {}}), "left out"),
    ('{"id": "x", "properties": {"DurationInSeconds": NaN}}', "left out"),
    ("[" * 100_000, "left out"),
    (json.dumps({**json.loads(all_rows(FleetTracker([news("Scheduled", "E-x")]))[
        row_key(OPEN, event_key(news("Scheduled", "E-x")))] or "{}"), "feed": "somewhere"}), "wrong kind"),
])
def test_a_damaged_row_is_left_out_with_a_clear_error_and_the_rest_is_kept(
        text: str, says: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, "forewarn.fleet.state")
    good = all_rows(FleetTracker([news("Scheduled", "E-good")], [("r", "e")]))
    tracker = load({**{k: v for k, v in good.items() if v is not None}, f"{OPEN}bad\nrow": text,
                    f"{ENDED}no-event-id": ""}, now=0)
    assert [e.event_id for e in tracker.open_events] == ["E-good"]
    assert tracker.ended_keys == [("r", "e")]
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "saved fleet state: row 'fleet:open:bad\\nrow' left out" in messages, messages
    assert "fleet:ended:no-event-id" in messages and says in messages, messages


def test_an_open_row_left_beside_the_ended_one_is_not_an_open_event(tmp_path: Path) -> None:
    """The outbox could not read its disk at a fail-over: the removal of an ended event's open row, made in memory,
    is not carried back, only the row that remembers the ending. The ending wins."""
    outbox = Outbox(tmp_path, ["stdout"])
    tracker = FleetTracker()
    commit(outbox, tracker, news("Scheduled", "E1"), news("Scheduled", "E2"))
    ended = changed_state(tracker.apply(news("Completed", "E1"), now=2), tracker)
    outbox.append([], state={key: value for key, value in ended.items() if value is not None})   # the deletion lost
    restarted = load(outbox.load_states(PREFIX), now=3)
    assert [event.event_id for event in restarted.open_events] == ["E2"] and restarted.has_ended("E1")
    outbox.close()
