"""The Scheduled Events document as value types, and the parser that builds them.

The parser is deliberately tolerant where IMDS may evolve (unknown fields, unknown event types or
statuses, an odd date format) and strict where a document cannot be trusted at all (not an object, no
incarnation, events that are not objects). A strict failure raises `DocumentError`; the caller counts it
and keeps the last good document, so one bad reply never loses what is already known.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from forewarn.httpdate import MONTHS, rfc1123
from forewarn.imds.reply import ReplyError, capped, check_value, decode_reply

#: Event types, statuses and sources documented for API version 2020-07-01. Other values are passed
#: through untouched; these lists only drive zero-filled metrics and the simulator.
EVENT_TYPES = ("Freeze", "Reboot", "Redeploy", "Preempt", "Terminate")
EVENT_STATUSES = ("Scheduled", "Started")
EVENT_SOURCES = ("Platform", "User")

#: Every documented API version, oldest first. Newer versions add fields; see `fields_for_version`.
API_VERSIONS = (
    "2017-03-01",
    "2017-08-01",
    "2017-11-01",
    "2019-01-01",
    "2019-04-01",
    "2019-08-01",
    "2020-07-01",
)

# Version in which each optional field or event type first appeared (IMDS.md, "Versions").
_FIELD_SINCE = {"Description": "2019-04-01", "EventSource": "2019-08-01", "DurationInSeconds": "2020-07-01"}
_TYPE_SINCE = {"Preempt": "2017-11-01", "Terminate": "2019-01-01"}


def field_in_version(name: str, api_version: str) -> bool:
    """True when documents of `api_version` carry the event field `name`."""
    return api_version >= _FIELD_SINCE.get(name, API_VERSIONS[0])


def type_in_version(event_type: str, api_version: str) -> bool:
    """True when `event_type` can appear in documents of `api_version`."""
    return api_version >= _TYPE_SINCE.get(event_type, API_VERSIONS[0])


class DocumentError(ValueError):
    """The reply is not a Scheduled Events document; the message says what was wrong and where."""


@dataclass(frozen=True, slots=True)
class Event:
    """One scheduled event. `raw` holds the fields exactly as IMDS sent them, unknown ones included."""

    event_id: str
    event_type: str
    status: str
    resource_type: str
    resources: tuple[str, ...]
    not_before: datetime | None
    description: str | None = None
    source: str | None = None
    duration_seconds: int | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, hash=False, repr=False)

    def affects(self, vm_name: str | None) -> bool:
        """True when `vm_name` is one of the VMs this event acts on."""
        return bool(vm_name) and vm_name in self.resources

    def seconds_to_not_before(self, now: float) -> float | None:
        if self.not_before is None:
            return None
        return self.not_before.timestamp() - now


@dataclass(frozen=True)
class Document:
    """A whole Scheduled Events reply. `warnings` lists what the tolerant parser passed over."""

    incarnation: int
    events: tuple[Event, ...]
    raw: Mapping[str, Any] = field(default_factory=dict, hash=False, repr=False, compare=False)
    warnings: tuple[str, ...] = field(default=(), compare=False)


def shown(value: Any, limit: int = 60) -> str:
    """A value for a message: repr, clipped, so a hostile reply cannot flood the log."""
    text = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return text if len(text) <= limit else text[:limit] + "..."


_ISO_Z = re.compile(r"Z$", re.IGNORECASE)
#: NotBefore exactly as IMDS writes it; anything else goes to the email package's lenient parser, which
#: is imported only then (1 MiB of modules an idle collector has no use for).
_IMDS_FORM = re.compile(r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun), (\d\d) (Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) "
                        r"(\d{4}) (\d\d):(\d\d):(\d\d) GMT", re.ASCII)
#: The year of an RFC 1123 date: `Mon, 11 Apr 2022 22:26:58 GMT`.
_RFC1123_YEAR = re.compile(r"\d{1,2}\s+[A-Za-z]{3}\s+(\d+)")


def parse_not_before(value: str) -> datetime:
    """Parse NotBefore: RFC 1123 as IMDS sends it (`Mon, 11 Apr 2022 22:26:58 GMT`), or ISO 8601.

    Raises ValueError when neither form fits or the moment is outside what forewarn can handle. The empty
    string means "no NotBefore" and is handled by the caller, not here.
    """
    text = value.strip()
    out_of_range = ValueError(f"NotBefore {shown(value)} is outside the range of dates forewarn handles")
    form = _IMDS_FORM.fullmatch(text)
    if form is not None and form[3] >= "0100":  # the email parser reads 0001-0099 as 20th/21st century years
        day, month, year, hour, minute, second = form.groups()
        try:
            return datetime(int(year), MONTHS.index(month) + 1, int(day), int(hour), int(minute), int(second),
                            tzinfo=timezone.utc)
        except ValueError:
            pass  # 31 Feb, hour 24...: the lenient parser below says what is wrong, as for any other form
    from email.utils import parsedate_to_datetime

    try:
        parsed = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        try:
            parsed = datetime.fromisoformat(_ISO_Z.sub("+00:00", text))
        except ValueError:
            raise ValueError(f"NotBefore {shown(value)} is neither RFC 1123 nor ISO 8601") from None
    else:
        year = _RFC1123_YEAR.search(text)
        if year is not None and len(year[1]) == 4 and int(year[1]) != parsed.year:
            # The email parser reads years below 100 as two-digit ones (0001 as 2001): refuse instead.
            raise out_of_range
    if parsed.tzinfo is None:
        # Both forms without a zone are read as UTC: IMDS documents its times as GMT.
        parsed = parsed.replace(tzinfo=timezone.utc)
    try:
        # Year 9999 at -12:00 is in year 10000 in UTC, past what datetime holds.
        moment = parsed.astimezone(timezone.utc)
        moment.timestamp()
    except (OverflowError, ValueError):
        raise out_of_range from None
    return moment


def format_not_before(moment: datetime) -> str:
    """Format a time the way IMDS writes NotBefore (RFC 1123, GMT)."""
    t = moment.astimezone(timezone.utc)
    return rfc1123(t.weekday(), t.day, t.month, t.year, t.hour, t.minute, t.second)


#: Whole-document limits; see imds/reply.py for what is checked on the raw bytes.
MAX_EVENTS = 1000
#: DocumentIncarnation is a counter; beyond 2**53 it could not be shown exactly as a metric value.
MAX_INCARNATION = 2**53
#: DurationInSeconds: -1 (unknown) up to ten years; a larger value is read as unknown, with a warning.
MAX_DURATION = 10 * 365 * 86400


def _optional_str(raw: Mapping[str, Any], name: str, where: str, warnings: list[str]) -> str | None:
    """A descriptive field: a wrong type is a warning and the field reads as absent."""
    value = raw.get(name)
    if value is None or isinstance(value, str):
        return value
    warnings.append(f"{where}: {name} must be a string, got {type(value).__name__}; ignored")
    return None


def _required_str(raw: Mapping[str, Any], name: str, where: str) -> str:
    """An identifying field: without it the event cannot be tracked, so the reply is refused and the last
    good document kept (dropping the event instead would report it as cancelled)."""
    value = raw.get(name)
    if not isinstance(value, str) or not value:
        shown = "missing or empty" if value in (None, "") else f"not a string ({type(value).__name__})"
        raise DocumentError(f"{where}.{name} is {shown}")
    return value


def _resources(raw: Mapping[str, Any], where: str, warnings: list[str]) -> tuple[str, ...]:
    value = raw.get("Resources", [])
    if value is None:
        return ()
    if not isinstance(value, list):
        warnings.append(f"{where}: Resources must be a list of strings, got {type(value).__name__}; ignored")
        return ()
    names = tuple(item for item in value if isinstance(item, str))
    if len(names) != len(value):
        warnings.append(f"{where}: {len(value) - len(names)} Resources entry(ies) not a string; ignored")
    return names


def _duration(raw: Mapping[str, Any], where: str, warnings: list[str]) -> int | None:
    if "DurationInSeconds" not in raw:
        return None
    value = raw["DurationInSeconds"]
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and re.fullmatch(r"-?\d{1,12}", value.strip()):
        number = int(value)
    if number is None or not -1 <= number <= MAX_DURATION:
        warnings.append(f"{where}: DurationInSeconds {shown(value)} is not -1 or a whole number of seconds up to "
                        f"{MAX_DURATION}; read as unknown")
        return None
    return number


def _parse_event(raw: Any, where: str, warnings: list[str]) -> Event:
    if not isinstance(raw, dict):
        raise DocumentError(f"{where} must be an object, got {type(raw).__name__}")
    event_id = _required_str(raw, "EventId", where)
    where = f"{where} ({event_id})"

    not_before: datetime | None = None
    not_before_raw = _optional_str(raw, "NotBefore", where, warnings)
    if not_before_raw:
        try:
            not_before = parse_not_before(not_before_raw)
        except ValueError as exc:
            # Keep the event: losing it would be worse than losing its countdown.
            warnings.append(f"{where}: {exc}")

    resources = _resources(raw, where, warnings)
    duration = _duration(raw, where, warnings)
    return Event(
        event_id=event_id,
        event_type=_required_str(raw, "EventType", where),
        status=_required_str(raw, "EventStatus", where),
        resource_type=_optional_str(raw, "ResourceType", where, warnings) or "",
        resources=resources,
        not_before=not_before,
        description=_optional_str(raw, "Description", where, warnings),
        source=_optional_str(raw, "EventSource", where, warnings),
        duration_seconds=duration,
        raw=_documented_types(raw, resources, duration),
    )


def _documented_types(raw: Mapping[str, Any], resources: tuple[str, ...], duration: int | None) -> dict[str, Any]:
    """The event's fields as IMDS sent them, less what could not be read as its documented type.

    Records carry `raw` (`data.event`) and their schema types the documented fields, so a field that was
    read as unknown is left out rather than passed on in a shape consumers do not expect; unknown fields
    pass through as sent.
    """
    clean = dict(raw)
    for name in ("ResourceType", "Description", "EventSource", "NotBefore"):
        if name in clean and not isinstance(clean[name], str):
            del clean[name]
    if "Resources" in clean:
        if isinstance(clean["Resources"], list):
            clean["Resources"] = list(resources)
        else:
            del clean["Resources"]
    if "DurationInSeconds" in clean:
        if duration is None:
            del clean["DurationInSeconds"]
        else:
            clean["DurationInSeconds"] = duration
    return clean


def _parse_incarnation(value: Any) -> int:
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and re.fullmatch(r"\d{1,16}", value.strip()):
        number = int(value)
    if number is None or not 0 <= number <= MAX_INCARNATION:
        raise DocumentError(f"DocumentIncarnation must be a whole number from 0 to 2**53, got {shown(value)}")
    return number


def parse_document(payload: bytes | str | Mapping[str, Any]) -> Document:
    """Build a `Document` from an IMDS reply body (bytes or text) or an already decoded object.

    Raises DocumentError, and nothing else, for any input that is not a usable document.
    """
    try:
        data, warnings = decode_reply(payload) if isinstance(payload, (bytes, str)) else check_value(payload)
    except ReplyError as exc:
        raise DocumentError(str(exc)) from None
    if not isinstance(data, dict):
        raise DocumentError(f"document must be a JSON object, got {type(data).__name__}")
    if "DocumentIncarnation" not in data:
        raise DocumentError("DocumentIncarnation is missing")
    incarnation = _parse_incarnation(data["DocumentIncarnation"])
    events_raw = data.get("Events")
    if not isinstance(events_raw, list):
        raise DocumentError("Events must be a list")
    if len(events_raw) > MAX_EVENTS:
        raise DocumentError(f"{len(events_raw)} events, more than the {MAX_EVENTS} forewarn accepts")

    events = tuple(_parse_event(item, f"Events[{i}]", warnings) for i, item in enumerate(events_raw))
    seen: set[str] = set()
    for event in events:
        if event.event_id in seen:
            raise DocumentError(f"EventId {event.event_id} appears twice")
        seen.add(event.event_id)
    return Document(incarnation=incarnation, events=events, raw=data, warnings=capped(warnings))
