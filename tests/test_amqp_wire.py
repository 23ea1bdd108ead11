"""The Event Hubs events forewarn encodes itself are the events azure-eventhub's `EventDataBatch.add` makes,
byte for byte, and fill a batch as `add` fills it. These tests pin the private batch state `amqpwire` relies on:
when a new azure-eventhub changes it, they fail here, loudly (and the sink falls back to `add`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from azure.eventhub import EventData, EventDataBatch
from azure.eventhub._pyamqp._encode import encode_payload
from hypothesis import given, settings
from hypothesis import strategies as st

from forewarn.metrics.codecs import CODECS
from forewarn.records import JsonRecords, Record
from forewarn.sinks import amqpwire
from forewarn.sinks.eventhubs import CONTENT_TYPE, EventHubsSink, encoded_event, partition_key, to_event
from test_otlp_wire import sample_records

from peers.amqp import AmqpPeer


@pytest.fixture(scope="module")
def sink() -> Iterator[EventHubsSink]:
    peer = AmqpPeer()
    eventhubs = EventHubsSink(connection_string=peer.connection_string)
    yield eventhubs
    eventhubs.close()
    peer.stop()


def sdk_batches(sink: EventHubsSink, records: list[Record]) -> list[EventDataBatch]:
    """What the sink built before it encoded events itself: `add` of each record's EventData."""
    groups: dict[str, list[Record]] = {}
    for record in records:
        groups.setdefault(partition_key(record), []).append(record)
    batches = []
    for key, group in groups.items():
        batch = sink._client.create_batch(partition_key=key)
        for record in group:
            batch.add(to_event(record))
        batches.append(batch)
    return batches


def wire(batch: EventDataBatch) -> bytes:
    """The batch message as the producer puts it on the wire."""
    output = bytearray()
    encode_payload(output, batch._message)
    return bytes(output)


def hostile_records() -> list[Record]:
    """Records whose strings need the 32-bit encodings, non-ASCII, empty values, and one without a VM."""
    long = "\u00e9t\u00e9 \u2603 " * 40
    records = []
    for i, (name, event_id, status) in enumerate([("vm-\u00e9", "E-" + long, "Scheduled"), ("", "", ""),
                                                  ("v" * 300, "E", long), ("vm-0", "\U0001f600", "Started")]):
        vm = {"name": name, "vm_id": f"id-{i}" if name else ""}
        data = {"change": "added" if i % 2 else "status_changed", "incarnation": 2**62, "affects_this_vm": i % 2 == 0,
                "event": {"EventId": event_id, "EventType": "Reboot", "EventStatus": status, "Resources": [],
                          "Description": long, "DurationInSeconds": -1.5},
                "vm": vm if name else {}}
        records.append(Record(id=f"{i}-" + long[: i * 100], source="" if i == 1 else "/s/\u00e9", type="t",
                              subject=event_id, time="2024-05-01T12:00:00.123Z", data=data))
    return list(JsonRecords([record.to_json() for record in records]))


def test_the_installed_azure_eventhub_matches_and_the_sink_uses_it(sink: EventHubsSink) -> None:
    assert amqpwire.matches_sdk()
    assert sink._encode_ourselves
    assert CODECS.own("amqp") is True        # azure_scheduled_events_own_codec_in_use{codec="amqp"} 1


def test_a_sdk_that_no_longer_matches_makes_the_sink_encode_with_it_and_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(amqpwire, "matches_sdk", lambda: False)
    monkeypatch.setattr(CODECS, "_used", dict(CODECS._used))   # the process-wide checks as they were, after
    sink = EventHubsSink(connection_string="Endpoint=sb://127.0.0.1:1/;SharedAccessKeyName=a;SharedAccessKey=b;"
                                           "EntityPath=hub")
    try:
        assert not sink._encode_ourselves and CODECS.own("amqp") is False
        out: list[str] = []
        for family in CODECS.collect():
            family.write(out, openmetrics=False)
        text = "".join(out)
        assert 'azure_scheduled_events_own_codec_in_use{codec="amqp"} 0' in text
    finally:
        sink.close()


@pytest.mark.parametrize("records", [sample_records(), hostile_records()], ids=["sample", "hostile"])
def test_batches_are_the_sdks_byte_for_byte(sink: EventHubsSink, records: list[Record]) -> None:
    ours, theirs = sink.encode(records), sdk_batches(sink, records)
    assert len(ours) == len(theirs) >= 2
    for mine, sdk in zip(ours, theirs, strict=True):
        assert [bytes(event) for event in mine._message.data] == [bytes(event) for event in sdk._message.data]
        assert wire(mine) == wire(sdk)
        assert (mine._size, len(mine), mine.max_size_in_bytes) == (sdk._size, len(sdk), sdk.max_size_in_bytes)


property_values = st.text(max_size=300) | st.booleans()
#: Any character, lone surrogates included (a record read back from JSON may hold them).
any_text = st.text(st.characters(blacklist_categories=()), max_size=300)


@settings(max_examples=300, deadline=None)
@given(key=any_text, message_id=any_text, body=st.text(max_size=400),
       values=st.dictionaries(st.text(min_size=1, max_size=280), any_text | st.booleans(), max_size=6))
def test_any_event_encodes_as_add_encodes_it(key: str, message_id: str, values: dict[str, Any], body: str) -> None:
    def ours() -> EventDataBatch:
        application = amqpwire.application_properties(values)
        assert application is not None
        encoded = (amqpwire.prefix(key) + amqpwire.properties(message_id, CONTENT_TYPE) + application
                   + amqpwire.data(body.encode()))
        batch = EventDataBatch(max_size_in_bytes=1 << 20, partition_key=key)
        amqpwire.add_encoded(batch, encoded)
        return batch

    event = EventData(body)
    event.content_type = CONTENT_TYPE
    event.properties = dict(values)
    event.message_id = message_id
    try:
        sdk = EventDataBatch(max_size_in_bytes=1 << 20, partition_key=key)
        sdk.add(event)
    except UnicodeEncodeError:  # a lone surrogate: neither can encode it
        with pytest.raises(UnicodeEncodeError):
            ours()
        return
    mine = ours()
    assert [bytes(e) for e in mine._message.data] == [bytes(e) for e in sdk._message.data]
    assert (mine._size, len(mine)) == (sdk._size, len(sdk))


def test_a_value_only_the_sdk_encodes_is_left_to_it(sink: EventHubsSink) -> None:
    record = sample_records()[0]
    odd = Record(id=record.id, source=record.source, type=record.type, subject=record.subject, time=record.time,
                 data={**record.data, "event": {**record.data["event"], "EventType": 7}})
    assert amqpwire.application_properties({"n": 7}) is None and amqpwire.application_properties({"n": None}) is None
    assert encoded_event(amqpwire.prefix("k"), odd) is None
    (ours,), (theirs,) = sink.encode([odd, record]), sdk_batches(sink, [odd, record])
    assert wire(ours) == wire(theirs) and ours._size == theirs._size and len(ours) == 2


@pytest.mark.parametrize("limit", [200, 1500, 5000])
def test_a_full_batch_refuses_the_same_event_as_add(limit: int) -> None:
    records = hostile_records() + sample_records()
    sdk = EventDataBatch(max_size_in_bytes=limit, partition_key="k")
    ours = EventDataBatch(max_size_in_bytes=limit, partition_key="k")
    start = amqpwire.prefix("k")
    for record in records:
        try:
            sdk.add(to_event(record))
        except ValueError as exc:
            with pytest.raises(ValueError, match="size limit"):
                amqpwire.add_encoded(ours, encoded_event(start, record) or b"")
            assert str(exc).startswith("EventDataBatch has reached its size limit")
            break
        amqpwire.add_encoded(ours, encoded_event(start, record) or b"")
    else:
        pytest.fail("the limit was never reached")
    assert (wire(ours), ours._size, len(ours)) == (wire(sdk), sdk._size, len(sdk))


def test_a_full_batch_splits_at_the_links_max_message_size() -> None:
    first = sample_records()[0]
    records = [record for record in sample_records() * 40 if partition_key(record) == partition_key(first)]
    peer = AmqpPeer(max_message_size=20_000)
    small = EventHubsSink(connection_string=peer.connection_string)
    try:
        batches = small.encode(records)
        small.send_encoded(batches)
    finally:
        small.close()
        peer.stop()
    assert len(batches) > 1 and sum(len(batch) for batch in batches) == len(records)
    assert [bytes(m.data[0]) for m in peer.received.events()] == [r.to_json().encode() for r in records]
    assert all(batch._size <= 20_000 for batch in batches)
    sent = [bytes(event) for batch in batches for event in batch._message.data]
    start = amqpwire.prefix(partition_key(records[0]))
    assert sent == [encoded_event(start, record) for record in records]
