"""Scenarios: timelines of scheduled events, as data.

A scenario file (YAML or JSON) has the same shape as the built-in scenarios below:

    name: drain-drill
    vm_name: web-0              # the VM the simulator answers for (compute.name)
    vms: [web-0, web-1]         # default Resources of every event
    loop: 1800                  # optional: replay the timeline every N seconds, with new EventIds
    events:
      - at: 10                  # seconds after the start when the event appears
        type: Reboot
        source: Platform
        notice: 900             # seconds from appearance to NotBefore; omit for "appears Started"
        duration: -1            # DurationInSeconds; null omits the field (as the Spot sample does)
        run_for: 600            # seconds from Started until the event leaves the document
        cancel_after: 120       # optional: Azure withdraws it this long after it appeared
        resources: [web-0]
        description: "..."

Times are in scenario seconds; `--speed` compresses them. Timings follow shared IMDS.md: minimum
notice 15 min for Freeze and Reboot, 10 min for Redeploy, 5-15 min for Terminate, 30 s for Preempt;
Started to removed about 10 minutes; degraded hardware days ahead.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from forewarn.imds.document import EVENT_SOURCES

_ID_NAMESPACE = uuid.UUID("0b1d2e6c-9d7a-4c1e-8f3b-6a2f4f1e0c11")


class ScenarioError(ValueError):
    """A scenario name or file is unusable; the message names the field."""


@dataclass(frozen=True)
class EventSpec:
    event_id: str
    event_type: str
    at: float
    notice: float | None
    source: str | None = "Platform"
    duration: int | None = -1
    run_for: float = 600.0
    cancel_after: float | None = None
    resources: tuple[str, ...] = ()
    description: str = ""
    resource_type: str = "VirtualMachine"


@dataclass(frozen=True)
class Scenario:
    name: str
    vm_name: str
    events: tuple[EventSpec, ...]
    loop: float | None = None
    summary: str = ""
    vms: tuple[str, ...] = field(default=())


def _number(value: Any, where: str, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ScenarioError(f"{where} must be a number of seconds, got {value!r}")
    return float(value)


def parse_event(raw: Any, index: int, scenario: str, vms: tuple[str, ...]) -> EventSpec:
    where = f"events[{index}]"
    if not isinstance(raw, Mapping):
        raise ScenarioError(f"{where} must be a mapping")
    known = {"id", "at", "type", "source", "notice", "duration", "run_for", "cancel_after", "resources",
             "description", "resource_type"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ScenarioError(f"{where}: unknown field {unknown[0]!r}; valid: {', '.join(sorted(known))}")
    event_type = raw.get("type")
    if not isinstance(event_type, str) or not event_type:
        raise ScenarioError(f"{where}.type is required (Freeze, Reboot, Redeploy, Preempt or Terminate)")
    source = raw.get("source", "Platform")
    if source is not None and source not in EVENT_SOURCES:
        raise ScenarioError(f"{where}.source must be Platform or User, got {source!r}")
    duration = raw.get("duration", -1)
    if duration is not None and (isinstance(duration, bool) or not isinstance(duration, int)):
        raise ScenarioError(f"{where}.duration must be a whole number or null")
    resources = raw.get("resources", list(vms))
    if not isinstance(resources, list) or not all(isinstance(r, str) for r in resources):
        raise ScenarioError(f"{where}.resources must be a list of VM names")
    event_id = raw.get("id") or str(uuid.uuid5(_ID_NAMESPACE, f"{scenario}/{index}")).upper()
    return EventSpec(
        event_id=str(event_id),
        event_type=event_type,
        at=_number(raw.get("at", 0), f"{where}.at") or 0.0,
        notice=_number(raw.get("notice"), f"{where}.notice", allow_none=True),
        source=source,
        duration=duration,
        run_for=_number(raw.get("run_for", 600), f"{where}.run_for") or 0.0,
        cancel_after=_number(raw.get("cancel_after"), f"{where}.cancel_after", allow_none=True),
        resources=tuple(resources),
        description=str(raw.get("description", "")),
        resource_type=str(raw.get("resource_type", "VirtualMachine")),
    )


def _ends_at(spec: EventSpec) -> float:
    """Scenario time at which an unapproved event has surely left the document."""
    if spec.cancel_after is not None and (spec.notice is None or spec.cancel_after <= spec.notice):
        return spec.at + spec.cancel_after
    return spec.at + (spec.notice or 0.0) + spec.run_for


def parse_scenario(raw: Any, default_name: str = "custom") -> Scenario:
    if not isinstance(raw, Mapping):
        raise ScenarioError("a scenario must be a mapping with an 'events' list")
    name = str(raw.get("name", default_name))
    vm_name = str(raw.get("vm_name", "vm-0"))
    vms_raw = raw.get("vms", [vm_name])
    if not isinstance(vms_raw, list) or not all(isinstance(v, str) for v in vms_raw):
        raise ScenarioError("vms must be a list of VM names")
    events_raw = raw.get("events", [])
    if not isinstance(events_raw, list):
        raise ScenarioError("events must be a list")
    vms = tuple(vms_raw)
    loop = _number(raw.get("loop"), "loop", allow_none=True)
    events = tuple(parse_event(item, i, name, vms) for i, item in enumerate(events_raw))
    if loop is not None:
        longest = max((_ends_at(e) for e in events), default=0.0)
        if loop < longest:
            raise ScenarioError(f"loop ({loop:g} s) must be at least as long as the longest event ({longest:g} s)")
    return Scenario(name=name, vm_name=vm_name, vms=vms, events=events, loop=loop,
                    summary=str(raw.get("summary", "")))


_MIGRATION = "Virtual machine is being paused because of a memory-preserving Live Migration operation."
_HOST_REBOOT = "Virtual machine is going to be restarted as requested by authorized user."
_REDEPLOY = "Virtual machine is going to be redeployed as requested by authorized user."
_DEGRADED = "Virtual machine is scheduled to be redeployed because the host it runs on shows degraded hardware."
_FAILED_HOST = "Virtual machine is being moved to another host because its host failed."

_BUILTIN: dict[str, dict[str, Any]] = {
    "live-migration": {
        "summary": "The documented sequence: one Freeze for two VMs, Scheduled, Started, gone.",
        "vm_name": "WestNO_0", "vms": ["WestNO_0", "WestNO_1"],
        "events": [{"at": 2, "type": "Freeze", "notice": 900, "duration": 5, "run_for": 15,
                    "description": _MIGRATION}],
    },
    "user-reboot": {
        "summary": "A restart asked for through the portal, API or CLI (source User, 15 min notice).",
        "events": [{"at": 2, "type": "Reboot", "source": "User", "notice": 900, "run_for": 300,
                    "description": _HOST_REBOOT}],
    },
    "user-redeploy": {
        "summary": "A redeploy asked for by the user (10 min notice).",
        "events": [{"at": 2, "type": "Redeploy", "source": "User", "notice": 600, "run_for": 600,
                    "description": _REDEPLOY}],
    },
    "platform-reboot": {
        "summary": "Planned host maintenance that restarts the VM, 15 min notice.",
        "events": [{"at": 2, "type": "Reboot", "notice": 900, "run_for": 600,
                    "description": "Host server is undergoing maintenance."}],
    },
    "spot-preempt": {
        "summary": "A Spot VM evicted with 30 s notice (no DurationInSeconds, as in the docs' sample).",
        "events": [{"at": 2, "type": "Preempt", "notice": 30, "duration": None, "run_for": 60,
                    "description": "Spot virtual machine is being evicted."}],
    },
    "terminate": {
        "summary": "A scale-set instance being deleted (terminate notification, 5 min notice).",
        "vm_name": "vmss_3", "vms": ["vmss_3"],
        "events": [{"at": 2, "type": "Terminate", "source": "User", "notice": 300, "run_for": 120,
                    "description": "Virtual machine is being deleted."}],
    },
    "hardware-failure": {
        "summary": "An unplanned restart after a host failure: Started at once, Scheduled skipped.",
        "events": [{"at": 2, "type": "Reboot", "notice": None, "run_for": 600,
                    "description": "Virtual machine is being restarted because of a host failure."}],
    },
    "cancelled-maintenance": {
        "summary": "A reboot announced, then withdrawn by Azure while still Scheduled.",
        "events": [{"at": 2, "type": "Reboot", "notice": 900, "cancel_after": 120,
                    "description": "Host server is undergoing maintenance."}],
    },
    "degraded-hardware": {
        "summary": "A redeploy announced seven days ahead because the host is failing.",
        "events": [{"at": 2, "type": "Redeploy", "notice": 7 * 86400, "run_for": 600,
                    "description": _DEGRADED}],
    },
    "other-vm": {
        "summary": "An availability-set event for another VM: delivered here, affects only vm-1.",
        "vms": ["vm-0", "vm-1"],
        "events": [{"at": 2, "type": "Reboot", "notice": 900, "run_for": 600, "resources": ["vm-1"],
                    "description": "Host server is undergoing maintenance."}],
    },
    "hardware-redeploy": {
        "summary": "A host failure moves the VM to another node: Redeploy Started at once, Scheduled skipped.",
        "events": [{"at": 2, "type": "Redeploy", "notice": None, "run_for": 600, "description": _FAILED_HOST}],
    },
    "policy-auto-approved": {
        # IMDS.md: with auto-approval the event is already Started when it first appears.
        "summary": "A user restart, then a user redeploy, auto-approved by a Scheduled Events Policy: "
                   "each appears Started.",
        "events": [{"at": 2, "type": "Reboot", "source": "User", "notice": None, "run_for": 300,
                    "description": _HOST_REBOOT},
                   {"at": 360, "type": "Redeploy", "source": "User", "notice": None, "run_for": 300,
                    "description": _REDEPLOY}],
    },
    "reboot-becomes-freeze": {
        # The docs say only that a Reboot may turn out to be a freeze, not how the document shows it; this
        # models it as the Reboot leaving the document in the same incarnation as a new Freeze arrives,
        # which keeps the Reboot's NotBefore (42 + 860 = 2 + 900).
        "summary": "A Reboot withdrawn as a short Freeze (new EventId, same NotBefore) appears, in one "
                   "incarnation (modelled: the docs do not say how this shows).",
        "events": [{"at": 2, "type": "Reboot", "notice": 900, "cancel_after": 40,
                    "description": "Host server is undergoing maintenance."},
                   {"at": 42, "type": "Freeze", "notice": 860, "duration": 5, "run_for": 15,
                    "description": _MIGRATION}],
    },
    "terminate-long-notice": {
        "summary": "A scale-set instance being deleted with the longest terminate notification (15 min).",
        "vm_name": "vmss_3", "vms": ["vmss_3"],
        "events": [{"at": 2, "type": "Terminate", "source": "User", "notice": 900, "run_for": 120,
                    "description": "Virtual machine is being deleted."}],
    },
    "spot-short-notice": {
        # Appears 10 s in, so a collector started with the simulator is already polling: the point of
        # this drill is how soon a short notice is reported.
        "summary": "A Spot VM evicted with only 6 s notice (Preempt is best effort, often under 10 s).",
        "events": [{"at": 10, "type": "Preempt", "notice": 6, "duration": None, "run_for": 15,
                    "description": "Spot virtual machine is being evicted."}],
    },
    "scale-set-hosts": {
        # Hosts are maintained one after another (different fault domains), so the Started phases follow
        # each other; this VM (web_1) is on host A and also has a restart of its own asked for.
        "summary": "Events for three hosts of a scale set and a user restart in one document; two of the "
                   "four affect this VM (web_1).",
        "vm_name": "web_1", "vms": ["web_0", "web_1", "web_2", "web_3", "web_4", "web_5"],
        "events": [
            {"at": 2, "type": "Freeze", "notice": 900, "duration": 5, "run_for": 300,
             "resources": ["web_0", "web_1", "web_2"], "description": _MIGRATION},
            {"at": 2, "type": "Reboot", "notice": 1200, "run_for": 300, "resources": ["web_3", "web_4"],
             "description": "Host server is undergoing maintenance."},
            {"at": 2, "type": "Redeploy", "notice": 1500, "run_for": 300, "resources": ["web_5"],
             "description": _DEGRADED},
            {"at": 2, "type": "Reboot", "source": "User", "notice": 1800, "run_for": 300, "resources": ["web_1"],
             "description": _HOST_REBOOT},
        ],
    },
    "quiet": {"summary": "No events at all.", "events": []},
    "tour": {
        "summary": "One of each kind, overlapping, replayed every hour: the default for run --simulate.",
        "vms": ["vm-0", "vm-1"], "loop": 3600,
        "events": [
            {"at": 2, "type": "Freeze", "notice": 900, "duration": 5, "run_for": 15, "description": _MIGRATION},
            {"at": 20, "type": "Reboot", "source": "User", "notice": 900, "run_for": 300,
             "resources": ["vm-0"], "description": _HOST_REBOOT},
            {"at": 40, "type": "Reboot", "notice": 900, "cancel_after": 300, "resources": ["vm-1"],
             "description": "Host server is undergoing maintenance."},
            {"at": 60, "type": "Preempt", "notice": 30, "duration": None, "run_for": 60, "resources": ["vm-0"],
             "description": "Spot virtual machine is being evicted."},
            {"at": 120, "type": "Redeploy", "notice": 3 * 86400, "cancel_after": 1800, "resources": ["vm-0"],
             "description": _DEGRADED},
            {"at": 1200, "type": "Reboot", "notice": None, "run_for": 600, "resources": ["vm-0"],
             "description": "Virtual machine is being restarted because of a host failure."},
            {"at": 1300, "type": "Terminate", "source": "User", "notice": 300, "run_for": 120,
             "resources": ["vm-1"], "description": "Virtual machine is being deleted."},
        ],
    },
}

SCENARIOS: dict[str, Scenario] = {name: parse_scenario(raw, name) for name, raw in _BUILTIN.items()}


def load_scenario(name_or_path: str) -> Scenario:
    """A built-in scenario by name, or a scenario file (YAML or JSON) by path."""
    if name_or_path in SCENARIOS:
        return SCENARIOS[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ScenarioError(
            f"scenario {name_or_path!r} is neither a file nor a built-in name; built-in: {', '.join(SCENARIOS)}"
        )
    try:
        text = path.read_text(encoding="utf-8")
        raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ScenarioError(f"{path}: {exc}") from None
    try:
        return parse_scenario(raw, path.stem)
    except ScenarioError as exc:
        raise ScenarioError(f"{path}: {exc}") from None
