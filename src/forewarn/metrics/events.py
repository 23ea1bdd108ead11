"""The families of the open events, the same in both modes.

`forewarn run` shows the events of its VM's IMDS document; `forewarn fleet` shows every open event of the
fleet once per VM it acts on, with the VM's place (`vm`, `vm_scale_set`, `resource_group`,
`subscription_id`) as extra labels. Both modes describe what is open as `OpenEvent` rows and render them
here, so the two expositions have the same names, help, labels and limits and cannot drift apart:

    azure_scheduled_event_info                                1 per event (and VM)
    azure_scheduled_event_not_before_timestamp_seconds        while NotBefore is set
    azure_scheduled_event_duration_seconds                    when the feed gives DurationInSeconds
    azure_scheduled_event_status_since_timestamp_seconds      when the mode knows it
    azure_scheduled_events                                    events (not VMs) by type, status and source

The per-VM agent adds its scrape-time countdown and its VM's identity (exposition.py); fleet mode adds the
count by subscription and resource group (fleet/metrics.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from forewarn.imds.document import EVENT_SOURCES, EVENT_STATUSES, EVENT_TYPES, Event
from forewarn.metrics.core import Family

#: Longest label value kept; a longer one (a description, a source) is cut and ends with "...".
MAX_LABEL_CHARS = 512
#: ... and at most this many bytes in UTF-8, the unit of a scrape's label value length limit: Azure Monitor
#: managed Prometheus' templates set labelValueLengthLimit 1023 and a breach drops the whole scrape, which 512
#: characters of free text in a non-Latin script (3 bytes each) would cause.
MAX_LABEL_BYTES = 1023
#: The labels fleet mode adds to every per-event series: where the VM is.
PLACE_LABELS = ("vm", "vm_scale_set", "resource_group", "subscription_id")


def label(value: str | None) -> str:
    if value is None:
        return ""
    if len(value) <= MAX_LABEL_CHARS and (value.isascii() or _utf8_bytes(value) <= MAX_LABEL_BYTES):
        return value
    cut = value[:MAX_LABEL_CHARS - 3]
    if not cut.isascii():       # cut on a character boundary within the byte budget
        cut = cut.encode("utf-8", "surrogatepass")[:MAX_LABEL_BYTES - 3].decode("utf-8", "ignore")
    return cut + "..."


def _utf8_bytes(value: str) -> int:
    return len(value.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True)
class OpenEvent:
    """One open event as the metrics show it. `places` holds one tuple of place label values per VM the
    series are about: `((),)` in the per-VM agent (its own VM, no place labels), one per VM in fleet mode."""

    event: Event
    affects_this_vm: bool
    status_since: float | None = None
    places: tuple[tuple[str, ...], ...] = ((),)


def event_families(events: Iterable[OpenEvent], place_labels: Sequence[str] = ()) -> Iterator[Family]:
    """The five families of the open events, each built when it is asked for: a caller that writes one
    before asking for the next holds one family's text at a time (fleet mode's are megabytes each).
    `place_labels` names the values in each `OpenEvent.places`."""
    rows = list(events)
    place = list(place_labels)
    ids = ["event_id", "event_type"]
    info = Family("azure_scheduled_event_info", "A scheduled event that is open now (1).",
                  labels=[*ids, "event_status", "event_source", "resource_type", "affects_this_vm",
                          "description", *place])
    for row in rows:
        event = row.event
        info_labels = [event.event_id, event.event_type, event.status, label(event.source), event.resource_type,
                       "true" if row.affects_this_vm else "false", label(event.description)]
        for where in row.places:
            info.add([*info_labels, *where], 1)
    yield info
    del info
    not_before = Family("azure_scheduled_event_not_before_timestamp_seconds",
                        "NotBefore as Unix time; absent while NotBefore is empty.", labels=[*ids, *place])
    yield _per_vm(not_before, rows, lambda row: row.event.not_before.timestamp() if row.event.not_before else None)
    del not_before
    duration = Family("azure_scheduled_event_duration_seconds",
                      "DurationInSeconds of the event (-1 = unknown).", labels=[*ids, *place])
    yield _per_vm(duration, rows, lambda row: row.event.duration_seconds)
    del duration
    since = Family("azure_scheduled_event_status_since_timestamp_seconds",
                   "When forewarn first saw the event in its current status (Unix time; reset to the "
                   "start time after a restart).", labels=[*ids, "event_status", *place])
    yield _per_vm(since, rows, lambda row: row.status_since, with_status=True)
    del since
    counts: dict[tuple[str, str, str], int] = {
        (t, s, src): 0 for t in EVENT_TYPES for s in EVENT_STATUSES for src in EVENT_SOURCES
    }
    for row in rows:
        key = (row.event.event_type, row.event.status, label(row.event.source))
        counts[key] = counts.get(key, 0) + 1
    aggregate = Family("azure_scheduled_events", "Open events by type, status and source.",
                       labels=["event_type", "event_status", "event_source"])
    for (event_type, status, source), count in sorted(counts.items()):
        aggregate.add([event_type, status, source], count)
    yield aggregate


def _per_vm(family: Family, rows: Sequence[OpenEvent], value: Callable[[OpenEvent], float | None],
            with_status: bool = False) -> Family:
    """`family` with a series per event and VM whose `value` is known, labelled by the event's id and type
    (and status, `with_status`), then the VM's place."""
    for row in rows:
        number = value(row)
        if number is None:
            continue
        event = row.event
        labels = [event.event_id, event.event_type, event.status] if with_status else [event.event_id,
                                                                                         event.event_type]
        for where in row.places:
            family.add([*labels, *where], number)
    return family
