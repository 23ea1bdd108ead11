"""What one `forewarn fleet` instance is responsible for: its scope (subscriptions or management groups, and
optionally resource groups within them) and, with it, the owner name its node actions carry.

Every path that brings events in (the Resource Graph query, the Storage queue, the Event Grid push) and every
node action honours the scope: an event outside it is not this instance's, so it is neither recorded nor acted
on. Two instances with different scopes can then share one cluster, each undoing only what it applied.

A management group cannot be checked locally (which subscriptions it holds is Resource Graph's knowledge), so
with `--management-group` only the resource-group part of the scope is checked on queue and push events; the
Event Grid subscription that feeds them is what keeps them within the management group.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from forewarn.fleet.feed import FleetEvent
from forewarn.owner import Owner

T = TypeVar("T")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FleetScope:
    """Subscriptions (lower-case GUIDs) or management groups, and resource groups (compared without regard to
    case, as ARM compares them; empty: every resource group)."""

    subscriptions: tuple[str, ...] = ()
    management_groups: tuple[str, ...] = ()
    resource_groups: tuple[str, ...] = ()

    @classmethod
    def of(cls, subscriptions: Sequence[str] = (), management_groups: Sequence[str] = (),
           resource_groups: Sequence[str] = ()) -> FleetScope:
        return cls(tuple(sorted({s.lower() for s in subscriptions})), tuple(sorted(set(management_groups))),
                   tuple(sorted({g.lower() for g in resource_groups})))

    def contains(self, event: FleetEvent) -> bool:
        """Whether `event` is this instance's: in one of its subscriptions (when given) and resource groups
        (when given)."""
        return self.outside(event) is None

    def outside(self, event: FleetEvent) -> str | None:
        """Why `event` is not this instance's (the part of the scope it misses), or None when it is."""
        if self.subscriptions and event.subscription_id.lower() not in self.subscriptions:
            return f"subscription {event.subscription_id.lower()} is not one of --subscription"
        if self.resource_groups and event.resource_group.lower() not in self.resource_groups:
            return f"resource group {event.resource_group.lower()} is not one of --resource-group"
        return None

    def describe(self) -> str:
        """The scope as people read it (logs, the ledger entries' `scope`)."""
        parts = []
        if self.subscriptions:
            parts.append("subscription " + ",".join(self.subscriptions))
        if self.management_groups:
            parts.append("management group " + ",".join(self.management_groups))
        if self.resource_groups:
            parts.append("resource group " + ",".join(self.resource_groups))
        return "; ".join(parts) or "any"

    def owner(self, lease: str = "") -> Owner:
        """The owner name of this instance's node actions: its scope and its Lease (`namespace/name`, or "" for
        a single instance without one)."""
        return Owner.fleet(self.describe(), lease)


class ScopeGate:
    """Where queue messages and push deliveries enter: keeps the events within the scope, and tells `left_out`
    (source, count) of the others. Resource Graph needs no gate: its query carries the scope.

    The queue or Event Grid subscription of an instance with a narrower scope may well bring events of other
    resource groups all day, so each reason (the subscription or resource group missed) is logged once, not
    per event; at most MAX_REASONS of them, so a stream of strangers cannot fill the log or the memory.
    """

    MAX_REASONS = 100

    def __init__(self, scope: FleetScope, left_out: Callable[[str, int], object]) -> None:
        self.scope = scope
        self._left_out = left_out
        self._lock = threading.Lock()  # push deliveries come in on several server threads
        self._logged: set[str] = set()

    def keep(self, events: Sequence[FleetEvent], source: str) -> list[FleetEvent]:
        """The events of `events` (from `source`: queue, eventgrid) that are within the scope (not counted: see
        `admit`)."""
        kept = []
        for event in events:
            reason = self.scope.outside(event)
            if reason is None:
                kept.append(event)
            else:
                self._log_once(reason, source)
        return kept

    def admit(self, events: Sequence[FleetEvent], source: str, commit: Callable[[list[FleetEvent]], T]) -> T:
        """`commit` of the events within the scope; the others are counted once it returned. A delivery whose
        commit raised (a full outbox refused it) comes again, and its strangers are counted then, once."""
        kept = self.keep(events, source)
        result = commit(kept)
        if len(kept) < len(events):
            self._left_out(source, len(events) - len(kept))
        return result

    def _log_once(self, reason: str, source: str) -> None:
        with self._lock:
            if reason in self._logged or len(self._logged) >= self.MAX_REASONS:
                return
            self._logged.add(reason)
            full = len(self._logged) == self.MAX_REASONS
        log.info("%s: events outside this instance's scope (%s) left out, not recorded: %s; logged once per "
                 "reason%s", source, self.scope.describe(), reason,
                 f" (this is reason {self.MAX_REASONS}: further ones are not logged)" if full else "")
