"""Event Hubs events encoded straight from records, as azure-eventhub's `EventDataBatch.add` encodes them.

`add` turns each EventData into the AMQP message it sends and encodes that message twice with the pure-Python
AMQP codec inside azure-eventhub: once to learn its size, once to keep it in the batch. A backlog drain spent
183 µs a record there, more than all it may spend for 10,000 records a second. Here the message of an event
(header, message annotations, properties, application properties and one data section, the sections of AMQP 1.0
part 3 in the order the SDK writes them) is written once, by a few lines of code, and put into the batch with
`add`'s own size accounting. The bytes are the SDK's, byte for byte: tests/test_amqp_wire.py compares the two
for hostile values too.

azure-eventhub has no public seam for an event encoded beforehand, so `add_encoded` reaches into the batch's
private state (`_message.data`, `_size`, `_count`), as the SDK's own transport does. `matches_sdk` checks at
start that both ways still agree on the installed azure-eventhub (a sink that finds they do not keeps `add`),
and tests/test_amqp_wire.py fails loudly when a new version parts them. (Written against azure-eventhub 5.15.1;
pyproject.toml asks for >= 5.11, hence the check at start rather than trust.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

#: The message annotation that carries the partition key (azure-eventhub's PROP_PARTITION_KEY).
PARTITION_KEY = b"x-opt-partition-key"
#: What each event adds to the batch message beyond its own bytes: the data section around it, 5 bytes for an
#: event under 256 bytes and 8 from there (azure-eventhub's _BATCH_MESSAGE_OVERHEAD_COST).
_OVERHEAD_SMALL, _OVERHEAD_LARGE = 5, 8


def _sized(small: int, large: int, payload: bytes) -> bytes:
    """A variable-width value: str8/sym8/vbin8 up to 255 octets, str32/sym32/vbin32 beyond."""
    size = len(payload)
    if size <= 255:
        return bytes((small, size)) + payload
    return bytes((large,)) + size.to_bytes(4, "big") + payload


def _string(text: str) -> bytes:
    return _sized(0xA1, 0xB1, text.encode())


def _symbol(text: bytes) -> bytes:
    return _sized(0xA3, 0xB3, text)


def _compound(small: int, large: int, count: int, payload: bytes) -> bytes:
    """A list (0xc0/0xd0) or map (0xc1/0xd1; `count` is keys plus values) of encoded items: the 8-bit form while
    it fits in 254 octets and 255 items, as the SDK chooses."""
    size = len(payload)
    if count <= 255 and size < 255:
        return bytes((small, size + 1, count)) + payload
    return bytes((large,)) + (size + 4).to_bytes(4, "big") + count.to_bytes(4, "big") + payload


def _section(code: int, value: bytes) -> bytes:
    """A described section: descriptor constructor, smallulong code, value."""
    return b"\x00\x53" + bytes((code,)) + value


_NULL = b"\x40"
#: The header a partition key brings: Header(durable=True), the other four fields null.
_DURABLE_HEADER = _section(0x70, _compound(0xC0, 0xD0, 5, b"\x56\x01" + _NULL * 4))


def prefix(partition_key: str) -> bytes:
    """What every event of a batch for `partition_key` starts with: the durable header and the partition key
    annotation (nothing without a key: the SDK then sets neither)."""
    if not partition_key:
        return b""
    annotations = _symbol(PARTITION_KEY) + _string(partition_key)
    return _DURABLE_HEADER + _section(0x72, _compound(0xC1, 0xD1, 2, annotations))


def properties(message_id: str, content_type: str) -> bytes:
    """The properties section with only message-id (a string) and content-type (a symbol) set; the SDK writes
    all 13 fields, null for the unset ones."""
    fields = _string(message_id) + _NULL * 5 + _symbol(content_type.encode()) + _NULL * 6
    return _section(0x73, _compound(0xC0, 0xD0, 13, fields))


#: Application property keys already encoded (they are a handful of constants).
_KEYS: dict[str, bytes] = {}
_TRUE, _FALSE = b"\x56\x01", b"\x56\x00"


def application_properties(values: Mapping[str, Any]) -> bytes | None:
    """The application-properties section of string keys and string or bool values (none at all: no section, as
    the SDK leaves it out); None when a value is of another type (the caller lets the SDK encode that event)."""
    if not values:
        return b""
    parts = []
    for key, value in values.items():
        encoded_key = _KEYS.get(key)
        if encoded_key is None:
            encoded_key = _string(key)
            if len(_KEYS) < 64:
                _KEYS[key] = encoded_key
        kind = type(value)
        if kind is str:
            parts.append(encoded_key + _string(value))
        elif kind is bool:
            parts.append(encoded_key + (_TRUE if value else _FALSE))
        else:
            return None
    return _section(0x74, _compound(0xC1, 0xD1, 2 * len(parts), b"".join(parts)))


def data(body: bytes) -> bytes:
    """The one data section holding the event's body."""
    return _section(0x75, _sized(0xA0, 0xB0, body))


def add_encoded(batch: Any, event: bytes) -> None:
    """Add an event encoded by this module to an EventDataBatch, as `EventDataBatch.add` would add it: the same
    size accounting against `max_size_in_bytes`, the same ValueError when it does not fit. (Its EventData is not
    kept in the batch's `_internal_events`, which only serves send callbacks and tracing, neither used here.)"""
    size = len(event)
    size_after_add = batch._size + size + (_OVERHEAD_SMALL if size < 256 else _OVERHEAD_LARGE)
    if size_after_add > batch.max_size_in_bytes:
        raise ValueError(f"EventDataBatch has reached its size limit: {batch.max_size_in_bytes}")
    batch._message.data.append(event)
    batch._size = size_after_add
    batch._count += 1


def matches_sdk() -> bool:
    """Whether events encoded and added here leave a batch exactly as the installed azure-eventhub's `add`
    leaves it (the encoded events, the size it counts, the number of events), for a few probe events."""
    from azure.eventhub import EventData, EventDataBatch

    probes: list[tuple[str, str, dict[str, Any], str]] = [("p-1", "id-1", {"a": "b", "t": True, "f": False}, "{}"),
              ("p\u00e9-" + "k" * 300, "\u2603" * 100, {"k" * 300: "v\u00e9" * 200, "t": True},
               "{\"x\":\"" + "\u00e9" * 400 + "\"}"),
              ("", "", {"e": ""}, "")]
    try:
        for key, message_id, values, body in probes:
            theirs = EventDataBatch(max_size_in_bytes=1 << 20, partition_key=key)
            event = EventData(body)
            event.content_type = "application/cloudevents+json"
            event.properties = cast("dict[str | bytes, Any]", dict(values))
            event.message_id = message_id
            theirs.add(event)
            ours = EventDataBatch(max_size_in_bytes=1 << 20, partition_key=key)
            encoded = application_properties(values)
            if encoded is None:
                return False
            add_encoded(ours, prefix(key) + properties(message_id, "application/cloudevents+json") + encoded
                        + data(body.encode()))
            if ([bytes(item) for item in theirs._message.data] != [bytes(item) for item in ours._message.data]
                    or theirs._size != ours._size or len(theirs) != len(ours)):
                return False
    except Exception:  # any change in the SDK's internals means: keep its own add
        return False
    return True
