"""OTLP sink: one OpenTelemetry log record per change, exported synchronously.

Over gRPC the request is encoded by `otlpwire` (the same bytes as the SDK's encoder, at a fraction of
its cost) and sent by the SDK's exporter; over HTTP the SDK's exporter encodes it (it offers no seam
for a request built beforehand). A gRPC sink checks at start that the two still agree on the installed SDK
(`encoder_matches_sdk`: probe records encoded both ways, and handed over by the exporter as they are); where
they do not, it encodes with the SDK, logs that once and shows `azure_scheduled_events_own_codec_in_use{codec=
"otlp"} 0`.

The delivery worker calls `send` and counts the batch delivered only when the exporter reports SUCCESS,
so the outbox keeps every record until the backend acknowledged it (no fire-and-forget batch processor).

Configuration follows the OpenTelemetry standard variables, read by the exporters themselves:
`OTEL_EXPORTER_OTLP_[LOGS_]ENDPOINT`, `..._HEADERS`, `..._CERTIFICATE`, `..._TIMEOUT`, `..._PROTOCOL`
(`grpc` or `http/protobuf`, the default per the specification). `--otlp-endpoint` and `--otlp-protocol`
override them.

Resource attributes follow the semantic conventions and the names used by
opentelemetry-resource-detector-azure (`cloud.*`, `host.*`, `azure.vm.scaleset.name`, `azure.vm.sku`).
They come from the instance metadata forewarn already read (each record carries it), not from the
detector itself: the detector sends its own IMDS request, outside forewarn's 5-per-second budget and
through any configured proxy.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry._logs import LogRecord, SeverityNumber
from opentelemetry.sdk._logs import ReadableLogRecord
from opentelemetry.sdk._logs.export import LogRecordExportResult
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from forewarn import __version__
from forewarn.metrics.codecs import CODECS, CodecChecks
from forewarn.records import CLOUDEVENT_KEYS, JsonRecords, Record, cloudevents
from forewarn.sinks import SinkConfigError, SinkError
from forewarn.sinks.otlpwire import EncodedLogs, KvlistBody, Layout, LogFields, encode_request

log = logging.getLogger(__name__)

PROTOCOLS = ("grpc", "http/protobuf")
_SCOPE = InstrumentationScope("forewarn", __version__)

# What the exporters accept in OTEL_EXPORTER_OTLP_[LOGS_]HEADERS (the specification's W3C-baggage-like
# list, parsed "liberally" by the SDK: unencoded spaces pass). Anything else the SDK drops with a warning
# that prints the whole entry, value included, and then exports without that header.
_HEADER_NAME = re.compile(r"[!#-'*+\-.0-9A-Z^-z|~]+")
_HEADER_VALUE = re.compile(r"[ !#-+\--:<-\[\]-~]*")
_HEADER_SEPARATOR = re.compile(r"[ \t]*,[ \t]*")


def check_header_variables(environ: Mapping[str, str]) -> None:
    """Refuse malformed OTLP header variables naming the variable and the header, never the value (it is
    usually a token): a header the SDK drops would otherwise turn into rejected exports, forever."""
    variable = "OTEL_EXPORTER_OTLP_LOGS_HEADERS"
    if not environ.get(variable):
        variable = "OTEL_EXPORTER_OTLP_HEADERS"
    for position, entry in enumerate(_HEADER_SEPARATOR.split(environ.get(variable, "")), start=1):
        if not entry.strip():
            continue
        name, equals, value = entry.partition("=")
        name = name.strip(" \t")
        if not equals or not _HEADER_NAME.fullmatch(name):
            raise SinkConfigError(f"{variable}: entry {position} is not NAME=VALUE (the entry is not shown: it "
                                  "may hold a secret); valid: comma-separated name=value pairs, values URL-encoded")
        if not _HEADER_VALUE.fullmatch(value.strip(" \t")):
            raise SinkConfigError(f"{variable}: header {name!r} has a value with characters that must be "
                                  "URL-encoded (quotes, semicolons, backslashes, commas, non-ASCII or control "
                                  "characters); the value is not shown")


def _protocol(explicit: str | None) -> str:
    protocol = explicit or os.environ.get("OTEL_EXPORTER_OTLP_LOGS_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
    if protocol not in PROTOCOLS:
        raise SinkConfigError(f"OTLP protocol {protocol!r} is not supported; valid: {', '.join(PROTOCOLS)}")
    return protocol


def resource_for(vm: Mapping[str, str]) -> Resource:
    """Resource attributes for the VM a record came from (unknown values are left out)."""
    attributes: dict[str, Any] = {
        "service.name": "forewarn",
        "service.version": __version__,
        "cloud.provider": "azure",
        "cloud.platform": "azure_vm",
    }
    for key, attribute in (("location", "cloud.region"), ("subscription_id", "cloud.account.id"),
                           ("resource_id", "cloud.resource_id"), ("zone", "cloud.availability_zone"),
                           ("vm_id", "host.id"), ("name", "host.name"), ("vm_size", "host.type"),
                           ("os_type", "os.type"), ("vm_scale_set", "azure.vm.scaleset.name"),
                           ("vm_size", "azure.vm.sku")):
        if vm.get(key):
            attributes[attribute] = vm[key]
    return Resource.create(attributes)


#: A log record's attributes, in order: these always, then the last seven when not None. The record's ids and
#: incarnation (and its resources, a list) are encoded one by one, the other entries together (`Layout`).
_ATTRIBUTES = Layout(
    ("cloudevents.event_id", "cloudevents.event_source", "cloudevents.event_type", "cloudevents.event_subject",
     "azure.scheduled_event.change", "azure.scheduled_event.id", "azure.scheduled_event.type",
     "azure.scheduled_event.status", "azure.scheduled_event.incarnation", "azure.scheduled_event.affects_this_vm",
     "azure.scheduled_event.resources",
     "azure.scheduled_event.source", "azure.scheduled_event.duration_seconds", "azure.scheduled_event.not_before",
     "azure.scheduled_event.outcome", "azure.scheduled_event.previous_status", "azure.scheduled_event.policy_rule",
     "azure.scheduled_event.dry_run"),
    optional=7,
    holes=("cloudevents.event_id", "cloudevents.event_subject", "azure.scheduled_event.id",
           "azure.scheduled_event.incarnation", "azure.scheduled_event.resources"))


#: The body of a log record, the record's CloudEvent (`Record.to_dict()`, whose keys `records.cloudevents`
#: guarantees): its ids, and its data, encoded one by one, the other entries together.
_BODY = Layout(CLOUDEVENT_KEYS, optional=0, holes=("id", "subject", "data"))


def _attribute_values(body: Mapping[str, Any]) -> tuple[Any, ...]:
    """The values of the log record's attributes (`_ATTRIBUTES`' keys), from the record's CloudEvent
    (`Record.to_dict()`)."""
    data = body["data"]
    event = data.get("event", {})
    # IMDS's Resources as the document reads them: anything but a list is ignored (a null or a number here once
    # failed every export of its batch, for ever)
    resources = event.get("Resources")
    return (body["id"], body["source"], body["type"], body["subject"], data["change"],
            event.get("EventId", body["subject"]), event.get("EventType", ""), event.get("EventStatus", ""),
            data.get("incarnation", 0), bool(data.get("affects_this_vm", False)),
            list(resources) if isinstance(resources, list) else [],
            event.get("EventSource"), event.get("DurationInSeconds"), data.get("not_before"), data.get("outcome"),
            data.get("previous_status"), data.get("policy_rule"), data.get("dry_run"))


def _attributes(body: Mapping[str, Any]) -> dict[str, Any]:
    """The log record's attributes, from the record's CloudEvent (`Record.to_dict()`)."""
    return _ATTRIBUTES.mapping(_attribute_values(body))


@functools.lru_cache(maxsize=256)  # the records of one poll share their time
def _nanos(rfc3339: str) -> int:
    from datetime import datetime

    return int(datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp() * 1e9)


_WARN, _INFO = SeverityNumber.WARN.value, SeverityNumber.INFO.value


def _log_fields(record: Record) -> LogFields:
    """What one log record carries: timestamps, severity, event name, body (the whole CloudEvent) and
    attributes."""
    return _fields(record.to_dict())


def _fields(body: dict[str, Any], encoded: bool = False) -> LogFields:
    """`_log_fields` of the record whose `to_dict()` is `body`; with `encoded`, the body's entries and the attributes
    already written by their `Layout`s (for the gRPC request; `body` as `records.cloudevents` gives it, in the order
    of CLOUDEVENT_KEYS)."""
    data = body["data"]
    change = data["change"]
    warn = data["event"].get("EventStatus") == "Started" or change in ("removed", "approved")
    nanos = _nanos(body["time"])
    return (nanos, nanos, _WARN if warn else _INFO, "WARN" if warn else "INFO", f"azure.scheduled_event.{change}",
            KvlistBody(_BODY.encode(b"\x0a", tuple(body.values()))) if encoded else body,
            _ATTRIBUTES.encode(b"\x32", _attribute_values(body)) if encoded else _attributes(body))


def _readable(fields: LogFields, resource: Resource) -> ReadableLogRecord:
    """The SDK's log record for `fields` (the HTTP exporter encodes these itself)."""
    timestamp, observed, severity, severity_text, event_name, body, attributes = fields
    if isinstance(attributes, bytes):
        raise TypeError("the SDK's log record takes the attributes as a mapping, not encoded")
    log_record = LogRecord(timestamp=timestamp, observed_timestamp=observed,
                           severity_number=SeverityNumber(severity), severity_text=severity_text, body=body,
                           attributes=attributes, event_name=event_name)
    return ReadableLogRecord(log_record, resource=resource, instrumentation_scope=_SCOPE)


def probe_records() -> JsonRecords:
    """Records the start-up check encodes both ways, read back from JSON as the outbox hands them out: every field
    a log record takes from a record, two VMs (two Resources), strings past one and two varint bytes, non-ASCII
    text, and values of each JSON type where IMDS may put anything (an event's unknown fields, Resources that are
    not a list, int64's bounds, floats, nested objects and lists, an empty key)."""
    vm = {"name": "vm-0", "vm_id": "4d1824cf-fdc0-5660-b82f-b2a54105ac90", "location": "westeurope", "zone": "2",
          "subscription_id": "s", "resource_group": "rg", "vm_scale_set": "pool", "vm_size": "Standard_D2s_v5",
          "os_type": "Linux",
          "resource_id": "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/vm-0"}
    event: dict[str, Any] = {
        "EventId": "A1B2", "EventType": "Freeze", "ResourceType": "VirtualMachine",
        "Resources": ["vm-0", "vm-1", "vm-\u00e9"], "EventStatus": "Scheduled",
        "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT", "Description": "Host maintenance, \u00e9t\u00e9 \u2603",
        "EventSource": "Platform", "DurationInSeconds": 9}
    hostile = {**event, "EventId": "\U0001f600" * 40, "EventStatus": "Started", "NotBefore": "", "Resources": None,
               "DurationInSeconds": -1, "Description": "x" * 20_000, "Extra": {"": [1.5, -0.0, True, None, {"k": []}],
               "min": -(2**63), "max": 2**63 - 1, "nested": {"a": {"b": "c"}}}}
    cases: list[tuple[str, dict[str, Any], dict[str, Any], dict[str, str]]] = [
        ("added", event, {"not_before": "2022-04-11T22:26:58.000Z"}, vm),
        ("updated", {**event, "EventStatus": "Started"}, {"previous_status": "Scheduled"}, {"name": "vm-1"}),
        ("removed", hostile, {"previous_status": "Started", "outcome": "completed"}, vm),
        ("approved", event, {"policy_rule": "rule-\u00e9", "dry_run": True}, vm)]
    records = []
    for number, (change, body, extra, on) in enumerate(cases):
        data = {"change": change, "incarnation": 2**40 if number == 3 else number, "event": body,
                "affects_this_vm": number % 2 == 0, "vm": on, "not_before": None, **extra}
        records.append(Record(id=f"id-{number}", source=f"/subscriptions/s/vm-{number}",
                              type=f"io.github.forewarn.scheduled_event.{change}", subject=str(body["EventId"]),
                              time="2024-05-01T12:00:00.123Z", data=data).to_json())
    return JsonRecords(records)


class OtlpSink:
    name = "otlp"

    def __init__(self, endpoint: str | None = None, protocol: str | None = None,
                 codecs: CodecChecks = CODECS) -> None:
        self.protocol = _protocol(protocol)
        check_header_variables(os.environ)
        self._endpoint = endpoint
        # Resources by a VM's items, and each Resource once: made once per VM, not once per batch (Resource.create
        # reads the environment and runs the detectors).
        self._resources: dict[tuple[tuple[str, Any], ...], Resource] = {}
        self._canonical: dict[Resource, Resource] = {}
        #: Whether requests are encoded here (`otlpwire`) rather than by the SDK: over gRPC, while they agree.
        self.own_encoder = self.protocol == "grpc"
        self._exporter: Any = self._new_exporter()
        if self.own_encoder:
            self.own_encoder = self.encoder_matches_sdk()
            codecs.checked("otlp", self.own_encoder)
            if not self.own_encoder:
                log.warning("OTLP: forewarn's own encoder and the installed OpenTelemetry SDK encode the probe records "
                            "differently; requests are encoded by the SDK instead (slower)")
                self._exporter.shutdown()
                self._exporter = self._new_exporter()

    def encoder_matches_sdk(self) -> bool:
        """Whether this sink's own gRPC request for `probe_records()` is the SDK's (`encode_logs` of the same log
        records, serialised), byte for byte, and the exporter sends it as it is (its private `_translate_data`
        and `_client`, which `otlpwire.grpc_exporter` relies on, still work as they did)."""
        from forewarn.sinks.otlpwire import SerializedLogsStub

        try:
            from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs

            records = probe_records()
            ours = self.encode(records)
            theirs = encode_logs(self.encode(records, own=False)).SerializeToString()
            if not isinstance(ours, EncodedLogs) or ours.request != theirs or ours.count != len(records):
                return False
            handed = self._exporter._translate_data(ours)
            if isinstance(self._exporter._client, SerializedLogsStub):
                return bool(handed == theirs)
            return bool(handed.SerializeToString() == theirs)
        except Exception:  # any change in the SDK's internals means: let the SDK encode
            log.debug("OTLP: the start-up check of the own encoder failed", exc_info=True)
            return False

    def _new_exporter(self) -> Any:
        if self.protocol == "grpc":
            if not self.own_encoder:
                from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter as GrpcExporter

                return GrpcExporter(endpoint=self._endpoint)
            from forewarn.sinks.otlpwire import grpc_exporter

            return grpc_exporter(self._endpoint)
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter as HttpExporter

        return HttpExporter(endpoint=self._endpoint)

    def idle(self) -> None:
        """Close an unused gRPC channel: gRPC's own threads (event engine, timers) cost about 0.4 ms of
        CPU a second while a channel exists, more than polling IMDS. The next send opens a new one."""
        if self.protocol == "grpc":
            self.close()

    def _by_resource(self, bodies: Sequence[dict[str, Any]]) -> dict[Resource, list[dict[str, Any]]]:
        """The records (as `Record.to_dict()`) grouped by the Resource of their VM, in order (as the SDK's encoder
        groups them)."""
        if len(self._resources) > 256:  # VMs come and go (fleet mode forwards many): keep the cache bounded
            self._resources.clear()
            self._canonical.clear()
        groups: dict[int, tuple[Resource, list[dict[str, Any]]]] = {}  # by the Resource's id: its hash is costly
        for body in bodies:
            vm = tuple(body["data"].get("vm", {}).items())
            try:
                resource = self._resources.get(vm)
            except TypeError:  # a value that cannot be a dict key: made afresh
                resource = self._resource(vm)
            if resource is None:
                resource = self._resources[vm] = self._resource(vm)
            group = groups.get(id(resource))
            if group is None:
                group = groups[id(resource)] = (resource, [])
            group[1].append(body)
        return dict(groups.values())

    def _resource(self, vm: tuple[tuple[str, Any], ...]) -> Resource:
        """The Resource of a VM; one object for all VMs with equal Resources (records are grouped by it)."""
        resource = resource_for(dict(vm))
        return self._canonical.setdefault(resource, resource)

    def encode(self, records: Sequence[Record], own: bool | None = None) -> Any:
        """The export of `records`, ready for `send_encoded`: with the own encoder (`own`, by default while
        `own_encoder`) the gRPC request itself, otherwise the SDK's log records (its exporter encodes them)."""
        groups = self._by_resource(cloudevents(records))
        if self.own_encoder if own is None else own:
            logs = ((resource, [_fields(body, encoded=True) for body in group]) for resource, group in groups.items())
            return EncodedLogs(encode_request(logs, _SCOPE), len(records))
        return [_readable(_fields(body), resource) for resource, group in groups.items() for body in group]

    def send_encoded(self, payload: Any) -> None:
        if self._exporter is None:
            self._exporter = self._new_exporter()
        try:
            result = self._exporter.export(payload)
        except Exception as exc:  # the exporters raise for some transport errors instead of returning FAILURE
            raise SinkError(f"OTLP export ({self.protocol}) failed: {type(exc).__name__}") from exc
        if result != LogRecordExportResult.SUCCESS:
            raise SinkError(f"OTLP export ({self.protocol}) was not acknowledged")

    def send(self, records: Sequence[Record]) -> None:
        self.send_encoded(self.encode(records))

    def close(self) -> None:
        if self._exporter is not None:
            self._exporter.shutdown()
            self._exporter = None
