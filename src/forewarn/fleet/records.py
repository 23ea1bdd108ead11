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

from datetime import datetime

from forewarn.fleet.armid import COMPUTE_NAMESPACE, VIRTUAL_MACHINE_SCALE_SETS, parse_arm_id
from forewarn.fleet.feed import FleetEvent, vm_ids
from forewarn.fleet.tracker import FleetChange
from forewarn.imds.instance import VmInfo
from forewarn.records import TYPE_PREFIX, Record, event_data, record_id, record_source, rfc3339
from forewarn.tracker import ChangeKind

#: data.incarnation of fleet records (the central feeds have none).
FLEET_INCARNATION = 0


def fleet_vm(event: FleetEvent, vm_resource_id: str) -> VmInfo:
    """What the event tells about one VM it acts on."""
    target = parse_arm_id(event.resource_id)
    scale_set = target.name if target.is_type(COMPUTE_NAMESPACE, VIRTUAL_MACHINE_SCALE_SETS) else ""
    return VmInfo(name=parse_arm_id(vm_resource_id).name, resource_id=vm_resource_id, vm_scale_set=scale_set,
                  resource_group=event.resource_group, subscription_id=event.subscription_id,
                  location=event.location or "")


def change_records(change: FleetChange, observed_at: datetime) -> list[Record]:
    """The records of one fleet change, one per VM the event acts on, in the order of its Resources."""
    kind = str(change.kind)
    records = []
    for vm_resource_id in vm_ids(change.event):
        vm = fleet_vm(change.event, vm_resource_id)
        event = change.event.event
        data = event_data(kind, event, FLEET_INCARNATION, vm)
        data["affects_this_vm"] = True
        data["feed"] = change.event.origin
        if change.kind in (ChangeKind.UPDATED, ChangeKind.REMOVED) and change.previous is not None:
            data["previous_status"] = change.previous.status
        if change.kind is ChangeKind.REMOVED and change.outcome is not None:
            data["outcome"] = str(change.outcome)
            data["ended_by"] = str(change.ended_by)
        records.append(Record(
            id=record_id(vm_resource_id.lower(), event.event_id.lower(), change.fingerprint, FLEET_INCARNATION),
            source=record_source(vm),
            type=f"{TYPE_PREFIX}.{kind}",
            subject=event.event_id,
            time=rfc3339(observed_at),
            data=data,
        ))
    return records
