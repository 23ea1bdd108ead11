"""Who applied a node action: every entry of a node's ledger (the `forewarn.io/applied` annotation) names its
owner, and each actor undoes only the entries it owns.

- The per-VM agent of the node: owner id `agent` (only the agent running on a node acts on that node).
- A `forewarn fleet` instance: owner id `fleet:` and a digest of its scope and Lease, so two instances with
  different scopes in one cluster, or two deployments with different Leases, never take each other's entries.

The ledger maps an entry key, `{EventId}@{owner id}`, to what that owner applied for that event, with the
owner written out (`event`, `by`, and for fleet mode `scope` and `lease`) so that `kubectl get node -o yaml`
says who holds what. An entry keyed by the bare EventId (no `@`) was written by a version before owners: it is
`legacy` (see docs/fleet.md, "Who owns what").
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

AGENT = "agent"
FLEET = "fleet"
#: The owner id of entries written before owners existed.
LEGACY = ""


@dataclass(frozen=True)
class Owner:
    """An actor that applies node actions. `by` is `agent` or `fleet`; a fleet instance also has its scope (as
    people read it) and Lease (`namespace/name`, or "" without one)."""

    by: str = AGENT
    scope: str = ""
    lease: str = ""

    @classmethod
    def fleet(cls, scope: str, lease: str = "") -> Owner:
        return cls(FLEET, scope, lease)

    @property
    def id(self) -> str:
        if self.by == AGENT:
            return AGENT
        digest = hashlib.sha256(f"{self.scope}\n{self.lease}".encode()).hexdigest()[:12]
        return f"{FLEET}:{digest}"

    def key(self, event_id: str) -> str:
        """The ledger key of this owner's entry for `event_id`."""
        return f"{event_id}@{self.id}"

    def new_entry(self, event_id: str) -> dict[str, Any]:
        """An empty entry naming this owner (the actions go in beside these fields)."""
        entry: dict[str, Any] = {"event": event_id, "by": self.id}
        if self.by == FLEET:
            entry["scope"] = self.scope
            if self.lease:
                entry["lease"] = self.lease
        return entry

    def describe(self) -> str:
        if self.by == AGENT:
            return "the per-VM agent of this node"
        return f"forewarn fleet ({self.scope}{'; Lease ' + self.lease if self.lease else ''})"


@dataclass(frozen=True)
class EntryRef:
    """One entry of a node's ledger: its key, the event it is for, and its owner id (LEGACY for an entry
    written before owners)."""

    key: str
    event_id: str
    owner_id: str
    #: Fleet mode: Resource Graph listed the event when the entry was written, so its absence from later
    #: snapshots is news (an event known only from the queue or a push may just not be listed yet).
    listed: bool = False

    @property
    def legacy(self) -> bool:
        return self.owner_id == LEGACY


def entry_ref(key: str, entry: dict[str, Any]) -> EntryRef:
    """What `key` and its `entry` say about who holds what (an entry without `by` is legacy)."""
    by = entry.get("by")
    if isinstance(by, str) and by:
        event_id = entry.get("event")
        return EntryRef(key, str(event_id) if isinstance(event_id, str) and event_id else key.split("@", 1)[0], by,
                        entry.get("listed") is True)
    return EntryRef(key, key, LEGACY)
