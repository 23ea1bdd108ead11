"""OTLP logs requests encoded straight from records, for the gRPC exporter.

The SDK's encoder builds one protobuf object per value of every log record's body (about 45 for a
record, each through `isinstance` checks against the collection ABCs): a cProfile of a backlog drain
put 80% of the OTLP sink's time there. Here the body and the attributes are written as protobuf wire
bytes by a few lines of code (the AnyValue/KeyValue messages of opentelemetry-proto's common.proto),
and the whole request is parsed once by protobuf's C implementation. The result is the request the SDK
would send for the same log records, byte for byte (tests/test_otlp_wire.py compares the two); the
SDK's gRPC exporter still sends it, with its endpoint, headers, TLS, compression, retries and timeout.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

#: One log record as the sink describes it: timestamps, severity, event name, body and attributes.
LogFields = tuple[int, int, int, str, str, Any, Mapping[str, Any]]

_INT64 = 1 << 63


#: The varints of 0-127, one byte each: nearly every length in a log record is one of these.
_SMALL = [bytes((n,)) for n in range(128)]


def _varint(value: int) -> bytes:
    if value < 128:
        return _SMALL[value]
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _length_delimited(tag: bytes, payload: bytes) -> bytes:
    size = len(payload)
    return tag + (_SMALL[size] if size < 128 else _varint(size)) + payload


def _string(tag: bytes, text: str) -> bytes:
    return _length_delimited(tag, text.encode())


def any_value(value: Any) -> bytes:
    """The AnyValue message for a JSON-like value (string 1, bool 2, int 3, double 4, array 5, kvlist 6,
    bytes 7; None is the empty AnyValue), as the SDK encodes it."""
    kind = type(value)  # the JSON types first, by identity: most values of a record are these
    if kind is str:
        return _string(b"\x0a", value)
    if kind is dict:
        return _kvlist(value)
    if kind is list:
        return _array(value)
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        if not -_INT64 <= value < _INT64:
            raise ValueError(f"integer {value} does not fit OTLP's int64")
        return b"\x18" + _varint(int(value) & 0xFFFF_FFFF_FFFF_FFFF)
    if isinstance(value, float):
        return b"\x21" + struct.pack("<d", value)
    if isinstance(value, str):
        return _string(b"\x0a", value)
    if isinstance(value, bytes):
        return _length_delimited(b"\x3a", value)
    if isinstance(value, Mapping):
        return _kvlist(value)
    if isinstance(value, Sequence):
        return _array(value)
    raise ValueError(f"cannot encode a {kind.__name__} as an OTLP AnyValue")


def _kvlist(value: Mapping[Any, Any]) -> bytes:
    return _length_delimited(b"\x32", b"".join([_entry(b"\x0a", str(k), v) for k, v in value.items()]))


def _array(value: Sequence[Any]) -> bytes:
    return _length_delimited(b"\x2a", b"".join([_length_delimited(b"\x0a", any_value(v)) for v in value]))


def key_value(key: str, value: Any) -> bytes:
    """The KeyValue message (key 1, value 2); proto3 leaves an empty key out, as the SDK does."""
    return (_string(b"\x0a", key) if key else b"") + _length_delimited(b"\x12", any_value(value))


#: Entries with a string value already encoded, by (tag, key, value): a record's strings mostly repeat
#: from one record to the next (its VM, the event's type, resources, description, the record's type).
_ENTRIES: dict[tuple[bytes, str, str], bytes] = {}
_MAX_ENTRIES = 4096


def _entry(tag: bytes, key: str, value: Any) -> bytes:
    """A KeyValue as a field of its container (`tag`: a kvlist's values, or a log record's attributes)."""
    if type(value) is not str:
        return _length_delimited(tag, key_value(key, value))
    entry = _ENTRIES.get((tag, key, value))
    if entry is None:
        # The most common entry, written out: KeyValue{key, value: AnyValue{string_value}}.
        key_bytes, text = key.encode(), value.encode()
        string = b"\x0a" + _varint(len(text)) + text
        pair = (b"\x0a" + _varint(len(key_bytes)) + key_bytes if key_bytes else b"") + b"\x12" + \
            _varint(len(string)) + string
        entry = tag + _varint(len(pair)) + pair
        if len(_ENTRIES) >= _MAX_ENTRIES:
            _ENTRIES.clear()
        _ENTRIES[(tag, key, value)] = entry
    return entry


def _attributes(tag: bytes, attributes: Mapping[str, Any] | None) -> bytes:
    return b"".join([_entry(tag, key, value) for key, value in (attributes or {}).items()])


def _log_record(fields: LogFields) -> bytes:
    """A LogRecord: time 1, severity number 2 and text 3, body 5, attributes 6, observed time 11,
    event name 12 (no trace context, nothing dropped)."""
    timestamp, observed, severity, severity_text, event_name, body, attributes = fields
    return b"".join((
        b"\x09" + struct.pack("<Q", timestamp) if timestamp else b"",
        b"\x10" + _varint(severity) if severity else b"",
        _string(b"\x1a", severity_text) if severity_text else b"",
        _length_delimited(b"\x2a", any_value(body)),
        _attributes(b"\x32", attributes),
        b"\x59" + struct.pack("<Q", observed) if observed else b"",
        _string(b"\x62", event_name) if event_name else b"",
    ))


def _scope(scope: InstrumentationScope) -> bytes:
    return b"".join((_string(b"\x0a", scope.name) if scope.name else b"",
                     _string(b"\x12", scope.version) if scope.version else b"",
                     _attributes(b"\x1a", scope.attributes)))


def encode_request(groups: Iterable[tuple[Resource, Sequence[LogFields]]],
                   scope: InstrumentationScope) -> ExportLogsServiceRequest:
    """One ExportLogsServiceRequest: per resource (in the given order) one ResourceLogs with one ScopeLogs
    holding its log records in order."""
    resource_logs = []
    for resource, logs in groups:
        scope_logs = b"".join((_length_delimited(b"\x0a", _scope(scope)),
                               *(_length_delimited(b"\x12", _log_record(log)) for log in logs),
                               _string(b"\x1a", scope.schema_url) if scope.schema_url else b""))
        resource_logs.append(b"".join((_length_delimited(b"\x0a", _attributes(b"\x0a", resource.attributes)),
                                       _length_delimited(b"\x12", scope_logs),
                                       _string(b"\x1a", resource.schema_url) if resource.schema_url else b"")))
    request = ExportLogsServiceRequest()
    request.ParseFromString(b"".join(_length_delimited(b"\x0a", r) for r in resource_logs))
    return request


class EncodedLogs:
    """A request encoded beforehand and the number of log records in it, as the exporter is given it."""

    def __init__(self, request: ExportLogsServiceRequest, count: int) -> None:
        self.request = request
        self.count = count

    def __len__(self) -> int:
        return self.count


def grpc_exporter(endpoint: str | None) -> Any:
    """The SDK's gRPC log exporter, to be given `EncodedLogs` instead of SDK log records: its
    `_translate_data`, the step that turns what `export` is given into the request, hands the request
    over as it is. (Defined here, not at import, so that OTLP over HTTP never loads gRPC.)"""
    from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter

    class PrebuiltGrpcExporter(OTLPLogExporter):
        def _translate_data(self, data: Any) -> ExportLogsServiceRequest:
            return data.request if isinstance(data, EncodedLogs) else super()._translate_data(data)

        def _count_data(self, data: Any) -> int:
            return len(data)

    return PrebuiltGrpcExporter(endpoint=endpoint)
