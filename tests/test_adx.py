"""The Azure Data Explorer files: the table, its JSON mapping and the queries agree with the record schema
and with real records."""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from forewarn.imds.document import parse_document
from forewarn.imds.instance import VmInfo
from forewarn.records import approval_record, to_record
from forewarn.tracker import diff_documents

ADX = Path(__file__).parent.parent / "deploy" / "adx"
SCHEMA = json.loads(resources.files("forewarn").joinpath("schemas/record.schema.json").read_text())
SCHEMA_TYPES = {"string": {"string"}, "datetime": {"string"}, "long": {"integer"}, "int": {"integer"},
                "bool": {"boolean"}, "dynamic": {"object", "array"}}
PYTHON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "datetime": (str,), "long": (int,), "int": (int,),
                                             "bool": (bool,), "dynamic": (dict, list)}


def table_and_mapping() -> tuple[dict[str, str], list[dict[str, str]]]:
    text = (ADX / "forewarn-table.kql").read_text()
    columns_text = re.search(r"\.create-merge table ForewarnRecords \((.+)\)", text)
    assert columns_text is not None
    columns = dict(part.strip().split(": ") for part in columns_text.group(1).split(","))
    mapping_text = re.search(r"ingestion json mapping \"ForewarnRecordsMapping\"\s*'(.+)'", text, re.DOTALL)
    assert mapping_text is not None
    return columns, json.loads(mapping_text.group(1))


def schema_at(path: str) -> dict[str, Any]:
    node: dict[str, Any] = SCHEMA
    for step in path.removeprefix("$").split(".")[1:]:
        node = node["properties"][step]
    return node


def value_at(record: dict[str, Any], path: str) -> Any:
    node: Any = record
    for step in path.removeprefix("$").split(".")[1:]:
        if not isinstance(node, dict) or step not in node:
            return None
        node = node[step]
    return node


def sample_records() -> list[dict[str, Any]]:
    vm = VmInfo(name="vm-0", vm_id="id", resource_id="/subscriptions/s/x", vm_scale_set="ss", location="westeurope")
    event = {"EventId": "E1", "EventType": "Reboot", "ResourceType": "VirtualMachine", "Resources": ["vm-0"],
             "EventStatus": "Scheduled", "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT", "Description": "d",
             "EventSource": "Platform", "DurationInSeconds": -1}
    started = {**event, "EventStatus": "Started", "NotBefore": ""}
    docs = [parse_document({"DocumentIncarnation": 1, "Events": [event]}),
            parse_document({"DocumentIncarnation": 2, "Events": [started]}),
            parse_document({"DocumentIncarnation": 3, "Events": []})]
    changes = diff_documents(None, docs[0]) + diff_documents(docs[0], docs[1]) + diff_documents(docs[1], docs[2])
    now = datetime.now(timezone.utc)
    records = [to_record(change, vm, now).to_dict() for change in changes]
    records.append(approval_record(docs[0].events[0], vm, "r", False, 1, now).to_dict())
    return records


def test_mapping_covers_the_table_with_the_same_types() -> None:
    columns, mapping = table_and_mapping()
    assert {m["column"]: m["datatype"] for m in mapping} == columns


def test_every_mapped_path_exists_in_the_record_schema_with_a_compatible_type() -> None:
    _, mapping = table_and_mapping()
    for entry in mapping:
        if entry["path"] == "$":
            continue
        node = schema_at(entry["path"])
        kinds = node.get("type", "string")
        kinds = set(kinds) if isinstance(kinds, list) else {kinds}
        assert kinds & SCHEMA_TYPES[entry["datatype"]], entry
        if entry["datatype"] == "datetime":
            assert node.get("format") == "date-time", entry


@pytest.mark.parametrize("record", sample_records(), ids=lambda r: r["data"]["change"])
def test_real_records_fill_the_columns(record: dict[str, Any]) -> None:
    _, mapping = table_and_mapping()
    for entry in mapping:
        value = value_at(record, entry["path"])
        if value is None:
            continue  # empty column, e.g. Outcome on an added record
        assert isinstance(value, PYTHON_TYPES[entry["datatype"]]), entry
        if entry["datatype"] == "datetime":
            datetime.fromisoformat(value.replace("Z", "+00:00"))
    for column in ("Id", "Type", "Change", "EventId", "EventType", "VmName"):
        path = next(m["path"] for m in mapping if m["column"] == column)
        assert value_at(record, path) is not None, column


def test_queries_use_only_table_columns() -> None:
    columns, _ = table_and_mapping()
    text = re.sub(r"//.*", "", (ADX / "forewarn-queries.kql").read_text())
    text = re.sub(r'"[^"]*"', "", text)
    computed = {"Seen", "Started", "Ended", "NoticeMinutes", "RunMinutes", "Events", "Day", "Approvals"}
    for word in set(re.findall(r"\b[A-Z][A-Za-z]+\b", text)) - {"ForewarnRecords"} - computed:
        assert word in columns, word
