"""The fleet tracker's memory as text, saved in the outbox with the records of its changes.

Saved with every change (`Outbox.append(records, state={STATE_KEY: dump(tracker)})`), so after any stop,
SIGKILL included, the records and the state that produced them are on disk together or not at all: the next
start reports nothing twice and loses nothing. What is saved: each open event as a Resource Graph row (the
event's ARM ID and its fields as the feed sent them) with the feed, delivery id and time beside it, and the
keys of the ended events. Reading it back goes through the feeds' own boundary (`parse_resource_graph_row`),
so a damaged or hostile file is refused like a hostile reply, never trusted.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from forewarn.fleet.feed import FeedError, FleetEvent, parse_event_time, parse_resource_graph_row
from forewarn.fleet.tracker import FleetTracker
from forewarn.imds.reply import ReplyError, decode_reply

STATE_KEY = "fleet"
FORMAT = 1
#: Largest saved state read back: room for about 100,000 open events and as many ended keys.
MAX_STATE_BYTES = 256 * 1024 * 1024


class StateError(ValueError):
    """The saved fleet state cannot be read; the message says why. The caller starts without it."""


def dump(tracker: FleetTracker) -> str:
    return json.dumps({
        "format": FORMAT,
        "open": [_saved(event) for event in tracker.open_events],
        "ended": [list(key) for key in tracker.ended_keys],
    }, separators=(",", ":"))


def _saved(event: FleetEvent) -> dict[str, Any]:
    return {
        "id": event.arm_id,
        "location": event.location,
        "properties": dict(event.event.raw),
        "feed": event.origin,
        "delivery_id": event.delivery_id,
        "event_time": event.event_time.isoformat() if event.event_time else None,
    }


def load(text: str, now: float) -> FleetTracker:
    """A tracker with the saved open and ended events; raises StateError for a state it cannot trust."""
    try:
        value, _ = decode_reply(text.encode() if len(text) <= MAX_STATE_BYTES else b"")
    except ReplyError as exc:
        raise StateError(f"saved fleet state: {exc}") from None
    if not isinstance(value, dict) or value.get("format") != FORMAT:
        raise StateError(f"saved fleet state: not format {FORMAT}")
    opened, ended = value.get("open"), value.get("ended")
    if not isinstance(opened, list) or not isinstance(ended, list):
        raise StateError("saved fleet state: 'open' and 'ended' must be lists")
    return FleetTracker([_restored(row, index) for index, row in enumerate(opened)], _keys(ended), now=now)


def _restored(row: Any, index: int) -> FleetEvent:
    if not isinstance(row, dict):
        raise StateError(f"saved fleet state: open[{index}] is not an object")
    try:
        event = parse_resource_graph_row({"id": row.get("id"), "location": row.get("location"),
                                          "properties": row.get("properties")})
        when = row.get("event_time")
        feed = row.get("feed")
        delivery = row.get("delivery_id")
        if feed not in ("resourcegraph", "eventgrid") or not isinstance(delivery, (str, type(None))):
            raise FeedError("feed or delivery_id of the wrong kind")
        return dataclasses.replace(event, origin=feed, delivery_id=delivery,
                                   event_time=parse_event_time(when) if isinstance(when, str) else None)
    except (FeedError, ValueError) as exc:
        raise StateError(f"saved fleet state: open[{index}]: {exc}") from None


def _keys(rows: Sequence[Any]) -> list[tuple[str, str]]:
    keys = []
    for index, row in enumerate(rows):
        if not (isinstance(row, list) and len(row) == 2 and all(isinstance(part, str) for part in row)):
            raise StateError(f"saved fleet state: ended[{index}] is not a [resource, event id] pair")
        keys.append((row[0].lower(), row[1].lower()))
    return keys
