"""Hypothesis strategies for Scheduled Events documents."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from forewarn.imds.document import EVENT_SOURCES, EVENT_STATUSES, EVENT_TYPES

event_ids = st.sampled_from([f"EV-{i}" for i in range(8)])


@st.composite
def raw_events(draw: st.DrawFn, event_id: str) -> dict[str, Any]:
    status = draw(st.sampled_from(EVENT_STATUSES))
    return {
        "EventId": event_id,
        "EventType": draw(st.sampled_from(EVENT_TYPES)),
        "ResourceType": "VirtualMachine",
        "Resources": draw(st.lists(st.sampled_from(["vm-0", "vm-1", "vm-2"]), max_size=3, unique=True)),
        "EventStatus": status,
        "NotBefore": "" if status == "Started" else "Mon, 11 Apr 2022 22:26:58 GMT",
        "Description": draw(st.sampled_from(["", "maintenance"])),
        "EventSource": draw(st.sampled_from(EVENT_SOURCES)),
        "DurationInSeconds": draw(st.sampled_from([-1, 0, 5, 900])),
    }


@st.composite
def raw_documents(draw: st.DrawFn, incarnation: int | None = None) -> dict[str, Any]:
    ids = draw(st.lists(event_ids, max_size=5, unique=True))
    return {
        "DocumentIncarnation": incarnation if incarnation is not None else draw(st.integers(0, 1000)),
        "Events": [draw(raw_events(event_id)) for event_id in ids],
    }
