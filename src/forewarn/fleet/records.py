"""Fleet changes as records: the per-VM agent's records, one for each VM an event acts on.

A consumer reads a fleet record as it reads one from the agent on that VM: the same types, fields and
meaning (CONTRACT.md), `source` and `data.vm` naming the VM (its ARM ID, name, scale set, resource group,
subscription), `affects_this_vm` true. What differs, and why:
- `data.incarnation` is 0: the central feeds have no document incarnation;
- the id is derived from (VM, event, change, the documented fields that changed), so the same change gets
  the same id whichever feed brought it, whichever replica reports it and after any restart;
- `data.feed` says which feed brought the news (`resourcegraph` or `eventgrid`), and a `removed` record of an
  event the feeds stopped listing without a final status carries `data.ended_by: missing`.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

from forewarn.fleet.armid import parse_arm_id
from forewarn.fleet.feed import FleetEvent, vm_ids
from forewarn.fleet.tracker import FleetChange
from forewarn.imds.instance import VmInfo
from forewarn.records import TYPE_PREFIX, Record, record_id, rfc3339
from forewarn.tracker import ChangeKind

#: data.incarnation of fleet records (the central feeds have none).
FLEET_INCARNATION = 0


def fleet_vm(event: FleetEvent, vm_resource_id: str) -> VmInfo:
    """What the event tells about one VM it acts on (`vm_resource_id`, one of `vm_ids(event)`)."""
    return VmInfo(name=parse_arm_id(vm_resource_id).name, resource_id=vm_resource_id,
                  vm_scale_set=event.vms.scale_set, resource_group=event.resource_group,
                  subscription_id=event.subscription_id, location=event.location or "")


def fleet_vms(event: FleetEvent) -> Iterator[tuple[str, dict[str, str]]]:
    """Each VM the event acts on: its ARM ID and `data.vm` (what `fleet_vm(...).known()` gives), from the event's
    parse kept in `event.vms`, no ARM ID parsed again."""
    common = {key: value for key, value in (("vm_scale_set", event.vms.scale_set),
                                            ("resource_group", event.resource_group),
                                            ("subscription_id", event.subscription_id),
                                            ("location", event.location or "")) if value}
    for name, vm_resource_id in zip(event.vms.names, vm_ids(event), strict=True):
        yield vm_resource_id, {"name": name, "resource_id": vm_resource_id, **common}


def change_records(change: FleetChange, observed_at: datetime) -> list[Record]:
    """The records of one fleet change, one per VM the event acts on, in the order of its Resources. What the
    VMs share (the event's fields, the times, the type) is built once per change."""
    kind = str(change.kind)
    event = change.event.event
    shared: dict[str, Any] = {
        "change": kind,
        "incarnation": FLEET_INCARNATION,
        "event": dict(event.raw),  # one copy for all the change's records: records are never changed
        "affects_this_vm": True,
    }
    not_before = rfc3339(event.not_before) if event.not_before else None
    extra: dict[str, Any] = {"feed": change.event.origin}
    if change.kind in (ChangeKind.UPDATED, ChangeKind.REMOVED) and change.previous is not None:
        extra["previous_status"] = change.previous.status
    if change.kind is ChangeKind.REMOVED and change.outcome is not None:
        extra["outcome"] = str(change.outcome)
        extra["ended_by"] = str(change.ended_by)
    record_type, subject, time = f"{TYPE_PREFIX}.{kind}", event.event_id, rfc3339(observed_at)
    event_id, fingerprint = event.event_id.lower(), change.fingerprint
    records = []
    for vm_resource_id, vm in fleet_vms(change.event):
        records.append(Record(
            id=record_id(vm_resource_id.lower(), event_id, fingerprint, FLEET_INCARNATION),
            source=vm_resource_id,
            type=record_type,
            subject=subject,
            time=time,
            data={**shared, "vm": vm, "not_before": not_before, **extra},
        ))
    return records
