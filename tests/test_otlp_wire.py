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


def sdk_bytes(records: list[Record]) -> bytes:
    """The SDK's request for `records`, serialised, from a sink opened for it."""
    sink = OtlpSink(endpoint="http://127.0.0.1:9", protocol="http/protobuf")
    try:
        return bytes(sdk_request(sink, records).SerializeToString())
    finally:
        sink.close()


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
    """True == 1 == 1.0 and 0.0 == -0.0, and they hash alike: the memos must still tell them apart, nested or not."""
    from opentelemetry.exporter.otlp.proto.common._internal import _encode_value

    values: list[Any] = [1, True, 1.0, "1", [1], [True], ["1"], {"a": "1"}, {"a": 1}, {"a": True}, {"a": ["1"]},
                         0.0, -0.0, [0.0], [-0.0], {"a": 0.0}, {"a": -0.0}]
    for _ in range(2):
        for value in values:
            for body in ({"k": value}, {"vm": {"k": value}}, {1: value}, {True: value}):
                assert any_value(body) == _encode_value(body).SerializeToString(), body


def dict_path_request(records: list[Record]) -> bytes:
    """The request `encode_request` writes for the log fields, as mappings, of the records read back from their
    JSON text (the reference the tests above hold to the SDK's bytes), grouped as the sink groups them."""
    sink = OtlpSink(endpoint="http://127.0.0.1:9", protocol="http/protobuf")
    try:
        groups = sink._by_resource([Record.from_json(record.to_json()).to_dict() for record in records])
        return encode_request(((resource, [_log_fields(Record.from_dict(body)) for body in group])
                               for resource, group in groups.items()), _SCOPE)
    finally:
        sink.close()


def grpc_request(records: list[Record]) -> bytes:
    """The request the gRPC sink encodes for the records read back from the outbox (its Layouts, the bodies parsed
    straight from the text)."""
    sink = OtlpSink(endpoint="http://127.0.0.1:9", protocol="grpc")
    try:
        payload = sink.encode(JsonRecords([record.to_json() for record in records]))
        assert isinstance(payload, EncodedLogs) and len(payload) == len(records)
        return payload.request
    finally:
        sink.close()


def test_the_grpc_sinks_request_is_the_sdks_request_byte_for_byte() -> None:
    """What the sink sends over gRPC (bodies and attributes laid out, resources cached per VM), twice so that the
    memos answer, is the SDK's request for the same records."""
    records = sample_records()
    theirs = sdk_bytes(records)
    assert grpc_request(records) == theirs
    assert grpc_request(records) == theirs
    assert grpc_request(records[::-1]) == dict_path_request(records[::-1])


def test_records_of_one_vm_with_its_fields_in_another_order_share_one_resource() -> None:
    vm = {"name": "vm-0", "vm_id": "id-0", "location": "westeurope"}
    records = [Record(id=f"id-{i}", source="s", type="t", subject="E", time="2024-05-01T12:00:00.123Z",
                      data={"change": "added", "event": {"EventId": "E"},
                            "vm": vm if i % 2 else dict(reversed(list(vm.items())))})
               for i in range(4)]
    parsed = ExportLogsServiceRequest.FromString(grpc_request(records))
    assert len(parsed.resource_logs) == 1
    ids = [next(a.value.string_value for a in log.attributes if a.key == "cloudevents.event_id")
           for log in parsed.resource_logs[0].scope_logs[0].log_records]
    assert ids == [f"id-{i}" for i in range(4)]
    assert grpc_request(records) == dict_path_request(records)


hostile_scalars = (hostile_text | st.booleans() | st.integers(min_value=-(2**63), max_value=2**63 - 1)
                   | st.floats() | st.none())  # NaN and the infinities too: JSON text carries them as NaN, Infinity
hostile_json = st.recursive(hostile_scalars, lambda inner: st.lists(inner, max_size=4)
                            | st.dictionaries(hostile_text, inner, max_size=4), max_leaves=12)
deep = st.integers(min_value=1, max_value=60).map(lambda depth: _nest(depth))


def _nest(depth: int) -> Any:
    value: Any = "\U0001f600"
    for level in range(depth):
        value = {f"level-{level}": value} if level % 2 else [value, level]
    return value


@st.composite
def hostile_records(draw: st.DrawFn) -> Record:
    """A record with the keys the sink reads, each holding any JSON value (or missing), and hostile values around."""
    field = hostile_json | deep
    event = draw(st.dictionaries(hostile_text, field, max_size=4))
    for key in ("EventId", "EventType", "EventStatus", "Resources", "EventSource", "DurationInSeconds"):
        if draw(st.booleans()):
            event[key] = draw(field | st.lists(hostile_scalars, max_size=3))
    data: dict[str, Any] = {"change": draw(st.sampled_from(["added", "updated", "removed", "approved"])),
                            "event": event}
    for key in ("incarnation", "affects_this_vm", "not_before", "outcome", "previous_status", "policy_rule",
                "dry_run"):
        if draw(st.booleans()):
            data[key] = draw(field)
    data["vm"] = draw(st.dictionaries(st.sampled_from(["name", "vm_id", "location", "zone"]), hostile_text,
                                      max_size=4))
    data.update(draw(st.dictionaries(hostile_text, field, max_size=3)))
    texts = st.text(max_size=50) | st.sampled_from(["x" * 70_000, "\u00e9t\u00e9 \u2603" * 500])
    return Record(id=draw(texts), source=draw(texts), type=draw(texts), subject=draw(texts),
                  time=draw(st.sampled_from(["2024-05-01T12:00:00.123Z", "2026-11-24T13:34:09.969Z"])), data=data)


@settings(max_examples=200, deadline=None)
@given(st.lists(hostile_records(), min_size=1, max_size=5))
def test_hostile_records_encode_through_the_grpc_sink_as_through_the_mappings(records: list[Record]) -> None:
    """Any JSON value where the sink reads a field (huge strings, deep nesting, NaN and the infinities, unicode,
    True beside 1 and 1.0, lists and objects where strings belong, missing fields), each request encoded twice so
    that the memos answer: the gRPC sink's Layouts write the bytes `encode_request` writes for the log fields as
    mappings, which the tests above hold to the SDK's."""
    assert grpc_request(records) == dict_path_request(records)
    assert grpc_request(records) == dict_path_request(records)


def test_hostile_records_the_sdk_takes_encode_as_the_sdk_encodes_them() -> None:
    """Non-finite numbers, unicode and a huge string in the body and the attributes, straight against the SDK."""
    (base,) = sample_records()[:1]
    data = {**base.data, "incarnation": 2**63 - 1, "affects_this_vm": 1, "dry_run": 0,
            "event": {**base.data["event"], "EventId": "\U0001f600" * 20_000, "DurationInSeconds": float("inf"),
                      "EventSource": float("nan"), "Resources": [True, 1, 1.0, "1", float("-inf")],
                      "Description": "\x00\u00e9\u2603" * 1000, "Nested": _nest(12)}}
    records = [Record(id=base.id, source=base.source, type=base.type, subject="\u2603", time=base.time, data=data)]
    theirs = sdk_bytes(records)
    assert grpc_request(records) == theirs
    assert grpc_request(records) == theirs


def test_a_layout_tells_equal_values_of_other_types_apart_and_leaves_out_none_where_optional() -> None:
    from forewarn.sinks.otlpwire import Layout, _entries

    layout = Layout(("id", "a", "b", "c"), optional=1, holes=("id",))
    for _ in range(2):  # the second time from the memo
        for a in (1, True, 1.0, "1", [1], [True], {"k": 1}, {"k": True}, None):
            for c in (None, 0, False, 0.0, -0.0, ""):
                values = (f"id-{a!r}", a, "b", c)
                mapping = {"id": values[0], "a": a, "b": "b", **({} if c is None else {"c": c})}
                assert layout.mapping(values) == mapping
                assert layout.encode(b"\x32", values) == _entries(b"\x32", mapping), values


def test_resources_that_are_not_a_list_are_an_empty_list_not_a_failed_export() -> None:
    """IMDS's Resources as null or a number (the document ignores them) once failed every export of the batch."""
    (base,) = sample_records()[:1]
    for resources in (None, 7, True, "vm-0"):
        record = Record(id=base.id, source=base.source, type=base.type, subject=base.subject, time=base.time,
                        data={**base.data, "event": {**base.data["event"], "Resources": resources}})
        parsed = ExportLogsServiceRequest.FromString(grpc_request([record]))
        (log,) = parsed.resource_logs[0].scope_logs[0].log_records
        (attribute,) = [a for a in log.attributes if a.key == "azure.scheduled_event.resources"]
        assert attribute.value.HasField("array_value") and not attribute.value.array_value.values


def test_the_deepest_document_imds_may_send_gives_a_request_protobuf_reads_with_its_default_limits() -> None:
    """The SDK refuses values nested beyond protobuf's recursion limit (100 messages, about 33 levels of objects),
    and a receiver would refuse such a request, failing its whole batch for ever. A record's event comes from a
    reply that `decode_reply` bounded (MAX_DEPTH levels, the document's own two included), so the deepest event
    IMDS may send must still make a request that a parser with the default limits reads."""
    import json

    from forewarn.imds.reply import MAX_DEPTH, ReplyError, decode_reply

    def reply(depth: int) -> bytes:
        nested: Any = "leaf"
        for _ in range(depth):
            nested = {"k": nested}
        return json.dumps({"DocumentIncarnation": 1, "Events": [{
            "EventId": "E", "EventType": "Freeze", "ResourceType": "VirtualMachine", "Resources": ["vm-0"],
            "EventStatus": "Scheduled", "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT", "Description": "",
            "EventSource": "Platform", "DurationInSeconds": 9, "Nested": nested}]}).encode()

    deepest = max(depth for depth in range(40) if _decodes(reply(depth), decode_reply, ReplyError))
    assert deepest == MAX_DEPTH - 3  # the document, its Events, the event: the rest is the event's to nest
    (change,) = diff_documents(None, parse_document(decode_reply(reply(deepest))[0]))
    records = list(JsonRecords([to_record(change, VMS[0], AT).to_json()]))
    request = ExportLogsServiceRequest.FromString(grpc_request(records))
    assert request.resource_logs[0].scope_logs[0].log_records[0].body.kvlist_value.values


def _decodes(data: bytes, decode: Any, error: type[Exception]) -> bool:
    try:
        decode(data)
    except error:
        return False
    return True
