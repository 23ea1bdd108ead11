"""The fleet tracker's memory, saved in the outbox with the records of its changes, one row per event.

Each commit saves what its changes touched, in the records' transaction (`Outbox.append(records,
state=changed_state(...))`): the row of each event added or updated (its ARM ID and its fields as the feed
sent them, with the feed, delivery id and time, and whether a Resource Graph snapshot listed it), the removal of
an ended event's row and a row that remembers it ended, and the removal of ended events the bounded memory let
go. So after any stop, SIGKILL included, the records and the state that produced them are on disk together or
not at all, and a commit costs what it changed, not the size of the fleet. Reading it back goes through the
feeds' own boundary (`parse_resource_graph_row`), so a damaged or hostile row is refused like a hostile reply,
never trusted: at start the row is left out and said so, the rest is kept; a reload while running refuses the
whole state (`load(strict=True)`: FleetCommitter holds every action until it reads).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Mapping

from forewarn.fleet.feed import FeedError, FleetEvent, parse_event_time, parse_resource_graph_row
from forewarn.fleet.tracker import FleetChange, FleetTracker, event_key
from forewarn.imds.reply import ReplyError, decode_reply
from forewarn.tracker import ChangeKind

log = logging.getLogger(__name__)

PREFIX = "fleet:"
OPEN = "fleet:open:"
ENDED = "fleet:ended:"
#: Largest saved row read back. The feeds cap a message at 1 MiB, and the row's JSON writes each character
#: beyond ASCII as a 6-character escape: a row within 8 MiB holds any event a feed can bring (a row refused here
#: would leave its event out, or hold every action after a failed commit: FleetCommitter._reload).
MAX_ROW_BYTES = 8 * 1024 * 1024


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
            rows[row_key(OPEN, key)] = _saved(change.event, tracker.was_listed(key))
    for key in tracker.take_forgotten():
        rows[row_key(ENDED, key)] = None
    for key in tracker.take_newly_listed():   # unchanged, but listed by Resource Graph now: the row says so
        event = tracker.open_event(key)
        if event is not None and row_key(OPEN, key) not in rows:
            rows[row_key(OPEN, key)] = _saved(event, True)
    return rows


def _saved(event: FleetEvent, listed: bool) -> str:
    """An open event's row. `listed`: a Resource Graph snapshot listed it, so its absence from two complete
    snapshots ends it (after a restart or a reload too); a row without it (written by 0.x before it was saved)
    reads as not listed unless the event came from Resource Graph, which may leave it open until a final status:
    never ended too early."""
    return json.dumps({
        "id": event.arm_id,
        "location": event.location,
        "properties": dict(event.event.raw),
        "feed": event.origin,
        "delivery_id": event.delivery_id,
        "event_time": event.event_time.isoformat() if event.event_time else None,
        "listed": listed,
    }, separators=(",", ":"))


def all_rows(tracker: FleetTracker) -> dict[str, str | None]:
    """Every row of the tracker as it is (to save a whole tracker at once, e.g. in tests)."""
    rows: dict[str, str | None] = {row_key(OPEN, event_key(e)): _saved(e, tracker.was_listed(event_key(e)))
                                   for e in tracker.open_events}
    rows.update({row_key(ENDED, key): "" for key in tracker.ended_keys})
    return rows


def load(rows: Mapping[str, str], now: float, strict: bool = False) -> FleetTracker:
    """A tracker with the saved open and ended events. A row that cannot be read is left out and logged
    (an event it held is then reported again, under the same record ids: nothing is lost); with `strict`, it
    raises StateError instead (a reload while running: an event left out would look over, FleetCommitter)."""
    opened: list[FleetEvent] = []
    ended: list[tuple[str, str]] = []
    listed: set[tuple[str, str]] = set()
    for store_key, text in rows.items():
        try:
            if store_key.startswith(OPEN):
                event, was_listed = restored_row(text)
                opened.append(event)
                if was_listed:
                    listed.add(event_key(event))
            elif store_key.startswith(ENDED):
                resource, sep, event_id = store_key[len(ENDED):].partition("\n")
                if not sep or not resource or not event_id:
                    raise StateError("not a resource and an event id")
                ended.append((resource.lower(), event_id.lower()))
        except StateError as exc:
            if strict:
                raise StateError(f"saved fleet state: row {store_key[:200]!r}: {exc}") from None
            log.error("saved fleet state: row %r left out: %s", store_key[:200], exc)
    # An ending is final: an open row beside the ended one (its deletion made in memory while the disk could not
    # be read, Outbox) is left behind, not an open event.
    over = set(ended)
    return FleetTracker([event for event in opened if event_key(event) not in over], ended, now=now, listed=listed)


def restored_row(text: str) -> tuple[FleetEvent, bool]:
    """One saved open event, and whether Resource Graph had listed it; raises StateError."""
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
        listed = row.get("listed", False)
        if feed not in ("resourcegraph", "eventgrid") or not isinstance(delivery, (str, type(None))) \
                or not isinstance(listed, bool):
            raise FeedError("feed, delivery_id or listed of the wrong kind")
        return dataclasses.replace(event, origin=feed, delivery_id=delivery,
                                   event_time=parse_event_time(when) if isinstance(when, str) else None), listed
    except (FeedError, ValueError) as exc:
        raise StateError(str(exc)) from None
