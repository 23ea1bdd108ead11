"""The fleet tracker saved as text and read back: the same open events, the same ended ones, so a restart
reports nothing twice; a damaged or hostile saved state is refused with a clear error, never trusted."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from forewarn.fleet.feed import FleetEvent
from forewarn.fleet.state import StateError, dump, load
from forewarn.fleet.tracker import FleetTracker
from forewarn.imds.document import Event

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


def test_a_restart_from_the_saved_state_reports_nothing_twice() -> None:
    tracker = FleetTracker()
    tracker.apply(news("Scheduled", "E-open", delivery="d-1"), now=1)
    tracker.apply(news("Started", "E-started"), now=1)
    tracker.apply(news("Canceled", "E-ended"), now=1)
    again = load(dump(tracker), now=5)
    assert [e.event_id for e in again.open_events] == ["E-open", "E-started"]
    restored = again.open_events[0]
    original = tracker.open_events[0]
    assert restored == original  # the same resource, event (fields and raw), feed, delivery id, time
    assert dict(restored.event.raw) == dict(original.event.raw)
    assert again.apply(news("Scheduled", "E-open"), now=6) == []
    assert again.apply(news("Canceled", "E-ended"), now=6) == []
    assert [str(c.kind) for c in again.apply(news("Completed", "E-started"), now=6)] == ["removed"]


@pytest.mark.parametrize("text, says", [
    ("not json", "saved fleet state"),
    (json.dumps({"format": 99, "open": [], "ended": []}), "format"),
    (json.dumps({"format": 1, "open": {}, "ended": []}), "lists"),
    (json.dumps({"format": 1, "open": [7], "ended": []}), "open[0]"),
    (json.dumps({"format": 1, "open": [{"id": "/not/an/arm/id", "properties": {}}], "ended": []}), "open[0]"),
    (json.dumps({"format": 1, "open": [], "ended": [["only-one"]]}), "ended[0]"),
    ('{"format": 1, "open": [], "ended": [], "x": NaN}', "saved fleet state"),
    ("[" * 100_000, "saved fleet state"),
])
def test_a_damaged_saved_state_is_refused_with_a_clear_error(text: str, says: str) -> None:
    with pytest.raises(StateError, match=says.replace("[", r"\[")):
        load(text, now=0)


def test_a_saved_event_with_a_wrong_feed_is_refused() -> None:
    saved = json.loads(dump(FleetTracker([news("Scheduled", "E-1")])))
    saved["open"][0]["feed"] = "somewhere"
    with pytest.raises(StateError, match="open"):
        load(json.dumps(saved), now=0)
