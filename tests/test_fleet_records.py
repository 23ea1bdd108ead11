"""Fleet changes as records: one per VM the event acts on, valid against the record schema the per-VM agent's
records follow, with ids that are the same for the same change whichever feed or replica reports it."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import jsonschema

from forewarn.fleet.feed import FleetEvent
from forewarn.fleet.records import change_records
from forewarn.fleet.tracker import FleetTracker
from forewarn.imds.document import Event

SCHEMA = json.loads((Path(__file__).parent.parent / "src/forewarn/schemas/record.schema.json").read_text())
SUB = "11111111-2222-3333-4444-555555555555"
GROUP = f"/subscriptions/{SUB}/resourceGroups/rg-a/providers/Microsoft.Compute"
AT = datetime(2026, 11, 24, 10, 0, tzinfo=timezone.utc)


def news(status: str, resource: str, resources: tuple[str, ...], origin: str = "eventgrid",
         delivery: str | None = None) -> FleetEvent:
    raw = {"EventId": "E-1", "EventType": "Reboot", "EventStatus": status, "Resources": list(resources),
           "NotBefore": "Tue, 24 Nov 2026 12:00:00 GMT" if status == "Scheduled" else ""}
    event = Event("E-1", "Reboot", status, "VirtualMachine", resources,
                  datetime(2026, 11, 24, 12, tzinfo=timezone.utc) if status == "Scheduled" else None, raw=raw)
    return FleetEvent(resource, SUB, "rg-a", event, origin, delivery_id=delivery, location="westeurope")


def test_a_scale_set_event_gives_one_valid_record_per_vm() -> None:
    tracker = FleetTracker()
    (change,) = tracker.apply(news("Scheduled", f"{GROUP}/virtualMachineScaleSets/pool", ("pool_0", "pool_1")), 1)
    records = change_records(change, AT)
    assert [r.data["vm"]["name"] for r in records] == ["pool_0", "pool_1"]
    for record in records:
        jsonschema.validate(record.to_dict(), SCHEMA)
        assert record.source == f"{GROUP}/virtualMachines/{record.data['vm']['name']}"
        assert record.data["vm"]["vm_scale_set"] == "pool" and record.data["affects_this_vm"] is True
        assert record.data["incarnation"] == 0 and record.data["feed"] == "eventgrid"
        assert record.type.endswith(".added") and record.data["not_before"] == "2026-11-24T12:00:00.000Z"
    assert len({r.id for r in records}) == 2


def test_the_same_change_has_the_same_id_from_any_feed_replica_or_spelling() -> None:
    one = FleetTracker().apply(news("Scheduled", f"{GROUP}/virtualMachines/vm-a", ("vm-a",)), 1)
    other = FleetTracker().apply(news("Scheduled", f"{GROUP.upper()}/VIRTUALMACHINES/VM-A", ("vm-a",),
                                      origin="resourcegraph"), 7)
    assert change_records(one[0], AT)[0].id == change_records(other[0], AT)[0].id


def test_removed_records_carry_the_outcome_the_previous_status_and_how_it_ended() -> None:
    tracker = FleetTracker()
    vm = f"{GROUP}/virtualMachines/vm-a"
    tracker.apply(news("Scheduled", vm, ("vm-a",)), 1)
    tracker.apply(news("Started", vm, ("vm-a",)), 2)
    (removed,) = change_records(tracker.apply(news("Completed", vm, ("vm-a",)), 3)[0], AT)
    jsonschema.validate(removed.to_dict(), SCHEMA)
    assert (removed.data["outcome"], removed.data["previous_status"], removed.data["ended_by"]) == \
        ("completed", "Started", "status")
    gone = FleetTracker()
    gone.apply_snapshot([replace(news("Scheduled", vm, ("vm-a",)), origin="resourcegraph")], started_at=0, now=1)
    gone.apply_snapshot([], started_at=2, now=3)
    (ended,) = gone.apply_snapshot([], started_at=4, now=5)
    (record,) = change_records(ended, AT)
    assert (record.data["outcome"], record.data["ended_by"]) == ("cancelled", "missing")
    assert record.id != removed.id
