"""Every scheduled event of the fleet, one state per (target resource, EventId), moving forward only.

The central feeds differ from IMDS: an event has a final status of its own (Completed, Canceled) instead of
leaving a document; the same news arrives by several paths (a queue, a push, the next Resource Graph
snapshot), late, out of order or twice (Event Grid repeats a delivery with the same envelope id). So the
fleet tracker keeps, per event:

- a status that only moves forward: Scheduled -> Started -> Completed | Canceled. A late Scheduled after
  Started, or anything after a final status, changes nothing;
- the documented fields that make a change (type, status, NotBefore, Resources, description, source,
  duration); a repeat with the same fields is no change, whichever path it came by;
- a bounded memory of delivery ids (duplicates dropped) and of ended events (a Completed seen again, or
  after a restart, is not reported twice);
- for Resource Graph snapshots, which list what is open now: an open event missing from two complete
  snapshots in a row (and not updated since before the first of them) is ended, and the change says so. Only
  an event Resource Graph has listed counts as missing: one known only from the queue or a push may simply not
  be listed yet (nothing documents how far Resource Graph lags), so it ends with its final status.

The changes reuse the per-VM agent's kinds (`added`, `updated`, `removed` with an outcome), so records and
metrics read the same in both modes. Everything here is pure: the caller passes the clock's value in.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Container, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar

from forewarn.fleet.feed import FleetEvent
from forewarn.imds.document import format_not_before
from forewarn.tracker import ChangeKind, Outcome, removal_outcome

#: How far along each status is; an unknown status is treated as Scheduled (an open event).
STATUS_RANK = {"Scheduled": 0, "Started": 1, "Completed": 2, "Canceled": 2}
FINAL_OUTCOME = {"Completed": Outcome.COMPLETED, "Canceled": Outcome.CANCELLED}
#: Delivery ids remembered to drop Event Grid's repeats, and ended events remembered to ignore late news.
MAX_DELIVERY_IDS = 100_000
MAX_ENDED = 100_000
#: Complete snapshots in a row an open event must be missing from before it is ended.
MISSING_SNAPSHOTS = 2

K = TypeVar("K", bound=Hashable)


class EndedBy(str, Enum):
    """How the tracker learnt that an event ended."""

    STATUS = "status"      # the feed said Completed or Canceled
    MISSING = "missing"    # gone from two complete snapshots in a row without a final status

    def __str__(self) -> str:
        return self.value


def event_key(event: FleetEvent) -> tuple[str, str]:
    """(target resource, EventId) without regard to case: ARM IDs and GUIDs compare case-insensitively."""
    return event.key


def fingerprint(event: FleetEvent) -> str:
    """A digest of the documented fields: equal for the same news from any feed, replica or restart."""
    e = event.event
    parts = [e.event_type, e.status, format_not_before(e.not_before) if e.not_before else "",
             "\x1f".join(e.resources), e.description or "", e.source or "",
             "" if e.duration_seconds is None else str(e.duration_seconds)]
    return hashlib.sha256("\x1e".join(parts).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class FleetChange:
    """Something that happened to one event of the fleet. For `removed`, `event` is the event as it ended
    (the final status when the feed sent one, else as last seen) and `ended_by` says how it was learnt."""

    kind: ChangeKind
    event: FleetEvent
    previous: FleetEvent | None = None
    outcome: Outcome | None = None
    ended_by: EndedBy | None = None

    @property
    def fingerprint(self) -> str:
        """What tells this change from the event's others: record ids are built from it, so the same change
        gets the same id whichever replica or restart reports it."""
        return f"{self.kind}:{fingerprint(self.event)}:{self.ended_by or ''}"


@dataclass(frozen=True)
class FleetView:
    """What the approver reads in one step, taken at one moment (under the committer's lock), so that open
    events, snapshots and endings never come from two different moments.

    `ended(event_id)` asks the tracker's memory of ended events: an ending is final, so asking it later can only
    learn more, never contradict `open_events`."""

    open_events: tuple[FleetEvent, ...]
    #: Complete Resource Graph snapshots committed in this term (started after it began).
    complete_snapshots: int = 0
    #: Whether Resource Graph is a source: if so, nothing is done to nodes before the term's first complete
    #: snapshot, since until then the open events are not all known.
    snapshots_expected: bool = False
    ended: Callable[[str], bool] = lambda event_id: False
    #: Whether Resource Graph has listed the open event of this key (event_key).
    listed: Callable[[tuple[str, str]], bool] = lambda key: True
    #: Why every action is held (the saved state could not be read back after a failed commit, so the open
    #: events are not known), or None: then no event is over and nothing is done to nodes.
    held: str | None = None
    #: The open events' EventIds in lower case (what a node's ledger names).
    open_ids: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "open_ids", frozenset(event.event_id.lower() for event in self.open_events))

    @property
    def ready_for_nodes(self) -> bool:
        return self.held is None and (not self.snapshots_expected or self.complete_snapshots > 0)

    def over(self, event_id: str, listed: bool = True) -> bool:
        """Whether `event_id` is known to be over: the tracker ended it (a final status, or missing from two
        complete snapshots in a row), or it is not open and two complete snapshots of this term lacked it,
        where Resource Graph had `listed` it before (else its absence may be Resource Graph's lag)."""
        if self.held is not None or event_id.lower() in self.open_ids:
            return False
        return self.ended(event_id) or (listed and self.complete_snapshots >= MISSING_SNAPSHOTS)


@dataclass(slots=True)
class _Open:
    event: FleetEvent
    updated_at: float       # the clock when this state was last changed or confirmed by a push
    missing: int = 0        # complete snapshots in a row without it
    listed: bool = False    # a snapshot listed it: only then can it go missing


class FleetTracker:
    """The open events of the fleet, and the changes each new piece of news brings."""

    def __init__(self, open_events: Iterable[FleetEvent] = (), ended: Iterable[tuple[str, str]] = (),
                 now: float = 0.0, listed: Container[tuple[str, str]] = ()) -> None:
        """`listed`: the keys of open events a Resource Graph snapshot listed (as saved); an event that came from
        Resource Graph itself was listed in any case."""
        self._open: dict[tuple[str, str], _Open] = {
            event_key(e): _Open(e, now, listed=e.origin == "resourcegraph" or event_key(e) in listed)
            for e in open_events}
        self._ended: OrderedDict[tuple[str, str], None] = OrderedDict((key, None) for key in ended)
        self._ended_ids: Counter[str] = Counter(event_id for _, event_id in self._ended)   # by EventId
        self._deliveries: OrderedDict[str, None] = OrderedDict()
        self._forgotten: list[tuple[str, str]] = []  # ended events pushed out of memory since the last take
        #: Open events a snapshot listed for the first time without changing them, since the last take: their
        #: saved rows must say so, or a reload would forget it and never end them by their absence.
        self._newly_listed: list[tuple[str, str]] = []
        self.duplicates = 0      # deliveries dropped by id
        self.stale = 0           # news that would have moved an event backwards, or came after its end

    @property
    def open_events(self) -> list[FleetEvent]:
        return [state.event for state in self._open.values()]

    @property
    def ended_keys(self) -> list[tuple[str, str]]:
        """The ended events remembered (oldest first): saved with the open ones, so a restart keeps them."""
        return list(self._ended)

    # --- news from a push or a queue ----------------------------------------------------------------
    def apply(self, event: FleetEvent, now: float) -> list[FleetChange]:
        """One event from any feed; [] when it repeats or is older than what is known."""
        if event.delivery_id is not None:
            if event.delivery_id in self._deliveries:
                self.duplicates += 1
                return []
            self._remember(self._deliveries, event.delivery_id, MAX_DELIVERY_IDS)  # not saved: nothing to drop
        key = event_key(event)
        if key in self._ended:
            self.stale += 1
            return []
        state = self._open.get(key)
        final = FINAL_OUTCOME.get(event.status)
        if state is None:
            if final is not None:
                # first heard of at its end: one record says it ended (no `added` just before it)
                self._end(key)
                return [FleetChange(ChangeKind.REMOVED, event, None, final, EndedBy.STATUS)]
            self._open[key] = _Open(event, now, listed=event.origin == "resourcegraph")
            return [FleetChange(ChangeKind.ADDED, event)]
        previous = state.event
        if STATUS_RANK.get(event.status, 0) < STATUS_RANK.get(previous.status, 0):
            self.stale += 1
            return []
        if final is not None:
            del self._open[key]
            self._end(key)
            return [FleetChange(ChangeKind.REMOVED, event, previous, final, EndedBy.STATUS)]
        state.missing = 0
        state.updated_at = now
        if event is previous or fingerprint(event) == fingerprint(previous):  # `is`: FleetCommitter.known
            return []
        state.event = event
        return [FleetChange(ChangeKind.UPDATED, event, previous)]

    # --- a Resource Graph snapshot ------------------------------------------------------------------
    def apply_snapshot(self, events: Sequence[FleetEvent], started_at: float, now: float,
                       complete: bool = True) -> list[FleetChange]:
        """The events a snapshot lists, each applied as news; then, when the snapshot covered every scope
        and page (`complete`), the open events it lacks are counted missing, and ended at the second
        complete snapshot in a row that lacks them. An event changed after `started_at` (news that came
        by push while the snapshot ran, which Resource Graph may not show yet) is not counted missing."""
        changes: list[FleetChange] = []
        listed = set()
        for event in events:
            key = event_key(event)
            listed.add(key)
            found = self.apply(event, now)
            changes += found
            state = self._open.get(key)
            if state is not None and not state.listed:   # even a partial snapshot shows that Resource Graph lists it
                state.listed = True
                if not found:   # else the change's own row says so, in the change's transaction
                    self._newly_listed.append(key)
        if not complete:
            return changes
        for key, state in list(self._open.items()):
            if key in listed:
                state.missing = 0
                continue
            if state.updated_at > started_at or not state.listed:
                continue
            state.missing += 1
            if state.missing >= MISSING_SNAPSHOTS:
                del self._open[key]
                self._end(key)
                last = state.event
                changes.append(FleetChange(ChangeKind.REMOVED, last, last, removal_outcome(last.event),
                                           EndedBy.MISSING))
        return changes

    def open_event(self, key: tuple[str, str]) -> FleetEvent | None:
        """The open event of this key (event_key), as the tracker holds it."""
        state = self._open.get(key)
        return state.event if state is not None else None

    def was_listed(self, key: tuple[str, str]) -> bool:
        """Whether the open event `key` (event_key) was listed by a Resource Graph snapshot."""
        state = self._open.get(key)
        return state is not None and state.listed

    @property
    def listing_unsaved(self) -> bool:
        """Whether a snapshot listed an open event for the first time without changing it, since the last take."""
        return bool(self._newly_listed)

    def take_newly_listed(self) -> list[tuple[str, str]]:
        """The open events a snapshot listed for the first time since the last call (to save that they were)."""
        listed, self._newly_listed = self._newly_listed, []
        return [key for key in listed if key in self._open]

    def has_ended(self, event_id: str) -> bool:
        """Whether an event with this EventId (any target) is remembered as ended."""
        return self._ended_ids[event_id.lower()] > 0

    def take_forgotten(self) -> list[tuple[str, str]]:
        """The ended events pushed out of the bounded memory since the last call (to drop from saved state)."""
        forgotten, self._forgotten = self._forgotten, []
        return forgotten

    # --- bounded memories ---------------------------------------------------------------------------
    def _end(self, key: tuple[str, str]) -> None:
        if key not in self._ended:
            self._ended_ids[key[1]] += 1
        let_go = self._remember(self._ended, key, MAX_ENDED)
        for _, event_id in let_go:
            self._ended_ids[event_id] -= 1
            if self._ended_ids[event_id] <= 0:
                del self._ended_ids[event_id]
        self._forgotten += let_go

    @staticmethod
    def _remember(memory: OrderedDict[K, None], key: K, limit: int) -> list[K]:
        """Remember `key` (as the newest); returns the oldest keys let go to stay within `limit`."""
        memory[key] = None
        memory.move_to_end(key)
        let_go = []
        while len(memory) > limit:
            let_go.append(memory.popitem(last=False)[0])
        return let_go
