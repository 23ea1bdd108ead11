"""Turn consecutive Scheduled Events documents into changes.

There is no Completed or Canceled status in IMDS: an event that finishes or is called off simply leaves
the array. Which one it was follows from the last status seen: Started means it ran (completed),
Scheduled means Azure withdrew it (cancelled).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from forewarn.imds.document import Document, Event


class ChangeKind(str, Enum):
    """How one event differs between two documents. (Approvals are the approver's news, not the
    document's: records.approval_record writes them.)"""

    ADDED = "added"
    UPDATED = "updated"
    REMOVED = "removed"

    def __str__(self) -> str:
        return self.value


class Outcome(str, Enum):
    COMPLETED = "completed"
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Change:
    """Something that happened to one event, seen in the document of `incarnation`.

    For `removed`, `event` is the event as last seen, since the new document no longer holds it.
    """

    kind: ChangeKind
    event: Event
    incarnation: int
    previous: Event | None = None
    outcome: Outcome | None = None


def removal_outcome(last_seen: Event) -> Outcome:
    return Outcome.CANCELLED if last_seen.status == "Scheduled" else Outcome.COMPLETED


def diff_documents(before: Document | None, after: Document) -> list[Change]:
    """The changes that lead from `before` to `after`, all of one document at once.

    `before=None` means nothing was known yet: every event is new. Two documents with the same
    incarnation hold the same events (IMDS raises the incarnation on every change), so that case is a
    no-op. Order: removals first (in the old document's order), then additions and updates in the new
    document's order, so a consumer that replays the records rebuilds the document.
    """
    if before is not None and before.incarnation == after.incarnation:
        return []
    old = {event.event_id: event for event in before.events} if before else {}
    new_ids = {event.event_id for event in after.events}
    changes = [
        Change(ChangeKind.REMOVED, event, after.incarnation, previous=event, outcome=removal_outcome(event))
        for event in (before.events if before else ())
        if event.event_id not in new_ids
    ]
    for event in after.events:
        previous = old.get(event.event_id)
        if previous is None:
            changes.append(Change(ChangeKind.ADDED, event, after.incarnation))
        elif previous.raw != event.raw:
            changes.append(Change(ChangeKind.UPDATED, event, after.incarnation, previous=previous))
    return changes


class Tracker:
    """Holds the last document and hands out the changes each new one brings."""

    def __init__(self, initial: Document | None = None) -> None:
        self._current = initial

    @property
    def current(self) -> Document | None:
        return self._current

    def apply(self, document: Document) -> list[Change]:
        changes = diff_documents(self._current, document)
        if self._current is None or document.incarnation != self._current.incarnation:
            self._current = document
        return changes
