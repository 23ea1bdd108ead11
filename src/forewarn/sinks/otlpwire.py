"""OTLP logs requests encoded straight from records, for the gRPC exporter.

The SDK's encoder builds one protobuf object per value of every log record's body (about 45 for a
record, each through `isinstance` checks against the collection ABCs): a cProfile of a backlog drain
put 80% of the OTLP sink's time there. Here the whole request is written as protobuf wire bytes by a few
lines of code (the messages of opentelemetry-proto's logs.proto and common.proto). A backlog's records
repeat most of their keys and values (the VM, the event's type and status, its resources, the record's
type), so each key, and each entry with a string value, is encoded once and then reused (bounded memos);
objects with the same keys in every record (the attributes, the body's top level) are written by a `Layout`,
their ids one by one and the entries between them as remembered runs. The result is the request the SDK
would send for the same log records, byte for byte (tests/test_otlp_wire.py compares the two); the SDK's gRPC
exporter still sends it, with its endpoint, headers, TLS, compression, retries and timeout, as bytes
(`SerializedLogsStub`).
"""

from __future__ import annotations

import itertools
import operator
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest, ExportLogsServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

#: One log record as the sink describes it: timestamps, severity, event name, body and attributes (a mapping, or
#: its KeyValues already encoded as field 6 of the log record, by a `Layout`).
LogFields = tuple[int, int, int, str, str, Any, "Mapping[str, Any] | bytes"]

_INT64 = 1 << 63


#: The varints of 0-127, one byte each: nearly every length in a log record is one of these.
_SMALL = [bytes((n,)) for n in range(128)]


def _varint(value: int) -> bytes:
    if value < 128:
        return _SMALL[value]
    if value < 16384:  # the length of a nested object or of a log record
        return bytes(((value & 0x7F) | 0x80, value >> 7))
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _length_delimited(tag: bytes, payload: bytes) -> bytes:
    size = len(payload)
    if size < 128:
        return tag + _SMALL[size] + payload
    if size < 16384:  # a nested object, a log record's body or the log record
        return b"".join((tag, bytes(((size & 0x7F) | 0x80, size >> 7)), payload))
    return tag + _varint(size) + payload


def _string(tag: bytes, text: str) -> bytes:
    return _length_delimited(tag, text.encode())


def any_value(value: Any) -> bytes:
    """The AnyValue message for a JSON-like value (string 1, bool 2, int 3, double 4, array 5, kvlist 6,
    bytes 7; None is the empty AnyValue), as the SDK encodes it."""
    kind = type(value)  # the JSON types first, by identity: most values of a record are these
    if kind is str:
        return _string(b"\x0a", value)
    if kind is dict:
        return _length_delimited(b"\x32", _entries(b"\x0a", value))
    if kind is list:
        return _array(value)
    if kind is int:
        return _int(value)
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return _int(int(value))
    if isinstance(value, float):
        return b"\x21" + struct.pack("<d", value)
    if isinstance(value, str):
        return _string(b"\x0a", str(value))
    if isinstance(value, bytes):
        return _length_delimited(b"\x3a", value)
    if isinstance(value, Mapping):
        return _length_delimited(b"\x32", _entries(b"\x0a", value))
    if isinstance(value, Sequence):
        return _array(value)
    raise ValueError(f"cannot encode a {kind.__name__} as an OTLP AnyValue")


#: Integers already encoded as AnyValues (a record's counts, durations and incarnations mostly repeat).
_INTS: dict[int, bytes] = {}


def _int(value: int) -> bytes:
    encoded = _INTS.get(value)
    if encoded is None:
        if not -_INT64 <= value < _INT64:
            raise ValueError(f"integer {value} does not fit OTLP's int64")
        encoded = b"\x18" + _varint(value & 0xFFFF_FFFF_FFFF_FFFF)
        if len(_INTS) >= _MAX_ENTRIES:
            _INTS.clear()
        _INTS[value] = encoded
    return encoded


def _array(value: Sequence[Any]) -> bytes:
    return _length_delimited(b"\x2a", b"".join([_length_delimited(b"\x0a", any_value(v)) for v in value]))


def key_value(key: str, value: Any) -> bytes:
    """The KeyValue message (key 1, value 2); proto3 leaves an empty key out, as the SDK does."""
    return _key(key) + _length_delimited(b"\x12", any_value(value))


#: Keys already encoded as a KeyValue's key field: a record's keys are the same few dozen every time.
_KEYS: dict[str, bytes] = {}
_MAX_KEYS = 1024


def _key(key: str) -> bytes:
    encoded = _KEYS.get(key)
    if encoded is None:
        encoded = _string(b"\x0a", key) if key else b""
        if len(_KEYS) < _MAX_KEYS:
            _KEYS[key] = encoded
    return encoded


#: Per container tag, entries already encoded: by their (key, value) item for a string or an int (neither equals a
#: value of the other type), by (key, value, bool) for a bool (True == 1), by (key, tuple, list) for a list of
#: strings. A backlog's records mostly repeat these from one record to the next (the VM, the
#: event's type and status, its resources and description, the record's type). Each memo is cleared when full:
#: the values seen once (ids, times) fill it, the repeated ones come right back.
_ENTRIES: dict[bytes, dict[tuple[Any, ...], bytes]] = {}
_MAX_ENTRIES = 4096
#: Lists of strings up to this long are remembered whole (an event's resources).
_MAX_MEMO_LIST = 8


def _entries(tag: bytes, mapping: Mapping[Any, Any]) -> bytes:
    """The KeyValues of `mapping`, each as field `tag` of its container (a kvlist's values, a log record's,
    a resource's or a scope's attributes). Keys that are not strings are written as `str(key)`, as the SDK
    writes a kvlist's."""
    memo = _ENTRIES.get(tag)
    if memo is None:
        memo = _ENTRIES[tag] = {}
    parts: list[bytes] = []
    append = parts.append
    for item in mapping.items():
        value = item[1]
        kind = type(value)
        if kind is str or kind is int:  # most entries, most of them seen before: one lookup by the item itself
            entry = memo.get(item)
            if entry is None:
                entry = _remember(memo, item, tag, item[0], value)
        elif kind is dict:
            entry = _nested(tag, item[0], value)
        elif kind is bool:
            memo_key = (item[0], value, kind)
            entry = memo.get(memo_key)
            if entry is None:
                entry = _remember(memo, memo_key, tag, item[0], value)
        elif kind is list and len(value) <= _MAX_MEMO_LIST and all(type(element) is str for element in value):
            memo_key = (item[0], tuple(value), kind)
            entry = memo.get(memo_key)
            if entry is None:
                entry = _remember(memo, memo_key, tag, item[0], value)
        else:
            entry = _entry(tag, item[0], value)
        append(entry)
    return b"".join(parts)


def _entry(tag: bytes, key: Any, value: Any) -> bytes:
    """A KeyValue as field `tag` of its container, encoded afresh."""
    key_field = _KEYS.get(key) or _key(key if type(key) is str else str(key))
    if type(value) is str:  # written out: the commonest entry not seen before (an id, a time)
        return _string_entry(tag, key_field, value)
    if type(value) is int:  # the next commonest (an incarnation): an AnyValue of at most 11 bytes
        encoded = _int(value)
        pair_size = len(key_field) + len(encoded) + 2
        if pair_size < 128:
            return b"".join((tag, _SMALL[pair_size], key_field, b"\x12", _SMALL[len(encoded)], encoded))
    pair = key_field + _length_delimited(b"\x12", any_value(value))
    return _length_delimited(tag, pair)


def _string_entry(tag: bytes, key_field: bytes, value: str) -> bytes:
    """A KeyValue with a string value as field `tag` of its container, its key field given."""
    text = value.encode()
    size = len(text)
    pair_size = len(key_field) + size + 4
    if pair_size < 128:
        return b"".join((tag, _SMALL[pair_size], key_field, b"\x12", _SMALL[size + 2], b"\x0a", _SMALL[size], text))
    return _length_delimited(tag, key_field + _length_delimited(b"\x12", _length_delimited(b"\x0a", text)))


def _remember(memo: dict[tuple[Any, ...], bytes], memo_key: tuple[Any, ...], tag: bytes, key: Any,
              value: Any) -> bytes:
    """`_entry`, kept in `memo` under `memo_key` when its key is a string (True == 1: other keys could collide)."""
    entry = _entry(tag, key, value)
    if type(key) is str:
        if len(memo) >= _MAX_ENTRIES:
            memo.clear()
        memo[memo_key] = entry
    return entry


#: Per (container tag, key), whether that key's object held only strings when first seen (a record's VM does):
#: such an object is remembered whole, by its items. A key whose object held anything else once (a record's data,
#: an event) is not looked at again.
_FLAT: dict[tuple[bytes, str], bool] = {}


def _nested(tag: bytes, key: Any, value: Mapping[Any, Any]) -> bytes:
    """A KeyValue whose value is a kvlist (a nested object)."""
    flat = _FLAT.get((tag, key)) if type(key) is str else False
    whole: tuple[Any, ...] | None = None
    if flat:
        memo = _ENTRIES[tag]
        whole = (key, tuple(value.items()), dict)
        try:
            entry = memo.get(whole)
        except TypeError:  # a value that cannot be a dict key (a list): not flat this time
            entry = whole = None
        if entry is not None:
            return entry
    inner = _entries(b"\x0a", value)
    # written in one piece (the sizes added up), not copied once per level
    size = len(inner)
    inner_size = _SMALL[size] if size < 128 else _varint(size)
    size += 1 + len(inner_size)  # the AnyValue: kvlist 6
    value_size = _SMALL[size] if size < 128 else _varint(size)
    key_field = _key(key if type(key) is str else str(key))
    size += len(key_field) + 1 + len(value_size)  # the KeyValue: key 1, value 2
    entry = b"".join((tag, _SMALL[size] if size < 128 else _varint(size), key_field, b"\x12", value_size, b"\x32",
                      inner_size, inner))
    if flat is not False:  # seen for the first time, or flat so far: only objects of string keys and values are
        # remembered, no other value can equal theirs (True == 1)
        flat = len(value) <= _MAX_MEMO_LIST and all(type(k) is str and type(v) is str for k, v in value.items())
        if len(_FLAT) < _MAX_KEYS or (tag, key) in _FLAT:
            _FLAT[(tag, key)] = flat
        if flat:
            memo = _ENTRIES[tag]
            if len(memo) >= _MAX_ENTRIES:
                memo.clear()
            memo[whole or (key, tuple(value.items()), dict)] = entry
    return entry


def _attributes(tag: bytes, attributes: Mapping[str, Any] | None) -> bytes:
    return _entries(tag, attributes) if attributes else b""


def _one(tag: bytes, key: str, value: Any) -> bytes:
    """The KeyValue `_entries` writes for one entry."""
    if type(value) is dict:
        return _nested(tag, key, value)
    memo = _ENTRIES.get(tag)
    if memo is not None:
        if type(value) is str or type(value) is int:
            item = (key, value)
            return memo.get(item) or _remember(memo, item, tag, key, value)
        if type(value) is list and len(value) <= _MAX_MEMO_LIST and all(type(element) is str for element in value):
            memo_key = (key, tuple(value), list)
            return memo.get(memo_key) or _remember(memo, memo_key, tag, key, value)
    return _entries(tag, {key: value})


class Layout:
    """Objects with the same keys in the same order in every log record (the OTLP sink's attributes, its body),
    given as the tuple of their values and encoded as `_entries` encodes the mapping of the same entries, with
    less work: the entries at `holes` (values that differ in every record: ids) one by one, the runs of entries
    between them together, remembered by their values and the values' types (True == 1 == 1.0, but not with their
    types; 0.0 == -0.0 even with them, so with a float among them the object is encoded entry by entry). The last
    `optional` keys are left out when their value is None."""

    def __init__(self, keys: Sequence[str], optional: int, holes: Iterable[str]) -> None:
        self.keys = tuple(keys)
        self._required = len(self.keys) - optional
        self._holes = tuple(self.keys.index(key) for key in holes)
        if list(self._holes) != sorted(self._holes) or max(self._holes) >= self._required:
            raise ValueError("holes must be required keys, in order")
        stable = [i for i in range(len(self.keys)) if i not in self._holes]
        self._stable = operator.itemgetter(*stable)
        self._key_fields = tuple(_key(key) for key in self.keys)
        self._memo: dict[tuple[Any, ...], tuple[bytes, ...]] = {}

    def mapping(self, values: Sequence[Any]) -> dict[str, Any]:
        """The object as a mapping (what the SDK is given)."""
        return {key: value for index, (key, value) in enumerate(zip(self.keys, values, strict=True))
                if value is not None or index < self._required}

    def encode(self, tag: bytes, values: tuple[Any, ...]) -> bytes:
        """The object's KeyValues, each as field `tag` of its container."""
        stable = self._stable(values)
        types = tuple(map(type, stable))
        if float in types:  # 0.0 == -0.0, and they hash alike, but their bytes differ
            return _entries(tag, self.mapping(values))
        try:
            memo_key = (stable, types)
            between = self._memo.get(memo_key)
        except TypeError:  # a list or an object between the holes: no key for it
            return _entries(tag, self.mapping(values))
        if between is None:
            between = self._memo[memo_key] = self._between(tag, values)
        parts = [between[0]]
        append = parts.append
        keys = self.keys
        for run, hole in enumerate(self._holes, 1):
            value = values[hole]
            if type(value) is str:  # an id: seen once, not remembered
                append(_string_entry(tag, self._key_fields[hole], value))
            else:
                append(_one(tag, keys[hole], value))
            append(between[run])
        return b"".join(parts)

    def _between(self, tag: bytes, values: tuple[Any, ...]) -> tuple[bytes, ...]:
        """The encoded runs of entries before, between and after the holes."""
        if len(self._memo) >= _MAX_ENTRIES:
            self._memo.clear()
        bounds = (-1, *self._holes, len(self.keys))
        return tuple(_entries(tag, {self.keys[i]: values[i] for i in range(start + 1, end)
                                    if values[i] is not None or i < self._required})
                     for start, end in itertools.pairwise(bounds))


#: The strings of a log record that come from a handful (severity texts, event names), already encoded.
_FIELDS: dict[tuple[bytes, str], bytes] = {}


def _field(tag: bytes, text: str) -> bytes:
    encoded = _FIELDS.get((tag, text))
    if encoded is None:
        encoded = _string(tag, text)
        if len(_FIELDS) < _MAX_KEYS:
            _FIELDS[(tag, text)] = encoded
    return encoded


def _log_record(fields: LogFields) -> bytes:
    """A LogRecord: time 1, severity number 2 and text 3, body 5, attributes 6, observed time 11,
    event name 12 (no trace context, nothing dropped)."""
    timestamp, observed, severity, severity_text, event_name, body, attributes = fields
    if type(body) is KvlistBody:  # its AnyValue (kvlist 6) written in one piece with the rest
        size = len(body.entries)
        entries_size = _SMALL[size] if size < 128 else _varint(size)
        size += 1 + len(entries_size)
        body_field: tuple[bytes, ...] = (b"\x2a", _SMALL[size] if size < 128 else _varint(size), b"\x32", entries_size,
                                         body.entries)
    else:
        body_field = (_length_delimited(b"\x2a", any_value(body)),)
    return b"".join((
        b"\x09" + struct.pack("<Q", timestamp) if timestamp else b"",
        b"\x10" + _varint(severity) if severity else b"",
        _field(b"\x1a", severity_text) if severity_text else b"",
        *body_field,
        attributes if isinstance(attributes, bytes) else _attributes(b"\x32", attributes),
        b"\x59" + struct.pack("<Q", observed) if observed else b"",
        _field(b"\x62", event_name) if event_name else b"",
    ))


def _scope(scope: InstrumentationScope) -> bytes:
    return b"".join((_string(b"\x0a", scope.name) if scope.name else b"",
                     _string(b"\x12", scope.version) if scope.version else b"",
                     _attributes(b"\x1a", scope.attributes)))


def encode_request(groups: Iterable[tuple[Resource, Sequence[LogFields]]], scope: InstrumentationScope) -> bytes:
    """One ExportLogsServiceRequest, serialised: per resource (in the given order) one ResourceLogs with one
    ScopeLogs holding its log records in order. Fields go in field-number order, as protobuf serialises them,
    so these are the bytes the SDK's exporter sends for the same log records."""
    resource_logs = []
    for resource, logs in groups:
        scope_logs = b"".join((_length_delimited(b"\x0a", _scope(scope)),
                               *[_length_delimited(b"\x12", _log_record(log)) for log in logs],
                               _string(b"\x1a", scope.schema_url) if scope.schema_url else b""))
        resource_logs.append(b"".join((_length_delimited(b"\x0a", _attributes(b"\x0a", resource.attributes)),
                                       _length_delimited(b"\x12", scope_logs),
                                       _string(b"\x1a", resource.schema_url) if resource.schema_url else b"")))
    return b"".join([_length_delimited(b"\x0a", r) for r in resource_logs])


class KvlistBody:
    """A log record's body that is an object, its entries already encoded (by a `Layout`)."""

    __slots__ = ("entries",)

    def __init__(self, entries: bytes) -> None:
        self.entries = entries


class EncodedLogs:
    """A request serialised beforehand and the number of log records in it, as the exporter is given it."""

    def __init__(self, request: bytes, count: int) -> None:
        self.request = request
        self.count = count

    def __len__(self) -> int:
        return self.count


_EXPORT = "/opentelemetry.proto.collector.logs.v1.LogsService/Export"


class SerializedLogsStub:
    """LogsService's client for a request serialised beforehand: gRPC sends the bytes as they are (no parse into
    a protobuf object and serialisation back, 17 µs a record). Otherwise what the generated LogsServiceStub is."""

    def __init__(self, channel: Any) -> None:
        self.Export = channel.unary_unary(_EXPORT, request_serializer=None,
                                          response_deserializer=ExportLogsServiceResponse.FromString,
                                          _registered_method=True)


def grpc_exporter(endpoint: str | None) -> Any:
    """The SDK's gRPC log exporter, to be given `EncodedLogs` instead of SDK log records: its
    `_translate_data`, the step that turns what `export` is given into the request, hands the request
    over as it is. (Defined here, not at import, so that OTLP over HTTP never loads gRPC.)

    The exporter's client is a `SerializedLogsStub`, through the exporter's private `_stub` and `_client`
    (it makes a new client from `_stub` whenever it reopens its channel). Should a new SDK no longer use
    them, the request is parsed into the protobuf object its client expects: slower, never wrong;
    tests/test_otlp_wire.py fails loudly then."""
    from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter

    class PrebuiltGrpcExporter(OTLPLogExporter):
        def __init__(self, endpoint: str | None) -> None:
            super().__init__(endpoint=endpoint)
            self._stub = SerializedLogsStub
            self._client = self._stub(self._channel)

        def _translate_data(self, data: Any) -> Any:
            if not isinstance(data, EncodedLogs):
                return super()._translate_data(data)
            if isinstance(self._client, SerializedLogsStub):
                return data.request
            return ExportLogsServiceRequest.FromString(data.request)

        def _count_data(self, data: Any) -> int:
            return len(data)

    return PrebuiltGrpcExporter(endpoint=endpoint)
