"""Changes as CloudEvents 1.0 records: what every sink receives.

The record id is a UUID derived from (VM, event, change, incarnation), never random, so a record sent
twice (after a restart or a retry) carries the same id and consumers can drop the repeat.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from forewarn.imds.instance import VmInfo
from forewarn.tracker import Change, ChangeKind

#: Prefix of every record `type`; the change kind is appended (`...scheduled_event.added`).
TYPE_PREFIX = "io.github.forewarn.scheduled_event"
CONTENT_TYPE = "application/json"
SPEC_VERSION = "1.0"

_ID_NAMESPACE = uuid.UUID("5a4d5bd4-3f0e-4c55-9a3c-0f0e7a7f2f8e")


@dataclass(frozen=True)
class Record:
    """One CloudEvents structured-mode record. `data` is JSON-ready."""

    id: str
    source: str
    type: str
    subject: str
    time: str
    data: Mapping[str, Any] = field(hash=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "specversion": SPEC_VERSION,
            "id": self.id,
            "source": self.source,
            "type": self.type,
            "subject": self.subject,
            "time": self.time,
            "datacontenttype": CONTENT_TYPE,
            "data": dict(self.data),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=False)

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> Record:
        return cls(
            id=value["id"],
            source=value["source"],
            type=value["type"],
            subject=value["subject"],
            time=value["time"],
            data=value["data"],
        )


def record_id(vm_name: str, event_id: str, kind: str, incarnation: int) -> str:
    return str(uuid.uuid5(_ID_NAMESPACE, f"{vm_name}\n{event_id}\n{kind}\n{incarnation}"))


def record_source(vm: VmInfo) -> str:
    return vm.resource_id or f"forewarn://{vm.name or 'unknown'}"


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def to_record(
    change: Change,
    vm: VmInfo,
    observed_at: datetime,
    extra: Mapping[str, Any] | None = None,
) -> Record:
    """The record for `change` as seen by `vm` at `observed_at`; `extra` adds kind-specific fields."""
    event = change.event
    data: dict[str, Any] = {
        "change": str(change.kind),
        "incarnation": change.incarnation,
        "event": dict(event.raw),
        "affects_this_vm": event.affects(vm.name),
        "vm": vm.known(),
        "not_before": rfc3339(event.not_before) if event.not_before else None,
    }
    if change.kind in (ChangeKind.UPDATED, ChangeKind.REMOVED) and change.previous is not None:
        data["previous_status"] = change.previous.status
    if change.kind is ChangeKind.REMOVED and change.outcome is not None:
        data["outcome"] = str(change.outcome)
    if extra:
        data.update(extra)
    return Record(
        id=record_id(vm.name, event.event_id, str(change.kind), change.incarnation),
        source=record_source(vm),
        type=f"{TYPE_PREFIX}.{change.kind}",
        subject=event.event_id,
        time=rfc3339(observed_at),
        data=data,
    )
