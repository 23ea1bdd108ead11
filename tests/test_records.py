from __future__ import annotations

import json
from datetime import datetime, timezone
from importlib import resources
from typing import Any

import jsonschema
import pytest

from forewarn.imds.document import parse_document
from forewarn.imds.instance import VmInfo
from forewarn.records import Record, to_record
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
    approved = Change(ChangeKind.APPROVED, change.event, change.incarnation)
    record = to_record(approved, VM, NOW, extra={"policy_rule": "user-initiated", "dry_run": True}).to_dict()
    VALIDATOR.validate(record)
    assert record["data"]["policy_rule"] == "user-initiated" and record["data"]["dry_run"] is True
