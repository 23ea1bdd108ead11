"""The fleet tracker's memory, saved in the outbox with the records of its changes, one row per event.

Each commit saves what its changes touched, in the records' transaction (`Outbox.append(records,
state=changed_state(...))`): the row of each event added or updated (its ARM ID and its fields as the feed
sent them, with the feed, delivery id and time), the removal of an ended event's row and a row that remembers
it ended, and the removal of ended events the bounded memory let go. So after any stop, SIGKILL included, the
records and the state that produced them are on disk together or not at all, and a commit costs what it
changed, not the size of the fleet. Reading it back goes through the feeds' own boundary
(`parse_resource_graph_row`), so a damaged or hostile row is refused like a hostile reply, never trusted:
the row is left out and said so, the rest is kept.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from forewarn.fleet.feed import FeedError, FleetEvent, parse_event_time, parse_resource_graph_row
from forewarn.fleet.tracker import FleetChange, FleetTracker, event_key
from forewarn.imds.reply import ReplyError, decode_reply
from forewarn.tracker import ChangeKind

log = logging.getLogger(__name__)

PREFIX = "fleet:"
OPEN = "fleet:open:"
ENDED = "fleet:ended:"
#: Largest saved row read back (an event is well under 64 KiB: the feeds cap a message at 1 MiB).
MAX_ROW_BYTES = 1024 * 1024


class StateError(ValueError):
    """A saved row cannot be read; the message says why. The row is left out."""


def row_key(prefix: str, key: tuple[str, str]) -> str:
    """The store key of an event: ARM IDs and EventIds hold no control characters (the boundary refuses them)."""
    return f"{prefix}{key[0]}\n{key[1]}"


def changed_state(changes: Iterable[FleetChange], tracker: FleetTracker) -> dict[str, str | None]:
    """The rows `changes` touched, for the transaction that commits their records (None removes a row)."""
    rows: dict[str, str | None] = {}
    for change in changes:
        key = event_key(change.event)
        if change.kind is ChangeKind.REMOVED:
            if change.previous is not None:  # it had a row (an event first heard of at its end had none)
                rows[row_key(OPEN, key)] = None
            rows[row_key(ENDED, key)] = ""
        else:
            rows[row_key(OPEN, key)] = json.dumps(_saved(change.event), separators=(",", ":"))
    for key in tracker.take_forgotten():
        rows[row_key(ENDED, key)] = None
    return rows


def _saved(event: FleetEvent) -> dict[str, Any]:
    return {
        "id": event.arm_id,
        "location": event.location,
        "properties": dict(event.event.raw),
        "feed": event.origin,
        "delivery_id": event.delivery_id,
        "event_time": event.event_time.isoformat() if event.event_time else None,
    }


def all_rows(tracker: FleetTracker) -> dict[str, str | None]:
    """Every row of the tracker as it is (to save a whole tracker at once, e.g. in tests)."""
    rows: dict[str, str | None] = {row_key(OPEN, event_key(e)): json.dumps(_saved(e), separators=(",", ":"))
                                   for e in tracker.open_events}
    rows.update({row_key(ENDED, key): "" for key in tracker.ended_keys})
    return rows


def load(rows: Mapping[str, str], now: float) -> FleetTracker:
    """A tracker with the saved open and ended events. A row that cannot be read is left out and logged
    (an event it held is then reported again, under the same record ids: nothing is lost)."""
    opened: list[FleetEvent] = []
    ended: list[tuple[str, str]] = []
    for store_key, text in rows.items():
        try:
            if store_key.startswith(OPEN):
                opened.append(restored(text))
            elif store_key.startswith(ENDED):
                resource, sep, event_id = store_key[len(ENDED):].partition("\n")
                if not sep or not resource or not event_id:
                    raise StateError("not a resource and an event id")
                ended.append((resource.lower(), event_id.lower()))
        except StateError as exc:
            log.error("saved fleet state: row %r left out: %s", store_key[:200], exc)
    return FleetTracker(opened, ended, now=now)


def restored(text: str) -> FleetEvent:
    """One saved open event, through the feeds' boundary; raises StateError."""
    try:
        row, _ = decode_reply(text.encode() if len(text) <= MAX_ROW_BYTES else b"")
    except ReplyError as exc:
        raise StateError(str(exc)) from None
    if not isinstance(row, dict):
        raise StateError("not an object")
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
        raise StateError(str(exc)) from None
