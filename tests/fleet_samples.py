"""Builders for central-feed payloads: Resource Graph rows and Event Grid / CloudEvents deliveries.

Built from the shapes the Scheduled Events pages document (field names and nesting), with values of our
own; nothing here is a copied sample.
"""

from __future__ import annotations

import base64
import json
from typing import Any

SUB = "0b6a1c2d-3e4f-4a5b-8c7d-9e0f1a2b3c4d"
RG = "rg-Workers"
EVENT_ID = "5D1C0D3E-9F1B-4C6A-8E21-0F4B7A9C2D11"
NOT_BEFORE = "Tue, 14 Oct 2025 09:30:00 GMT"
SCHEDULED_EVENT_TYPE = "Microsoft.ResourceNotifications.MaintenanceResources.ScheduledEventEmitted"

_TARGET_TYPES = {
    "vm": "virtualMachines",
    "vmss": "virtualMachineScaleSets",
    "avset": "availabilitySets",
}


def target_id(kind: str = "vm", name: str = "vm-a", sub: str = SUB, rg: str = RG) -> str:
    return f"/subscriptions/{sub}/resourceGroups/{rg}/providers/Microsoft.Compute/{_TARGET_TYPES[kind]}/{name}"


def event_arm_id(target: str, event_id: str = EVENT_ID) -> str:
    return f"{target}/providers/Microsoft.Maintenance/scheduledevents/{event_id}"


def properties(event_id: str = EVENT_ID, event_type: str = "Reboot", status: str = "Scheduled",
               resources: tuple[str, ...] | list[Any] = ("vm-a",), not_before: str | None = None,
               **extra: Any) -> dict[str, Any]:
    """The PascalCase event fields. NotBefore is empty once an event has Started (and after)."""
    if not_before is None:
        not_before = NOT_BEFORE if status == "Scheduled" else ""
    return {
        "EventId": event_id, "EventType": event_type, "ResourceType": "VirtualMachine",
        "Resources": list(resources), "EventStatus": status, "NotBefore": not_before,
        "Description": "Host update needs a reboot", "EventSource": "Platform", "DurationInSeconds": 600,
        **extra,
    }


def resource_info(props: dict[str, Any], target: str) -> dict[str, Any]:
    return {
        "id": event_arm_id(target, props.get("EventId", EVENT_ID)),
        "name": props.get("EventId", EVENT_ID),
        "type": "Microsoft.Maintenance/scheduledevents",
        "location": "westeurope",
        "properties": props,
    }


def event_grid_event(props: dict[str, Any] | None = None, target: str | None = None, delivery_id: str = "eg-0001",
                     event_time: str = "2025-10-14T09:14:03.2468013Z",
                     event_type: str = SCHEDULED_EVENT_TYPE) -> dict[str, Any]:
    """One event in the Event Grid schema."""
    props = properties() if props is None else props
    target = target_id() if target is None else target
    info = resource_info(props, target)
    return {
        "id": delivery_id, "topic": f"/subscriptions/{SUB}", "subject": info["id"], "eventType": event_type,
        "eventTime": event_time, "dataVersion": "3.0", "metadataVersion": "1",
        "data": {"resourceInfo": info, "apiVersion": "2024-07-01",
                 "operationalInfo": {"resourceEventTime": event_time}},
    }


def cloud_event(props: dict[str, Any] | None = None, target: str | None = None, delivery_id: str = "ce-0001",
                time: str = "2025-10-14T09:14:03Z", event_type: str = SCHEDULED_EVENT_TYPE) -> dict[str, Any]:
    """One event in the CloudEvents 1.0 schema, structured mode."""
    props = properties() if props is None else props
    target = target_id() if target is None else target
    info = resource_info(props, target)
    return {
        "specversion": "1.0", "id": delivery_id, "source": f"/subscriptions/{SUB}", "type": event_type,
        "time": time, "subject": info["id"], "datacontenttype": "application/json",
        "data": {"resourceInfo": info, "apiVersion": "2024-07-01"},
    }


def other_event(delivery_id: str = "eg-other") -> dict[str, Any]:
    """An Event Grid event of another kind: a resource health annotation on a VM."""
    vm = target_id()
    return {
        "id": delivery_id, "topic": f"/subscriptions/{SUB}", "subject": vm,
        "eventType": "Microsoft.ResourceNotifications.HealthResources.ResourceAnnotated",
        "eventTime": "2025-10-14T09:00:00Z", "dataVersion": "1", "metadataVersion": "1",
        "data": {"resourceInfo": {"id": f"{vm}/providers/Microsoft.ResourceHealth/resourceAnnotations/current",
                                  "properties": {"annotationName": "VirtualMachineRebootInitiatedByControlPlane"}}},
    }


def resource_graph_row(props: dict[str, Any] | None = None, target: str | None = None) -> dict[str, Any]:
    """One row of `maintenanceresources` as the objectArray result format returns it."""
    props = properties() if props is None else props
    target = target_id() if target is None else target
    info = resource_info(props, target)
    return {
        "id": info["id"], "name": info["name"], "type": "microsoft.maintenance/scheduledevents",
        "tenantId": "7f3e2d1c-0b9a-4876-a5b4-c3d2e1f0a9b8", "location": "westeurope",
        "resourceGroup": RG.lower(), "subscriptionId": SUB, "zones": ["2"], "properties": props,
    }


def projected_row(props: dict[str, Any] | None = None, target: str | None = None) -> dict[str, Any]:
    """A row of forewarn's query sketch: `id` kept, the properties projected under short names."""
    props = properties() if props is None else props
    target = target_id() if target is None else target
    return {
        "id": event_arm_id(target, props["EventId"]), "subscriptionId": SUB, "resourceGroup": RG.lower(),
        "location": "westeurope", "eventId": props["EventId"], "eventType": props["EventType"],
        "status": props["EventStatus"], "notBefore": props["NotBefore"], "resources": props["Resources"],
        "durationSec": props["DurationInSeconds"], "source": props["EventSource"],
        "description": props["Description"],
    }


def as_base64(value: Any) -> str:
    """A message as Event Grid's Storage-queue delivery writes it: base64 of the JSON."""
    return base64.b64encode(json.dumps(value).encode()).decode("ascii")
