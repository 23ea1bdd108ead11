"""The gRPC OTLP sink checks at start that its own encoder still writes the SDK's bytes, and uses the SDK's where
it does not: once logged, shown in a metric, and every record still delivered (to the local OTLP receiver)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

from forewarn.fleet.metrics import FleetMetrics
from forewarn.metrics import Metrics
from forewarn.metrics.codecs import CODECS, CodecChecks
from forewarn.records import JsonRecords, Record
from forewarn.sinks import otlp
from forewarn.sinks.otlp import OtlpSink, probe_records
from forewarn.sinks.otlpwire import EncodedLogs, SerializedLogsStub
from test_otlp_wire import sample_records

from peers.otlp import GrpcReceiver

SERIES = 'azure_scheduled_events_own_codec_in_use{codec="otlp"}'


@pytest.fixture
def receiver() -> Iterator[GrpcReceiver]:
    peer = GrpcReceiver()
    yield peer
    peer.stop()


@pytest.fixture
def codecs(monkeypatch: pytest.MonkeyPatch) -> CodecChecks:
    """The process's checks, emptied for the test and put back after it."""
    monkeypatch.setattr(CODECS, "_used", {})
    return CODECS


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == otlp.__name__ and r.levelno >= logging.WARNING]


def shown(value: float) -> list[str]:
    """The series in the agent's and in fleet mode's exposition."""
    line = f"{SERIES} {value}"
    return [line for render in (Metrics().render, FleetMetrics(["queue"]).render)
            if line in render()[0].decode().splitlines()]


def test_the_check_passes_with_the_installed_sdk(codecs: CodecChecks, caplog: pytest.LogCaptureFixture) -> None:
    sink = OtlpSink(endpoint="http://127.0.0.1:9", protocol="grpc")
    try:
        assert sink.own_encoder and sink.encoder_matches_sdk()
        assert isinstance(sink._exporter._client, SerializedLogsStub)
        assert isinstance(sink.encode(probe_records()), EncodedLogs)
    finally:
        sink.close()
    assert codecs.own("otlp") is True and warnings(caplog) == []
    assert len(shown(1.0)) == 2


def test_the_probes_cover_what_a_record_can_carry() -> None:
    """Two Resources, every change kind's fields, long and non-ASCII strings, and every JSON type."""
    records = probe_records()
    request = ExportLogsServiceRequest.FromString(sdk_request(records).SerializeToString())
    assert len(request.resource_logs) == 2
    text = "".join(json.dumps(json.loads(record), ensure_ascii=False, separators=(",", ":"))
                   for record in records.texts)
    for needle in ('"outcome"', '"previous_status"', '"policy_rule"', '"dry_run":true', '"Resources":null',
                   "-9223372036854775808", "9223372036854775807", "1.5", "-0.0", '"":', "x" * 20_000):
        assert needle in text, needle
    assert any(ord(c) > 0xFFFF for c in text) and any(0x7F < ord(c) <= 0xFFFF for c in text)


def test_the_sink_falls_back_to_the_sdk_when_the_bytes_differ(monkeypatch: pytest.MonkeyPatch, codecs: CodecChecks,
                                                              caplog: pytest.LogCaptureFixture,
                                                              receiver: GrpcReceiver) -> None:
    """The own encoder broken in the most innocent way: an empty unknown field appended, which any receiver would
    accept. The check sees the difference; the sink says so once and sends what the SDK encodes."""
    real = otlp.encode_request
    monkeypatch.setattr(otlp, "encode_request", lambda groups, scope: real(groups, scope) + b"\x12\x00")
    caplog.set_level(logging.DEBUG, logger=otlp.__name__)
    sink = OtlpSink(endpoint=receiver.endpoint, protocol="grpc")
    try:
        assert not sink.own_encoder and codecs.own("otlp") is False
        assert len(shown(0.0)) == 2 and shown(1.0) == []
        records = sample_records()
        batches = [JsonRecords([r.to_json() for r in records[:5]]), JsonRecords([r.to_json() for r in records[5:]])]
        for batch in batches:
            payload = sink.encode(batch)
            assert not isinstance(payload, EncodedLogs)
            sink.send_encoded(payload)
        sink.idle()  # the channel closed and opened again: still the SDK's exporter
        sink.send(batches[0])
    finally:
        sink.close()
    assert len(warnings(caplog)) == 1 and "encoded by the SDK" in warnings(caplog)[0]
    delivered = [log["attrs"]["cloudevents.event_id"] for log in receiver.received.log_records()]
    assert delivered == [r.id for r in records] + [r.id for r in records[:5]]
    for request, batch in zip(receiver.received.requests, [*batches, batches[0]], strict=True):
        assert request == sdk_request(batch)


def sdk_request(records: JsonRecords) -> Any:
    sink = OtlpSink(endpoint="http://127.0.0.1:9", protocol="http/protobuf")
    try:
        return encode_logs(sink.encode(records))
    finally:
        sink.close()


def test_a_check_that_cannot_run_counts_as_a_difference(monkeypatch: pytest.MonkeyPatch, codecs: CodecChecks,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """An SDK whose exporter lost what `otlpwire.grpc_exporter` relies on (here `_translate_data` raising, as a
    renamed attribute would) is not trusted with the own requests."""
    from forewarn.sinks import otlpwire

    real = otlpwire.grpc_exporter

    def broken(endpoint: str | None) -> Any:
        exporter = real(endpoint)

        def translate(data: Any) -> Any:
            raise AttributeError("_translate_data")

        exporter._translate_data = translate
        return exporter

    monkeypatch.setattr(otlpwire, "grpc_exporter", broken)
    sink = OtlpSink(endpoint="http://127.0.0.1:9", protocol="grpc")
    try:
        assert not sink.own_encoder and codecs.own("otlp") is False
        assert type(sink._exporter).__name__ == "OTLPLogExporter"
    finally:
        sink.close()
    assert len(warnings(caplog)) == 1


def test_over_http_the_sdk_encodes_and_there_is_nothing_to_check(codecs: CodecChecks) -> None:
    sink = OtlpSink(endpoint="http://127.0.0.1:9/v1/logs", protocol="http/protobuf")
    try:
        assert not sink.own_encoder and codecs.own("otlp") is None
        assert not isinstance(sink.encode([Record.from_json(probe_records().texts[0])]), EncodedLogs)
    finally:
        sink.close()
    assert shown(0.0) == shown(1.0) == []
