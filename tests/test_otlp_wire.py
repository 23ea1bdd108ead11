"""The gRPC OTLP request forewarn encodes itself is the request the SDK's encoder builds, byte for byte."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from forewarn.imds.document import parse_document
from forewarn.imds.instance import VmInfo
from forewarn.records import JsonRecords, Record, approval_record, to_record
from forewarn.sinks.otlp import _SCOPE, OtlpSink, _log_fields, _readable, resource_for
from forewarn.sinks.otlpwire import EncodedLogs, any_value, encode_request
from forewarn.tracker import diff_documents

AT = datetime(2024, 5, 1, 12, 0, 0, 123000, tzinfo=timezone.utc)
VMS = [VmInfo(name="vm-0", vm_id="4d1824cf-fdc0-5660-b82f-b2a54105ac90", location="westeurope", zone="2",
              resource_id="/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/vm-0"),
       VmInfo(name="vm-1")]
AT_NANOS = int(AT.timestamp() * 1e9)


def document(incarnation: int, status: str, *ids: str) -> Any:
    return parse_document({"DocumentIncarnation": incarnation, "Events": [{
        "EventId": event_id, "EventType": "Freeze", "ResourceType": "VirtualMachine", "Resources": ["vm-0", "vm-1"],
        "EventStatus": status, "NotBefore": "" if status == "Started" else "Mon, 11 Apr 2022 22:26:58 GMT",
        "Description": "Host maintenance, \u00e9t\u00e9 \u2603", "EventSource": "Platform", "DurationInSeconds": 9}
        for event_id in ids]})


def sample_records() -> list[Record]:
    """Every kind of change and an approval, from two VMs, read back from JSON as the outbox hands them out."""
    first, second, third = document(1, "Scheduled", "A", "B"), document(2, "Started", "A"), document(3, "Started")
    changes = [*diff_documents(None, first), *diff_documents(first, second), *diff_documents(second, third)]
    records = [to_record(change, vm, AT) for vm in VMS for change in changes]
    records.append(approval_record(first.events[0], VMS[0], "rule-1", True, 1, AT))
    return list(JsonRecords([record.to_json() for record in records]))


def sdk_request(sink: OtlpSink, records: list[Record]) -> Any:
    """The SDK's request for the SDK's log records of `records`, grouped as the sink groups them."""
    groups = sink._by_resource([record.to_dict() for record in records])
    return encode_logs([_readable(_log_fields(Record.from_dict(body)), resource) for resource, group in groups.items()
                        for body in group])


def test_the_request_is_the_sdks_request_byte_for_byte() -> None:
    sink = OtlpSink(endpoint="http://127.0.0.1:9", protocol="http/protobuf")
    try:
        records = sample_records()
        groups = sink._by_resource([record.to_dict() for record in records])
        assert len(groups) == 2 and len(records) > 8
        ours = encode_request(((resource, [_log_fields(Record.from_dict(body)) for body in group])
                               for resource, group in groups.items()), _SCOPE)
        theirs = sdk_request(sink, records)
        assert ours == theirs.SerializeToString()
        parsed = ExportLogsServiceRequest.FromString(ours)
        assert sum(len(s.log_records) for r in parsed.resource_logs for s in r.scope_logs) == len(records)
    finally:
        sink.close()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_any_json_value_encodes_as_the_sdk_encodes_it(value: Any) -> None:
    from opentelemetry.exporter.otlp.proto.common._internal import _encode_value

    assert AnyValue.FromString(any_value(value)) == _encode_value(value)


def test_a_value_protobuf_cannot_carry_is_refused() -> None:
    with pytest.raises(ValueError, match="int64"):
        any_value(2**63)
    with pytest.raises(ValueError, match="set"):
        any_value({1, 2})


def test_the_exporter_sends_the_encoded_bytes_through_its_own_client() -> None:
    """The exporter's private `_stub` and `_client` carry the serialised request (no parse and serialise again),
    also after the exporter reopens its channel; a new SDK that stops using them fails here."""
    from forewarn.sinks.otlpwire import SerializedLogsStub, grpc_exporter

    exporter = grpc_exporter("http://127.0.0.1:9")
    try:
        assert isinstance(exporter._client, SerializedLogsStub)
        assert exporter._translate_data(EncodedLogs(b"\x0a\x00", 1)) == b"\x0a\x00"
        exporter._initialize_channel_and_stub()  # what it does after an UNAVAILABLE
        assert isinstance(exporter._client, SerializedLogsStub)
    finally:
        exporter.shutdown()


hostile_text = st.text(max_size=200) | st.sampled_from(["", "\u00e9t\u00e9 \u2603", "\U0001f600" * 40, "x" * 300])
hostile_attributes = st.dictionaries(
    hostile_text, hostile_text | st.booleans() | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False) | st.lists(hostile_text, max_size=10), max_size=16)


@settings(max_examples=200, deadline=None)
@given(bodies=st.lists(json_values | st.dictionaries(hostile_text, json_values, max_size=8), min_size=1, max_size=4),
       attributes=st.lists(hostile_attributes, min_size=1, max_size=4), name=hostile_text)
def test_hostile_log_records_encode_as_the_sdk_encodes_them(bodies: list[Any], attributes: list[dict[str, Any]],
                                                            name: str) -> None:
    """Whole requests of log records with hostile bodies and attributes (non-ASCII, long strings, huge ints,
    floats, nested lists and objects, empty keys and values), each encoded twice so that the memos answer too."""
    resource = resource_for({"name": name, "vm_id": name})
    logs = [(AT_NANOS, AT_NANOS + i, 13, "WARN", name, body, attrs)
            for i, (body, attrs) in enumerate(zip(bodies, (attributes * len(bodies))[:len(bodies)], strict=True))]
    theirs = encode_logs([_readable(fields, resource) for fields in logs]).SerializeToString()
    assert encode_request([(resource, logs)], _SCOPE) == theirs
    assert encode_request([(resource, logs)], _SCOPE) == theirs


def test_equal_values_of_other_types_never_share_a_remembered_encoding() -> None:
    """True == 1 == 1.0 and they hash alike: the memos must still tell them apart, nested or not."""
    from opentelemetry.exporter.otlp.proto.common._internal import _encode_value

    values: list[Any] = [1, True, 1.0, "1", [1], [True], ["1"], {"a": "1"}, {"a": 1}, {"a": True}, {"a": ["1"]}]
    for _ in range(2):
        for value in values:
            for body in ({"k": value}, {"vm": {"k": value}}, {1: value}, {True: value}):
                assert any_value(body) == _encode_value(body).SerializeToString(), body
