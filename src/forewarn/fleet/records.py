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

import json
import json.encoder
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from forewarn.fleet.armid import parse_arm_id
from forewarn.fleet.feed import FleetEvent, vm_ids
from forewarn.fleet.tracker import FleetChange
from forewarn.imds.instance import VmInfo
from forewarn.records import CONTENT_TYPE, SPEC_VERSION, TYPE_PREFIX, Record, record_id, rfc3339
from forewarn.tracker import ChangeKind

#: data.incarnation of fleet records (the central feeds have none).
FLEET_INCARNATION = 0


def fleet_vm(event: FleetEvent, vm_resource_id: str) -> VmInfo:
    """What the event tells about one VM it acts on (`vm_resource_id`, one of `vm_ids(event)`)."""
    return VmInfo(name=parse_arm_id(vm_resource_id).name, resource_id=vm_resource_id,
                  vm_scale_set=event.vms.scale_set, resource_group=event.resource_group,
                  subscription_id=event.subscription_id, location=event.location or "")


def _vm_common(event: FleetEvent) -> dict[str, str]:
    """The `data.vm` fields every VM of the event shares, in VmInfo's order, empty ones left out (as known())."""
    return {key: value for key, value in (("vm_scale_set", event.vms.scale_set),
                                          ("resource_group", event.resource_group),
                                          ("subscription_id", event.subscription_id),
                                          ("location", event.location or "")) if value}


#: json.dumps(value, separators=(",", ":")) without making an encoder for each call.
_json = json.JSONEncoder(separators=(",", ":")).encode
#: What _json gives for a string (JSONEncoder.encode's own first step), without its checks: twice per record.
_string = json.encoder.encode_basestring_ascii


def change_records(change: FleetChange, observed_at: datetime) -> list[Record]:
    """The records of one fleet change, one per VM the event acts on, in the order of its Resources.

    Each record's JSON (`Record.stored_json`, which the outbox stores) is `change_texts`': the text
    json.dumps(record.to_dict()) gives (tests/test_fleet_records.py holds the two equal)."""
    kind = str(change.kind)
    event = change.event.event
    raw = dict(event.raw)  # one copy for all the change's records: records are never changed
    common = _vm_common(change.event)
    extra = _extra(change)
    record_type, subject, time = f"{TYPE_PREFIX}.{kind}", event.event_id, rfc3339(observed_at)
    not_before = rfc3339(event.not_before) if event.not_before else None
    return [Record(id=rid, source=vm_resource_id, type=record_type, subject=subject, time=time,
                   data={"change": kind, "incarnation": FLEET_INCARNATION, "event": raw, "affects_this_vm": True,
                         "vm": {"name": name, "resource_id": vm_resource_id, **common}, "not_before": not_before,
                         **extra},
                   stored_json=text)
            for rid, name, vm_resource_id, text in _texts(change, rfc3339(observed_at))]


def change_texts(change: FleetChange, observed_at: datetime) -> list[str]:
    """The JSON text of each of `change_records(change, observed_at)`, without the records: what the committer
    stores. A first snapshot of 100,000 VMs makes 100,000 records, and their Record objects and `data` dicts,
    which the outbox never reads, were a fifth of building them."""
    return [text for _, _, _, text in _texts(change, rfc3339(observed_at))]


def _extra(change: FleetChange) -> dict[str, Any]:
    """The `data` fields after not_before: the feed, and what the change's kind adds."""
    extra: dict[str, Any] = {"feed": change.event.origin}
    if change.kind in (ChangeKind.UPDATED, ChangeKind.REMOVED) and change.previous is not None:
        extra["previous_status"] = change.previous.status
    if change.kind is ChangeKind.REMOVED and change.outcome is not None:
        extra["outcome"] = str(change.outcome)
        extra["ended_by"] = str(change.ended_by)
    return extra


#: The JSON of what every fleet record holds alike, encoded once.
_HEAD = f'{{"specversion":{_json(SPEC_VERSION)},"id":"'
_CONTENT = f'"datacontenttype":{_json(CONTENT_TYPE)},"data":{{"change":'
_INCARNATION = f',"incarnation":{_json(FLEET_INCARNATION)},"event":'


def _texts(change: FleetChange, time: str) -> Iterator[tuple[str, str, str, str]]:
    """Each VM's record id, name, ARM ID and record JSON. What the VMs share (the event's fields, the times, the
    type) is encoded once per change, and each record's JSON put together from those parts and its VM's, without
    encoding the event again for each of a scale set's VMs."""
    kind = str(change.kind)
    event = change.event.event
    not_before = rfc3339(event.not_before) if event.not_before else None
    event_id, fingerprint = event.event_id.lower(), change.fingerprint
    # to_dict()'s order: specversion, id, source, type, subject, time, datacontenttype, data{change, incarnation,
    # event, affects_this_vm, vm{name, resource_id, ...common}, not_before, ...extra}
    middle = (f',"type":{_json(f"{TYPE_PREFIX}.{kind}")},"subject":{_json(event.event_id)},"time":{_json(time)},'
              f'{_CONTENT}{_json(kind)}{_INCARNATION}{_json(dict(event.raw))},"affects_this_vm":true,"vm":{{"name":')
    vm_tail = "".join(f",{_json(key)}:{_json(value)}" for key, value in _vm_common(change.event).items())
    tail = f'}},"not_before":{_json(not_before)}' + "".join(f",{_json(key)}:{_json(value)}"
                                                            for key, value in _extra(change).items()) + "}}"
    for name, vm_resource_id in zip(change.event.vms.names, vm_ids(change.event), strict=True):
        rid = record_id(vm_resource_id.lower(), event_id, fingerprint, FLEET_INCARNATION)
        source = _string(vm_resource_id)
        yield rid, name, vm_resource_id, \
            f'{_HEAD}{rid}","source":{source}{middle}{_string(name)},"resource_id":{source}{vm_tail}{tail}'
