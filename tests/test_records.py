from __future__ import annotations

import json
from datetime import datetime, timezone
from importlib import resources
from typing import Any

import jsonschema
import pytest

from forewarn.imds.document import parse_document
from forewarn.imds.instance import VmInfo
from forewarn.records import APPROVED, Record, approval_record, drain_record, to_record
from forewarn.tracker import Change, ChangeKind, diff_documents

SCHEMA = json.loads(resources.files("forewarn").joinpath("schemas/record.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA, format_checker=jsonschema.FormatChecker())
VM = VmInfo(name="vm-0", vm_id="id-0", resource_id="/subscriptions/s/resourceGroups/rg/providers/"
            "Microsoft.Compute/virtualMachines/vm-0", location="westeurope")
NOW = datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=timezone.utc)


def event(status: str = "Scheduled", **fields: Any) -> dict[str, Any]:
    return {"EventId": "E1", "EventType": "Reboot", "ResourceType": "VirtualMachine", "Resources": ["vm-0"],
            "EventStatus": status, "NotBefore": "" if status == "Started" else "Mon, 11 Apr 2022 22:26:58 GMT",
            "Description": "", "EventSource": "Platform", "DurationInSeconds": -1, **fields}


def changes_of(*docs: list[dict[str, Any]]) -> list[Change]:
    out: list[Change] = []
    previous = None
    for i, events in enumerate(docs):
        document = parse_document({"DocumentIncarnation": i + 1, "Events": events})
        out.extend(diff_documents(previous, document))
        previous = document
    return out


def test_every_change_kind_produces_a_record_valid_against_the_schema() -> None:
    changes = changes_of([event()], [event("Started")], [])
    records = [to_record(c, VM, NOW).to_dict() for c in changes]
    assert [r["data"]["change"] for r in records] == ["added", "updated", "removed"]
    for record in records:
        VALIDATOR.validate(record)
    added, updated, removed = records
    assert added["type"] == "io.github.forewarn.scheduled_event.added"
    assert added["subject"] == "E1" and added["source"] == VM.resource_id
    assert added["time"] == "2026-01-02T03:04:05.678Z"
    assert added["data"]["not_before"] == "2022-04-11T22:26:58.000Z"
    assert added["data"]["affects_this_vm"] is True
    assert added["data"]["event"] == event()
    assert updated["data"]["previous_status"] == "Scheduled" and updated["data"]["not_before"] is None
    assert removed["data"]["outcome"] == "completed" and removed["data"]["previous_status"] == "Started"


def test_record_id_is_deterministic_and_distinct_per_change() -> None:
    (change,) = changes_of([event()])
    first = to_record(change, VM, NOW)
    again = to_record(change, VM, datetime(2030, 1, 1, tzinfo=timezone.utc))
    assert first.id == again.id
    other_vm = to_record(change, VmInfo(name="vm-1"), NOW)
    assert other_vm.id != first.id
    later = changes_of([], [event()])[0]
    assert later.incarnation == 2 and to_record(later, VM, NOW).id != first.id


def test_source_falls_back_to_the_vm_name() -> None:
    (change,) = changes_of([event(Resources=["vm-1"])])
    record = to_record(change, VmInfo(name="vm-0"), NOW)
    assert record.source == "forewarn://vm-0"
    assert record.data["affects_this_vm"] is False


def test_record_round_trips_through_json() -> None:
    (change,) = changes_of([event()])
    record = to_record(change, VM, NOW)
    assert Record.from_dict(json.loads(record.to_json())) == record


def test_schema_rejects_a_removed_record_without_outcome() -> None:
    (change,) = changes_of([event()])
    record = to_record(change, VM, NOW).to_dict()
    record["data"]["change"] = "removed"
    record["type"] = "io.github.forewarn.scheduled_event.removed"
    with pytest.raises(jsonschema.ValidationError):
        VALIDATOR.validate(record)


def test_approved_record_carries_rule_and_dry_run() -> None:
    (change,) = changes_of([event()])
    record = approval_record(change.event, VM, "user-initiated", True, change.incarnation, NOW).to_dict()
    VALIDATOR.validate(record)
    assert record["type"] == "io.github.forewarn.scheduled_event.approved" and record["subject"] == "E1"
    assert record["time"] == "2026-01-02T03:04:05.678Z" and record["source"] == VM.resource_id
    assert record["data"] == {"change": "approved", "incarnation": 1, "event": event(), "affects_this_vm": True,
                              "vm": VM.known(), "not_before": "2022-04-11T22:26:58.000Z",
                              "policy_rule": "user-initiated", "dry_run": True}


def test_approved_record_id_is_derived_like_every_other() -> None:
    """From (VM, event, change, incarnation) and nothing else (not the rule, the dry-run flag, the time), as
    CONTRACT.md says; the literal pins the derivation, so records written before a change keep their id."""
    (change,) = changes_of([event()])
    at_seven = parse_document({"DocumentIncarnation": 7, "Events": [event()]}).events[0]
    first = approval_record(at_seven, VM, "user-initiated", False, 7, NOW)
    assert first.id == "fdf8f742-becb-50b4-a9b6-7a42aebddc1f"
    later = datetime(2030, 1, 1, tzinfo=timezone.utc)
    assert approval_record(at_seven, VM, "other-rule", True, 7, later).id == first.id
    assert approval_record(at_seven, VM, "user-initiated", False, 8, NOW).id != first.id
    assert approval_record(at_seven, VmInfo(name="vm-1"), "user-initiated", False, 7, NOW).id != first.id
    assert to_record(change, VM, NOW).id != approval_record(change.event, VM, "r", False, 1, NOW).id


def test_the_schema_knows_exactly_the_document_changes_approved_node_action_and_drain() -> None:
    changes = SCHEMA["properties"]["data"]["properties"]["change"]["enum"]
    assert sorted(changes) == sorted([str(kind) for kind in ChangeKind] + [APPROVED, "node_action", "drain"])


def test_drain_record_ids_repeat_for_the_same_step_and_differ_between_steps() -> None:
    (change,) = changes_of([event()])
    blocked = {"blocked": [{"pod": "shop/web-1", "budget": "web"}], "tier": "priority 0", "blocked_seconds": 0.0}

    def make(phase: str, key: str, at: datetime = NOW, incarnation: int = 1) -> Record:
        return drain_record(change.event, VM, "node-1", "reboot", phase, "text", blocked if phase == "blocked" else
                            {"evicted_count": 1, "seconds": 2.0}, key, incarnation, at)

    first = make("blocked", "0")
    assert make("blocked", "0", at=datetime(2030, 1, 1, tzinfo=timezone.utc)).id == first.id
    assert len({first.id, make("blocked", "1").id, make("done", "").id, make("blocked", "0", incarnation=2).id}) == 4
    assert first.type == "io.github.forewarn.scheduled_event.drain" and first.data["phase"] == "blocked"
    assert first.data["blocked"] == [{"pod": "shop/web-1", "budget": "web"}] and first.data["change"] == "drain"
    jsonschema.validate(first.to_dict(), SCHEMA)
    jsonschema.validate(make("done", "").to_dict(), SCHEMA)
    broken = first.to_dict()
    del broken["data"]["blocked"]
    with pytest.raises(jsonschema.ValidationError):   # a blocked record must say what blocks it
        jsonschema.validate(broken, SCHEMA)


def test_cloudevents_are_the_records_dicts_parsed_straight_from_their_text() -> None:
    from forewarn.records import JsonRecords, cloudevents

    records = [to_record(change, VM, NOW) for change in changes_of([event()], [event("Started")], [])]
    stored = JsonRecords([record.to_json() for record in records])
    assert cloudevents(stored) == [record.to_dict() for record in records] == cloudevents(records)
    assert [list(value) for value in cloudevents(stored)] == [list(record.to_dict()) for record in records]


def test_cloudevents_of_a_text_in_another_form_are_what_its_record_gives() -> None:
    """A stored text that is not `to_json()` of the dict (another key order, more keys, another spec version or
    content type, from another writer) still gives the record's `to_dict()`, keys in its order."""
    from forewarn.records import JsonRecords, cloudevents

    record = to_record(changes_of([event()])[0], VM, NOW)
    value = record.to_dict()
    others = [dict(reversed(list(value.items()))), {**value, "extension": "x"},
              {**value, "specversion": "0.3"}, {**value, "datacontenttype": "text/plain"}]
    for other in others:
        (parsed,) = cloudevents(JsonRecords([json.dumps(other)]))
        assert parsed == record.to_dict() and list(parsed) == list(record.to_dict()), other
