"""The simulated fleet's scenarios and timeline: which scheduled events exist, on which VMs, scale sets and
subscriptions, what status each has at a given moment, and how the central feeds show it.

Times are scenario seconds, `speed` times faster than real time, as in the per-VM simulator (timeline.py). An
event's statuses follow from the scenario and the acknowledgements received (`milestones`); the wire shapes
(a Resource Graph row, an Event Grid delivery) are built here, from the fields shared FLEET-FACTS.md lists
(sections 1 and 2), so that the stand-in (fleet_azure.py) and docs/fleet.md's samples send the same.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, NamedTuple

from forewarn.imds.document import format_not_before

EVENT_TYPE = "Microsoft.ResourceNotifications.MaintenanceResources.ScheduledEventEmitted"
#: What Event Grid's sample carries in data.apiVersion.
EVENT_GRID_API_VERSION = "2024-07-01"
#: Scenario seconds between an acknowledgement and the event starting (the per-VM simulator's START_DELAY).
START_DELAY = 2.0
#: Scenario seconds Resource Graph lists a change after it happened. Nothing documents its delay (the anecdotes
#: run from a minute to hours, shared FLEET-FACTS.md section 1): a minute here, so Event Grid's push brings
#: each change first and the snapshots confirm it, as fleet mode expects of the two feeds.
RESOURCE_GRAPH_LAG = 60.0
#: ... and at least this many wall seconds, however fast the scenario runs: a push takes milliseconds, so at any
#: --speed the push still comes first (at --speed 300 a scenario minute is 0.2 s, which a busy machine can lose).
RESOURCE_GRAPH_MIN_WALL_LAG = 2.0
_ID_NAMESPACE = uuid.UUID("6f1b2c3d-4e5f-4a6b-9c7d-8e9f0a1b2c3d")


def _guid(text: str) -> str:
    return str(uuid.uuid5(_ID_NAMESPACE, text))


# --- the scenarios -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """A VM, scale set or availability set the events are on."""

    subscription: str
    resource_group: str
    kind: str            # virtualMachines, virtualMachineScaleSets or availabilitySets
    name: str
    location: str = "westeurope"

    @property
    def arm_id(self) -> str:
        return (f"/subscriptions/{self.subscription}/resourceGroups/{self.resource_group}/providers/"
                f"Microsoft.Compute/{self.kind}/{self.name}")


@dataclass(frozen=True)
class FleetEventSpec:
    """One scheduled event of a scenario; times in scenario seconds from the start."""

    event_id: str
    target: Target
    event_type: str
    resources: tuple[str, ...]
    at: float
    notice: float | None        # from appearing to NotBefore; None: it appears Started
    run_for: float = 600.0      # from Started to Completed
    cancel_after: float | None = None   # Azure cancels it this long after it appeared, if still Scheduled
    source: str = "Platform"
    duration: int | None = -1   # DurationInSeconds; None leaves it out (as Spot evictions do)
    description: str = ""
    #: Event Grid delivers each of its statuses twice, with the same id (it may repeat a notification).
    delivered_twice: bool = False

    @property
    def arm_id(self) -> str:
        return f"{self.target.arm_id}/providers/Microsoft.Maintenance/scheduledevents/{self.event_id}"


@dataclass(frozen=True)
class FleetScenario:
    name: str
    summary: str
    events: tuple[FleetEventSpec, ...]

    @property
    def subscriptions(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(spec.target.subscription for spec in self.events))


def _tour() -> FleetScenario:
    web, batch, tools = _guid("sub/web"), _guid("sub/batch"), _guid("sub/tools")
    web_vmss = Target(web, "rg-web", "virtualMachineScaleSets", "web")
    db = Target(web, "rg-data", "virtualMachines", "db-0")
    spot = Target(batch, "rg-batch", "virtualMachineScaleSets", "spot", "northeurope")
    build = Target(tools, "rg-ci", "virtualMachines", "build-0")

    def event_id(index: int) -> str:
        return _guid(f"tour/{index}").upper()

    return FleetScenario("tour", "Three subscriptions: a scale-set Reboot (Scheduled, Started, Completed), a VM's "
                         "Redeploy that Azure cancels, a Spot eviction (Preempt) and a VM's short Freeze.", (
        FleetEventSpec(event_id(0), web_vmss, "Reboot", ("web_0", "web_1"), at=2, notice=900, run_for=600,
                       description="Host server is undergoing maintenance."),
        FleetEventSpec(event_id(1), db, "Redeploy", ("db-0",), at=5, notice=600, cancel_after=240,
                       description="Virtual machine is scheduled to be redeployed because the host it runs on "
                       "shows degraded hardware."),
        FleetEventSpec(event_id(2), spot, "Preempt", ("spot_3",), at=10, notice=30, run_for=60, duration=None,
                       description="Spot virtual machine is being evicted.", delivered_twice=True),
        FleetEventSpec(event_id(3), build, "Freeze", ("build-0",), at=20, notice=900, run_for=15, duration=5,
                       description="Virtual machine is being paused because of a memory-preserving Live "
                       "Migration operation."),
    ))


def _spot() -> FleetScenario:
    spot = Target(_guid("sub/batch"), "rg-batch", "virtualMachineScaleSets", "spot", "northeurope")
    return FleetScenario("spot-eviction", "One Spot eviction of two scale-set instances: 30 s notice, then "
                         "gone.", (
        FleetEventSpec(_guid("spot-eviction/0").upper(), spot, "Preempt", ("spot_0", "spot_1"), at=2, notice=30,
                       run_for=60, duration=None, description="Spot virtual machine is being evicted."),
    ))


FLEET_SCENARIOS: dict[str, FleetScenario] = {scenario.name: scenario for scenario in (_tour(), _spot())}


def fleet_scenario(name: str) -> FleetScenario:
    """A built-in fleet scenario; ValueError naming the built-in ones otherwise."""
    try:
        return FLEET_SCENARIOS[name]
    except KeyError:
        raise ValueError(f"--simulate {name!r}: no such fleet scenario; built-in: {', '.join(FLEET_SCENARIOS)} "
                         "(forewarn fleet --list)") from None


# --- the timeline --------------------------------------------------------------------------------------------

class Milestone(NamedTuple):
    at: float       # scenario seconds
    status: str     # Scheduled, Started, Completed or Canceled


def milestones(spec: FleetEventSpec, approved_at: float | None) -> list[Milestone]:
    """Every status the event goes through and when, given when it was approved (None: not approved)."""
    if spec.notice is None:
        return [Milestone(spec.at, "Started"), Milestone(spec.at + spec.run_for, "Completed")]
    started = spec.at + spec.notice
    if approved_at is not None:
        started = min(started, approved_at + START_DELAY)
    if spec.cancel_after is not None and spec.at + spec.cancel_after < started:
        return [Milestone(spec.at, "Scheduled"), Milestone(spec.at + spec.cancel_after, "Canceled")]
    return [Milestone(spec.at, "Scheduled"), Milestone(started, "Started"),
            Milestone(started + spec.run_for, "Completed")]


class FleetTimeline:
    """The scenario's events at each moment, and the acknowledgements received; thread-safe."""

    def __init__(self, scenario: FleetScenario, speed: float = 1.0, clock: Callable[[], float] = time.time) -> None:
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.scenario = scenario
        self.speed = speed
        self.clock = clock
        self.started_wall = clock()
        self._lock = threading.Lock()
        self._approved: dict[str, float] = {}
        #: Every acknowledgement: scenario time, target, event ids, the form ("single" or "list").
        self.acknowledgements: list[dict[str, Any]] = []
        self._specs = {spec.event_id.lower(): spec for spec in scenario.events}

    def now(self) -> float:
        return (self.clock() - self.started_wall) * self.speed

    def wall(self, scenario_seconds: float) -> datetime:
        return datetime.fromtimestamp(self.started_wall + scenario_seconds / self.speed, tz=timezone.utc)

    def milestones(self, spec: FleetEventSpec) -> list[Milestone]:
        with self._lock:
            return milestones(spec, self._approved.get(spec.event_id))

    def status(self, spec: FleetEventSpec, now: float) -> Milestone | None:
        """The event's status at `now` and since when; None before it appears."""
        passed = [step for step in self.milestones(spec) if step.at <= now]
        return passed[-1] if passed else None

    def properties(self, spec: FleetEventSpec, status: str) -> dict[str, Any]:
        """The PascalCase event fields both feeds carry; NotBefore is empty once the event has Started."""
        not_before = format_not_before(self.wall(spec.at + spec.notice)) \
            if status == "Scheduled" and spec.notice is not None else ""
        fields: dict[str, Any] = {
            "EventId": spec.event_id, "EventType": spec.event_type, "ResourceType": "VirtualMachine",
            "Resources": list(spec.resources), "EventStatus": status, "NotBefore": not_before,
            "Description": spec.description, "EventSource": spec.source,
        }
        if spec.duration is not None:
            fields["DurationInSeconds"] = spec.duration
        return fields

    def resource_info(self, spec: FleetEventSpec, status: str) -> dict[str, Any]:
        return {"id": spec.arm_id, "name": spec.event_id, "type": "Microsoft.Maintenance/scheduledevents",
                "location": spec.target.location, "properties": self.properties(spec, status)}

    def row(self, spec: FleetEventSpec, status: str) -> dict[str, Any]:
        """A Resource Graph row as forewarn's query projects it (`project id, name, subscriptionId,
        resourceGroup, location, properties`); Resource Graph writes the resource group in lower case."""
        return {"id": spec.arm_id, "name": spec.event_id, "subscriptionId": spec.target.subscription,
                "resourceGroup": spec.target.resource_group.lower(), "location": spec.target.location,
                "properties": self.properties(spec, status)}

    def begin(self) -> None:
        """Scenario time 0 is now: fleet mode listens (the pushes would otherwise start before its route)."""
        with self._lock:
            self.started_wall = self.clock()

    def rows(self, subscriptions: Sequence[str], statuses: Sequence[str] | None) -> list[dict[str, Any]]:
        """The rows Resource Graph lists now in `subscriptions`, with one of `statuses` (None: any), by id:
        each event as it was RESOURCE_GRAPH_LAG scenario seconds ago (RESOURCE_GRAPH_MIN_WALL_LAG at least)."""
        now = self.now() - max(RESOURCE_GRAPH_LAG, RESOURCE_GRAPH_MIN_WALL_LAG * self.speed)
        wanted = {sub.lower() for sub in subscriptions}
        allowed = None if statuses is None else {status.lower() for status in statuses}
        rows = []
        for spec in self.scenario.events:
            current = self.status(spec, now)
            if current is None or spec.target.subscription.lower() not in wanted:
                continue
            if allowed is None or current.status.lower() in allowed:
                rows.append(self.row(spec, current.status))
        return sorted(rows, key=lambda row: row["id"])

    def event_grid_event(self, spec: FleetEventSpec, step: Milestone) -> dict[str, Any]:
        """The Event Grid delivery of one status; its id is the same on every delivery of that news (Event
        Grid's repeats share it)."""
        moment = self.wall(step.at)
        when = moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond:06d}0Z"
        return {
            "id": _guid(f"{spec.event_id}/{step.status}"), "topic": f"/subscriptions/{spec.target.subscription}",
            "subject": spec.arm_id, "eventType": EVENT_TYPE, "eventTime": when, "dataVersion": "3.0",
            "metadataVersion": "1",
            "data": {"resourceInfo": self.resource_info(spec, step.status), "apiVersion": EVENT_GRID_API_VERSION,
                     "operationalInfo": {"resourceEventTime": when}},
        }

    def acknowledge(self, target: str, event_ids: Sequence[str], form: str) -> list[str]:
        """Approve events of `target` (an ARM ID, compared without regard to case): the ids that are not a
        Scheduled event of that target now (none approved then)."""
        now = self.now()
        unknown = []
        for event_id in event_ids:
            spec = self._specs.get(event_id.lower())
            current = self.status(spec, now) if spec is not None else None
            if spec is None or current is None or current.status != "Scheduled" or \
                    spec.target.arm_id.lower() != target.lower():
                unknown.append(event_id)
        if unknown:
            return unknown
        with self._lock:
            for event_id in event_ids:
                self._approved.setdefault(self._specs[event_id.lower()].event_id, now)
            self.acknowledgements.append({"at": now, "target": target, "event_ids": list(event_ids), "form": form})
        return []

    def state(self) -> dict[str, Any]:
        now = self.now()
        events = []
        for spec in self.scenario.events:
            current = self.status(spec, now)
            events.append({"EventId": spec.event_id, "target": spec.target.arm_id, "EventType": spec.event_type,
                           "status": current.status if current else None,
                           "milestones": [step._asdict() for step in self.milestones(spec)]})
        with self._lock:
            acknowledgements = list(self.acknowledgements)
        return {"scenario": self.scenario.name, "speed": self.speed, "scenario_time": now, "events": events,
                "acknowledgements": acknowledgements}
