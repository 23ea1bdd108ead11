"""Fleet changes as records: one per VM the event acts on, valid against the record schema the per-VM agent's
records follow, with ids that are the same for the same change whichever feed or replica reports it."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import jsonschema

import fleet_samples as samples
from forewarn.fleet.armid import is_valid_name, parse_arm_id, scheduled_event_id, vm_id
from forewarn.fleet.feed import EventVms, FleetEvent, parse_event_grid, parse_resource_graph_row, vm_ids
from forewarn.fleet.records import change_records
from forewarn.fleet.tracker import FleetChange, FleetTracker
from forewarn.imds.document import Event
from forewarn.imds.instance import VmInfo
from forewarn.records import TYPE_PREFIX, Record, event_data, record_id, record_source, rfc3339

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


# --- built from the event's kept parse, equal to a fresh parse per VM ------------------------------------------

def freshly_parsed_records(change: FleetChange, at: datetime) -> list[Record]:
    """The records as the per-VM agent's builders make them, every ARM ID parsed again for each VM: what
    change_records gives from the parse the feed kept (FleetEvent.vms), field for field."""
    fleet_event, event = change.event, change.event.event
    target = parse_arm_id(fleet_event.resource_id)
    if target.is_type("Microsoft.Compute", "virtualMachines"):
        ids: tuple[str, ...] = (fleet_event.resource_id,)
    else:
        ids = tuple(vm_id(fleet_event.subscription_id, fleet_event.resource_group, name)
                    for name in event.resources if is_valid_name(name))
    records = []
    for vm_resource_id in ids:
        again = parse_arm_id(fleet_event.resource_id)
        vm = VmInfo(name=parse_arm_id(vm_resource_id).name, resource_id=vm_resource_id,
                    vm_scale_set=again.name if again.is_type("Microsoft.Compute", "virtualMachineScaleSets") else "",
                    resource_group=fleet_event.resource_group, subscription_id=fleet_event.subscription_id,
                    location=fleet_event.location or "")
        data = event_data(str(change.kind), event, 0, vm)
        data["affects_this_vm"] = True
        data["feed"] = fleet_event.origin
        if change.previous is not None:
            data["previous_status"] = change.previous.status
        if change.outcome is not None:
            data["outcome"], data["ended_by"] = str(change.outcome), str(change.ended_by)
        records.append(Record(record_id(vm_resource_id.lower(), event.event_id.lower(), change.fingerprint, 0),
                              record_source(vm), f"{TYPE_PREFIX}.{change.kind}", event.event_id, rfc3339(at), data))
    return records


def kept_and_fresh() -> list[FleetEvent]:
    """The same kinds of event from each feed parser (which hands its parse over) and built directly (parsed when
    first asked): VM, scale-set and availability-set targets, spellings in other cases, a name left out."""
    vmss = samples.target_id("vmss", "Pool", rg="RG-Upper")
    cases = [
        (samples.properties(resources=("vm-a",)), samples.target_id("vm", "vm-a")),
        (samples.properties(resources=("Pool_0", "pool_1", "bad?name", "pool_2")), vmss),
        (samples.properties(resources=("web-0", "web-1"), status="Started"), samples.target_id("avset", "web")),
        (samples.properties(resources=("x_0",)), vmss.upper().replace("PROVIDERS", "providers")),
    ]
    events: list[FleetEvent] = []
    for props, target in cases:
        row = parse_resource_graph_row(samples.resource_graph_row(props, target))
        (pushed,) = parse_event_grid(samples.event_grid_event(props, target)).events
        direct = FleetEvent(row.resource_id, row.subscription_id, row.resource_group, row.event, "resourcegraph",
                            location=row.location)
        assert row._vms is not None and pushed._vms is not None and direct._vms is None  # parsed when first asked
        events += [row, pushed, direct]
    return events


def test_records_from_the_kept_parse_equal_those_from_a_fresh_parse_of_every_id() -> None:
    tracker = FleetTracker()
    for fleet_event in kept_and_fresh():
        for change in [*tracker.apply(fleet_event, 1), *tracker.apply(
                replace(fleet_event, event=replace(fleet_event.event, status="Completed")), 2)]:
            kept = change_records(change, AT)
            assert [r.to_json() for r in kept] == [r.to_json() for r in freshly_parsed_records(change, AT)]
            # the JSON put together from parts is the record's own data, as json.dumps writes it
            assert all(r.stored_json == json.dumps(r.to_dict(), separators=(",", ":")) for r in kept)
            assert [r.source for r in kept] == list(vm_ids(change.event)) and kept
            target = parse_arm_id(change.event.resource_id)
            assert change.event.vms == EventVms.of(target, change.event.event.resources,
                                                   str(target) == change.event.resource_id)
        tracker = FleetTracker()
    bad = next(e for e in kept_and_fresh() if "bad?name" in e.event.resources)
    assert list(bad.vms.names) == ["Pool_0", "pool_1", "pool_2"] and bad.vms.scale_set == "Pool"


def test_the_event_arm_id_and_key_from_the_kept_parse_are_those_of_a_fresh_one() -> None:
    odd = samples.target_id("vmss", "Pool").replace("resourceGroups", "resourcegroups") + "/"
    events = [*kept_and_fresh(), replace(kept_and_fresh()[0], resource_id=odd)]
    assert [e.vms.normalized for e in events[-4:]] == [True, True, True, False]
    for event in events:
        assert event.arm_id == scheduled_event_id(event.resource_id, event.event_id)
        assert event.key == (event.resource_id.lower(), event.event_id.lower())


def test_record_ids_are_uuid5_of_the_name_as_uuid_makes_them() -> None:
    import random
    import uuid

    from forewarn.records import _ID_NAMESPACE as namespace
    rng = random.Random(38)
    alphabet = "abcXYZ019_-./\n\u00e4\u4e2d\U0001f600"
    for _ in range(2000):
        parts = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40))) for _ in range(3)]
        incarnation = rng.randrange(0, 10**6)
        expected = uuid.uuid5(namespace, f"{parts[0]}\n{parts[1]}\n{parts[2]}\n{incarnation}")
        assert record_id(*parts, incarnation) == str(expected)


def test_values_that_repeat_across_events_are_one_string_each() -> None:
    def row(n: int) -> FleetEvent:
        props = samples.properties(event_id=str(n), event_type="Re" + "boot", resources=(f"vm-{n}",))
        return parse_resource_graph_row(json.loads(json.dumps(samples.resource_graph_row(
            props, samples.target_id("vm", f"vm-{n}")))))  # each row decoded on its own, as pages are

    a, b = row(1), row(2)
    for field in ("event_type", "status", "resource_type", "source"):
        assert getattr(a.event, field) is getattr(b.event, field)
    assert a.event.raw["EventType"] is b.event.raw["EventType"] and a.location is b.location
    assert a.event.raw == samples.properties(event_id="1", resources=["vm-1"])
