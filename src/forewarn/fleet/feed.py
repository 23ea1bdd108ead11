"""Scheduled Events from the central feeds, as value types, and the parsers that build them.

Azure publishes the Scheduled Events of VMs, scale sets and availability sets that opted in to two
central places, both in preview: Azure Resource Graph (table `maintenanceresources`, polled) and Event
Grid (a system topic per subscription, delivered to a Storage queue or pushed over HTTPS, in the Event
Grid or the CloudEvents 1.0 schema). Both carry the same
PascalCase event fields IMDS sends, wrapped in an envelope that names the event by its ARM ID:
`{target}/providers/Microsoft.Maintenance/scheduledevents/{EventId}`.

Every input crosses the same boundary as an IMDS reply (`imds/reply.py`: size, containers, depth, UTF-8,
finite numbers), and the event fields are read by the IMDS document rules (`imds/document.py`), so a
`FleetEvent` carries the very `Event` the per-VM path uses. What differs centrally:
- two more statuses, Completed and Canceled (IMDS drops an event instead);
- NotBefore is empty once an event has Started, and reads as None without a warning;
- one event may name many VMs: a scale-set or availability-set event lists their names in Resources.

A message that cannot be trusted raises `FeedError` (the caller counts it and moves the message aside);
an Event Grid event of another kind in a batch is skipped and counted, never an error, because the
subscription's filter is the operator's and a stray event must not hold back the scheduled ones beside it.
"""

from __future__ import annotations

import base64
import binascii
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import Any, Literal, NamedTuple

from forewarn.fleet.armid import (
    COMPUTE_NAMESPACE,
    SCHEDULED_EVENTS_NAMESPACE,
    SCHEDULED_EVENTS_TYPE,
    VIRTUAL_MACHINE_SCALE_SETS,
    VIRTUAL_MACHINES,
    ArmId,
    ArmIdError,
    is_scheduled_event_id,
    is_valid_name,
    parse_arm_id,
    scheduled_event_id,
    split_scheduled_event_id,
)
from forewarn.imds.document import DocumentError, Event, shown

# The IMDS rules for one event's fields, reused rather than copied so both paths read an event alike:
# identifying fields (EventId, EventType, EventStatus) refuse, descriptive ones become warnings.
from forewarn.imds.document import _parse_event as _parse_event_fields
from forewarn.imds.reply import ReplyError, capped, check_value, decode_reply

#: Statuses documented for the central feeds: IMDS's two, and the two only the central feeds send.
FLEET_STATUSES = ("Scheduled", "Started", "Completed", "Canceled")

Origin = Literal["resourcegraph", "eventgrid"]
RESOURCE_GRAPH: Origin = "resourcegraph"
EVENT_GRID: Origin = "eventgrid"

#: Largest message or row read (bytes, or characters for text). Event Grid caps one event, and one
#: pushed batch, at 1 MB; a Storage queue message holds at most 64 KiB (both from Azure's general
#: service limits, not the Scheduled Events pages). A scale-set event naming 1000 VMs is about 40 KiB.
DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024
#: Most events in one message: the largest batch an Event Grid push subscription can be set to deliver.
MAX_EVENTS_PER_MESSAGE = 5000
#: Fields whose values repeat across a fleet's events (a few documented values each): kept as one shared string
#: per value instead of one per event, as the location is (about 5 MiB at 20,000 open events).
_REPEATED_FIELDS = frozenset(("EventType", "EventStatus", "ResourceType", "EventSource"))
_REPEATED_MAX_CHARS = 64


def _shared(value: Any) -> Any:
    """One string object for equal short strings (sys.intern), anything else as it is."""
    return sys.intern(value) if isinstance(value, str) and len(value) <= _REPEATED_MAX_CHARS else value


class FeedError(ValueError):
    """The input is not a usable central-feed message or row; the message says what and where."""


class EventVms(NamedTuple):
    """What an event's target says about the VMs it acts on: read from its ARM ID once per event and kept, since
    records, metrics and node actions all ask (a first snapshot of 100,000 VMs asked three times per VM)."""

    on_vm: bool                 # the target is a VM: it is the one VM
    scale_set: str              # the scale set's name for an event on one, else ""
    names: tuple[str, ...]      # the VMs' names, in the order of Resources (the target's name for a VM)
    normalized: bool = False    # the event's resource_id is spelt as the parse writes it (str(target))

    @classmethod
    def of(cls, target: ArmId, resources: tuple[str, ...], normalized: bool = False) -> EventVms:
        if target.is_type(COMPUTE_NAMESPACE, VIRTUAL_MACHINES):
            return cls(True, "", (target.name,), normalized)
        scale_set = target.name if target.is_type(COMPUTE_NAMESPACE, VIRTUAL_MACHINE_SCALE_SETS) else ""
        return cls(False, scale_set, tuple(name for name in resources if is_valid_name(name)), normalized)


@dataclass(frozen=True, slots=True)
class FleetEvent:
    """One scheduled event as a central feed reports it.

    `resource_id` is the ARM ID of the VM, scale set or availability set the event is on (the event's
    own ARM ID without its `/providers/Microsoft.Maintenance/scheduledevents/{EventId}` suffix); use
    `vm_ids()` for the VMs it acts on. `event_time` and `delivery_id` come from the Event Grid envelope
    (eventTime or CloudEvents time; the envelope id, the same on every duplicate delivery) and are None
    for Resource Graph rows. `warnings` lists what the tolerant parts of the parser passed over.
    """

    resource_id: str
    subscription_id: str
    resource_group: str
    event: Event
    origin: Origin
    event_time: datetime | None = None
    delivery_id: str | None = None
    location: str | None = None
    warnings: tuple[str, ...] = field(default=(), compare=False)
    # What `vms` and `key` make once, kept beside the fields (slots: the fleet holds 20,000 of these at 100,000 VMs).
    _vms: EventVms | None = field(default=None, init=False, compare=False, repr=False)
    _key: tuple[str, str] | None = field(default=None, init=False, compare=False, repr=False)

    @property
    def event_id(self) -> str:
        return self.event.event_id

    @property
    def status(self) -> str:
        """Scheduled, Started, Completed or Canceled; an unknown status is passed through as sent."""
        return self.event.status

    @property
    def arm_id(self) -> str:
        """The event's own ARM ID: where the central acknowledge call is sent (and what the saved state keeps)."""
        event_id = self.event.event_id
        if self.vms.normalized and is_valid_name(event_id):  # what scheduled_event_id writes, without a parse
            return f"{self.resource_id}/providers/{SCHEDULED_EVENTS_NAMESPACE}/{SCHEDULED_EVENTS_TYPE}/{event_id}"
        return scheduled_event_id(self.resource_id, event_id)

    @property
    def vms(self) -> EventVms:
        """The VMs it acts on, from `resource_id` parsed once (the feed parsers hand over their own parse)."""
        vms = self._vms
        if vms is None:
            target = parse_arm_id(self.resource_id)
            vms = EventVms.of(target, self.event.resources, normalized=str(target) == self.resource_id)
            object.__setattr__(self, "_vms", vms)
        return vms

    @property
    def key(self) -> tuple[str, str]:
        """(target resource, EventId) in lower case, as tracker.event_key compares events; made once per event,
        since the tracker and the metrics both keep it for every open one."""
        key = self._key
        if key is None:
            key = self.resource_id.lower(), self.event.event_id.lower()
            object.__setattr__(self, "_key", key)
        return key


@dataclass(frozen=True)
class FeedResult:
    """What one message held: its scheduled events in order, how many events of other kinds were
    skipped, and every warning (the message's and its events', capped)."""

    events: tuple[FleetEvent, ...]
    skipped: int = 0
    warnings: tuple[str, ...] = ()


def vm_ids(event: FleetEvent) -> tuple[str, ...]:
    """The ARM IDs of the VMs `event` acts on.

    The documented rule (Scheduled Events in Event Grid, "finding the virtual machine ID"): an event on a
    VM acts on that VM; for an event on a scale set or an availability set, each name in Resources becomes
    `/subscriptions/{s}/resourceGroups/{rg}/providers/Microsoft.Compute/virtualMachines/{name}`, with the
    subscription and resource group of the event. Names are used as given: a Uniform scale-set instance
    such as `web_3` is not rewritten into the scale set's own instance ID. A name that cannot be part of
    an ARM ID is left out (the parser warned about it).
    """
    vms = event.vms
    if vms.on_vm:
        return (event.resource_id,)
    # The names were checked once (EventVms.of) and the scope is the target's: vm_id's spelling, unchecked again.
    prefix = f"/subscriptions/{event.subscription_id}/resourceGroups/{event.resource_group}" \
             f"/providers/{COMPUTE_NAMESPACE}/{VIRTUAL_MACHINES}/"
    return tuple(prefix + name for name in vms.names)


# --- the boundary --------------------------------------------------------------------------------------

def _checked(payload: bytes | str | Any, max_bytes: int, what: str) -> tuple[Any, list[str]]:
    """The payload as a checked JSON value and the warnings about replaced values."""
    try:
        if isinstance(payload, (bytes, bytearray, memoryview)):
            body = bytes(payload)
            if len(body) > max_bytes:
                raise FeedError(f"{what} of {len(body)} bytes is larger than {max_bytes}")
            return decode_reply(body)
        if isinstance(payload, str):
            if len(payload) > max_bytes:
                raise FeedError(f"{what} of {len(payload)} characters is larger than {max_bytes}")
            return decode_reply(payload)
        return check_value(payload)
    except ReplyError as exc:
        raise FeedError(f"{what}: {exc}") from None
    except RecursionError:
        raise FeedError(f"{what} is nested too deeply") from None


_JSON_START = re.compile(r"\A\ufeff?\s*[\[{]")
_LINE_BREAKS = re.compile(r"[\r\n]+")


def _unwrapped(text: str) -> str:
    """A queue message body as JSON text: as it is, or decoded from base64.

    Event Grid's Storage-queue delivery base64-encodes each message, while a message put on the queue by
    hand or by another tool may be plain JSON. The two cannot be confused: JSON for an event or a batch
    starts with `{` or `[`, and neither is in the base64 alphabet.
    """
    if _JSON_START.match(text):
        return text
    # Line breaks are allowed (MIME-style base64 wraps lines); a space inside is not base64.
    packed = _LINE_BREAKS.sub("", text.strip())
    if not packed:
        raise FeedError("queue message is empty")
    try:
        decoded = base64.b64decode(packed.encode("ascii"), validate=True)
    except (binascii.Error, ValueError):
        raise FeedError("queue message is neither JSON nor base64-encoded JSON") from None
    try:
        inner = decoded.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FeedError(f"queue message is base64 of bytes that are not UTF-8 (offset {exc.start})") from None
    if not _JSON_START.match(inner):
        raise FeedError("queue message is base64, but what it encodes is not a JSON object or array")
    return inner


# --- parsers -------------------------------------------------------------------------------------------

def parse_queue_message(message: bytes | str | Any, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> FeedResult:
    """The scheduled events in one Storage-queue message that an Event Grid subscription delivered.

    `message` is the body as bytes or text, plain JSON or base64-encoded JSON, or a value already decoded
    from JSON (a str is always message text, never a decoded JSON string). It holds one event or an array
    of them, in the Event Grid or the CloudEvents 1.0 schema. Raises FeedError, and nothing else, when the
    message cannot be used as a whole.
    """
    if isinstance(message, (bytes, bytearray, memoryview)):
        body = bytes(message)
        if len(body) > max_bytes:
            raise FeedError(f"queue message of {len(body)} bytes is larger than {max_bytes}")
        try:
            message = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FeedError(f"queue message is not UTF-8 (byte 0x{body[exc.start]:02x} at offset {exc.start})"
                            ) from None
    if isinstance(message, str):
        if len(message) > max_bytes:
            raise FeedError(f"queue message of {len(message)} characters is larger than {max_bytes}")
        message = _unwrapped(message)
    return parse_event_grid(message, max_bytes=max_bytes)


def parse_event_grid(payload: bytes | str | Any, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> FeedResult:
    """The scheduled events in one Event Grid delivery: a JSON event or array of events, as pushed over
    HTTPS or taken from a queue after base64 decoding, in the Event Grid or the CloudEvents 1.0 schema.

    A scheduled event is recognised by its shape, not its event type (two spellings of that exist): its
    ARM ID, `data.resourceInfo.id` or else the subject, names a Microsoft.Maintenance scheduled event.
    Other events are skipped and counted. Raises FeedError, and nothing else, for a message that is not
    JSON, not events, or holds a scheduled event that cannot be read.
    """
    data, warnings = _checked(payload, max_bytes, "message")
    if isinstance(data, dict):
        items = {"$": data}
    elif isinstance(data, list):
        if len(data) > MAX_EVENTS_PER_MESSAGE:
            raise FeedError(f"message holds {len(data)} events, more than the {MAX_EVENTS_PER_MESSAGE} accepted")
        items = {f"$[{i}]": item for i, item in enumerate(data)}
    else:
        raise FeedError(f"message must be a JSON object or array of events, got {_kind(data)}")

    events: list[FleetEvent] = []
    skipped = 0
    for where, item in items.items():
        event = _parse_envelope(item, where, warnings)
        if event is None:
            skipped += 1
        else:
            events.append(event)
    return FeedResult(events=tuple(events), skipped=skipped, warnings=capped(warnings))


def _parse_envelope(envelope: Any, where: str, warnings: list[str]) -> FleetEvent | None:
    """One Event Grid or CloudEvents event: a FleetEvent, None for an event of another kind."""
    if not isinstance(envelope, dict):
        raise FeedError(f"{where} must be an event object, got {_kind(envelope)}")
    delivery_id = envelope.get("id")
    if not isinstance(delivery_id, str) or not delivery_id:
        raise FeedError(f"{where}.id is {_missing_or_kind(delivery_id)}; every Event Grid and CloudEvents event "
                        "has one")
    cloud_events = "specversion" in envelope
    kind = envelope.get("type" if cloud_events else "eventType")

    data = envelope.get("data")
    info = data.get("resourceInfo") if isinstance(data, dict) else None
    info = info if isinstance(info, dict) else {}
    arm_id, arm_where = info.get("id"), f"{where}.data.resourceInfo.id"
    if not isinstance(arm_id, str):
        arm_id, arm_where = envelope.get("subject"), f"{where}.subject"
    if not isinstance(arm_id, str) or not is_scheduled_event_id(arm_id):
        warnings.append(f"{where}: event {shown(delivery_id)} of type {shown(kind)} is not a scheduled event; "
                        "skipped")
        return None

    properties = info.get("properties")
    if not isinstance(properties, dict):
        raise FeedError(f"{where}.data.resourceInfo.properties is {_missing_or_kind(properties)}; a scheduled "
                        "event carries its fields there")
    time_field = "time" if cloud_events else "eventTime"
    event_time = _event_time(envelope.get(time_field), f"{where}.{time_field}", warnings)
    location = info.get("location")
    return _fleet_event(arm_id, arm_where, properties, f"{where}.data.resourceInfo.properties", warnings,
                        origin=EVENT_GRID, event_time=event_time, delivery_id=delivery_id,
                        location=location if isinstance(location, str) else None)


#: Columns of a projected Resource Graph row and the event field each holds: the names of forewarn's
#: query sketch, and `properties_X`, the name ARG gives a projected `properties.X` without an alias.
_PROJECTED = {
    "eventId": "EventId", "eventType": "EventType", "status": "EventStatus", "eventStatus": "EventStatus",
    "notBefore": "NotBefore", "resources": "Resources", "resourceType": "ResourceType",
    "durationSec": "DurationInSeconds", "durationInSeconds": "DurationInSeconds", "source": "EventSource",
    "eventSource": "EventSource", "description": "Description",
}


def parse_resource_graph_row(row: bytes | str | Any, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> FleetEvent:
    """One row of a Resource Graph query of `maintenanceresources` (result format objectArray).

    The row is the whole resource (`id`, `name`, `type`, `subscriptionId`, `resourceGroup`, `location`,
    `properties{EventId, EventType, ...}`) or a projection that keeps `id` and renames the properties
    (`eventId`, `status`, `notBefore`, ... or `properties_EventId`, ...). Subscription and resource group
    are taken from `id`, which names the event exactly. Raises FeedError, and nothing else, for a row that
    is not a usable scheduled event.
    """
    data, warnings = _checked(row, max_bytes, "row")
    if not isinstance(data, dict):
        raise FeedError(f"row must be an object (result format objectArray), got {_kind(data)}")
    arm_id = data.get("id")
    if not isinstance(arm_id, str) or not arm_id:
        raise FeedError(f"row.id is {_missing_or_kind(arm_id)}; the query must keep id")
    properties = data.get("properties")
    where = "row.properties"
    if not isinstance(properties, dict):
        if properties is not None:
            raise FeedError(f"row.properties must be an object, got {_kind(properties)}")
        properties = _projected(data)
        where = "row"
        if not properties:
            raise FeedError("row has neither properties nor projected event columns (eventId, status, ...)")
    location = data.get("location")
    event = _fleet_event(arm_id, "row.id", properties, where, warnings, origin=RESOURCE_GRAPH,
                         location=location if isinstance(location, str) else None)
    # A row is its own message: what the boundary replaced belongs to its event too.
    if not warnings:
        return event
    kept = replace(event, warnings=capped(warnings))
    object.__setattr__(kept, "_vms", event.vms)
    return kept


def _projected(row: Mapping[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for column, value in row.items():
        name = _PROJECTED.get(column)
        if name is None and column.startswith("properties_"):
            name = column[len("properties_"):]
        if name is not None and name not in fields:
            fields[name] = value
    return fields


def _fleet_event(arm_id: str, arm_where: str, properties: Mapping[str, Any], where: str, warnings: list[str],
                 *, origin: Origin, event_time: datetime | None = None, delivery_id: str | None = None,
                 location: str | None = None) -> FleetEvent:
    try:
        target, id_event = split_scheduled_event_id(arm_id)
    except ArmIdError as exc:
        raise FeedError(f"{arm_where}: {exc}") from None
    if target.resource_group is None:
        raise FeedError(f"{arm_where}: ARM ID {shown(arm_id)} names no resource group")
    mine: list[str] = []
    try:
        event = _parse_event_fields({key: _shared(value) if key in _REPEATED_FIELDS else value
                                     for key, value in properties.items()}, where, mine)
    except DocumentError as exc:
        raise FeedError(str(exc)) from None
    if id_event.lower() != event.event_id.lower():
        mine.append(f"{where}: EventId {shown(event.event_id)} differs from {shown(id_event)} in the ARM ID; "
                    "EventId used")
    if not is_valid_name(event.event_id):
        raise FeedError(f"{where}.EventId {shown(event.event_id)} cannot be part of an ARM ID")
    bad = [name for name in event.resources if not is_valid_name(name)]
    if bad:
        mine.append(f"{where}: {len(bad)} Resources name(s) cannot be VM names, e.g. {shown(bad[0])}; left out "
                    "of the VM IDs")
    warnings.extend(mine)
    fleet_event = FleetEvent(
        resource_id=str(target), subscription_id=target.subscription_id, resource_group=target.resource_group,
        event=event, origin=origin, event_time=event_time, delivery_id=delivery_id, location=_shared(location),
        warnings=capped(mine),
    )
    object.__setattr__(fleet_event, "_vms", EventVms.of(target, event.resources, True))  # the parse above, kept
    return fleet_event


# Event Grid writes eventTime with seven fractional digits (`2024-07-15T20:43:44.1234567Z`), which
# datetime.fromisoformat of Python 3.10 refuses: read the parts here, fractions cut to microseconds.
_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,12}))?(?:([Zz])|([+-])(\d{2}):?(\d{2}))?")


def parse_event_time(text: str) -> datetime:
    """An RFC 3339 time as Event Grid and CloudEvents write it, in UTC. Raises ValueError otherwise."""
    match = _RFC3339.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"time {shown(text)} is not RFC 3339")
    year, month, day, hour, minute, second = (int(match[i]) for i in range(1, 7))
    micro = int((match[7] or "0")[:6].ljust(6, "0"))
    try:
        zone = timezone.utc
        if match[9]:
            offset = timedelta(hours=int(match[10]), minutes=int(match[11]))
            zone = timezone(-offset if match[9] == "-" else offset)
        moment = datetime(year, month, day, hour, minute, min(second, 59), micro, tzinfo=zone)
        moment = moment.astimezone(timezone.utc)
        moment.timestamp()
    except (ValueError, OverflowError):
        raise ValueError(f"time {shown(text)} is not a valid moment") from None
    return moment


def _event_time(value: Any, where: str, warnings: list[str]) -> datetime | None:
    """A descriptive field: when it cannot be read it is None, with a warning, and the event is kept."""
    if value is None:
        return None
    if not isinstance(value, str):
        warnings.append(f"{where} must be a string, got {_kind(value)}; ignored")
        return None
    try:
        return parse_event_time(value)
    except ValueError as exc:
        warnings.append(f"{where}: {exc}; ignored")
        return None


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _missing_or_kind(value: Any) -> str:
    return "missing or empty" if value in (None, "") else f"not a string ({_kind(value)})"
