"""The simulated IMDS: which events exist at a given moment, and how requests are answered.

The document is a function of the scenario, the elapsed time and the approvals received, evaluated
when asked; the incarnation rises whenever the event list differs from the last one served, as IMDS's
does. `transitions` keeps every change with its scenario time, so tests and the soak benchmark can
compare what happened with what the collector reported.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from forewarn.imds.document import API_VERSIONS, field_in_version, format_not_before, type_in_version
from forewarn.simulator.scenarios import EventSpec, Scenario, parse_event

#: Scenario seconds between an approval and the event starting (IMDS starts approved events promptly,
#: but they may wait briefly for other tenants on the host).
START_DELAY = 2.0
FAULT_KINDS = ("500", "503", "429", "410", "404", "reset", "malformed", "timeout")


@dataclass
class Faults:
    """What goes wrong, and how often. `queue` fails the next requests in order, for exact tests."""

    rates: dict[str, float] = field(default_factory=dict)
    latency: float = 0.0
    slow_first: float = 0.0
    queue: collections.deque[str] = field(default_factory=collections.deque)
    post_queue: collections.deque[str] = field(default_factory=collections.deque)
    seed: int | None = None

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def draw(self, post: bool = False) -> str | None:
        if post and self.post_queue:
            return self.post_queue.popleft()
        if self.queue:
            return self.queue.popleft()
        for kind, rate in self.rates.items():
            if rate > 0 and self._rng.random() < rate:
                return kind
        return None


def parse_fault(spec: str, faults: Faults) -> None:
    """Apply one `--fault` spec: `KIND:RATE` (500:0.1), `latency:SECONDS`, `slow-first:SECONDS`."""
    kind, _, value = spec.partition(":")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"--fault {spec!r}: expected KIND:NUMBER, e.g. 500:0.1 or latency:0.2") from None
    if kind == "latency":
        faults.latency = number
    elif kind == "slow-first":
        faults.slow_first = number
    elif kind in FAULT_KINDS:
        if not 0 <= number <= 1:
            raise ValueError(f"--fault {spec!r}: a rate is between 0 and 1")
        faults.rates[kind] = number
    else:
        raise ValueError(f"--fault {spec!r}: unknown kind; valid: {', '.join(FAULT_KINDS)}, latency, slow-first")


@dataclass(frozen=True)
class Transition:
    at: float              # scenario seconds
    event_id: str
    status: str            # Scheduled, Started or "" (left the document)
    event_type: str


@dataclass
class _Live:
    """One event instance of the timeline (a looping scenario makes one per round)."""

    spec: EventSpec
    at: float
    approved_at: float | None = None
    removed_at: float | None = None   # set by an admin removal

    def started_at(self) -> float | None:
        if self.spec.notice is None:
            return self.at
        start = self.at + self.spec.notice
        if self.approved_at is not None:
            start = min(start, self.approved_at + START_DELAY)
        return start

    def status(self, now: float) -> str | None:
        if now < self.at:
            return None
        if self.removed_at is not None and now >= self.removed_at:
            return None
        started = self.started_at()
        cancel = self.at + self.spec.cancel_after if self.spec.cancel_after is not None else None
        if cancel is not None and (started is None or cancel <= started):
            return "Scheduled" if now < cancel else None
        if started is not None and now >= started:
            return "Started" if now < started + self.spec.run_for else None
        return "Scheduled"


class Simulator:
    """The state behind the simulated IMDS; thread-safe."""

    def __init__(self, scenario: Scenario, speed: float = 1.0, faults: Faults | None = None,
                 clock: Callable[[], float] = time.time, rate_limit: int | None = 5) -> None:
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.scenario = scenario
        self.speed = speed
        self.faults = faults or Faults()
        self.clock = clock
        self.rate_limit = rate_limit
        self.started_wall = clock()
        self._lock = threading.RLock()
        self._injected: list[_Live] = []
        self._rounds: dict[int, list[_Live]] = {}
        self._approvals: dict[str, float] = {}
        self._incarnation = 1
        self._last_key: tuple[tuple[str, str], ...] = ()
        self._last_status: dict[str, tuple[str, str]] = {}
        self.transitions: list[Transition] = []
        self.approval_posts: list[dict[str, Any]] = []
        self.requests: collections.Counter[str] = collections.Counter()
        self.rate_violations = 0
        self._recent: collections.deque[float] = collections.deque()
        self.request_times: dict[str, collections.deque[float]] = {}
        self._first_served = False

    # --- time ---------------------------------------------------------------------------------
    def now(self) -> float:
        """Scenario seconds since the start."""
        return (self.clock() - self.started_wall) * self.speed

    def wall(self, scenario_seconds: float) -> datetime:
        return datetime.fromtimestamp(self.started_wall + scenario_seconds / self.speed, tz=timezone.utc)

    # --- the timeline -------------------------------------------------------------------------
    def _round(self, k: int) -> list[_Live]:
        if k not in self._rounds:
            offset = k * (self.scenario.loop or 0.0)
            lives = []
            for spec in self.scenario.events:
                if k:
                    new_id = str(uuid.uuid5(uuid.NAMESPACE_OID, f"{spec.event_id}/{k}")).upper()
                    spec = dataclasses.replace(spec, event_id=new_id)
                lives.append(_Live(spec, at=spec.at + offset))
            self._rounds[k] = lives
        return self._rounds[k]

    def _lives(self, now: float) -> list[_Live]:
        lives: list[_Live] = []
        if self.scenario.loop:
            k = int(now // self.scenario.loop)
            for r in (k - 1, k):
                if r >= 0:
                    lives.extend(self._round(r))
            for old in [r for r in self._rounds if r < k - 1]:
                del self._rounds[old]
        else:
            lives.extend(self._round(0))
        return lives + self._injected

    def _event(self, live: _Live, status: str) -> dict[str, Any]:
        spec = live.spec
        not_before = ""
        if status == "Scheduled":
            start = live.at + spec.notice if spec.notice is not None else live.at
            not_before = format_not_before(self.wall(start))
        event: dict[str, Any] = {
            "EventId": spec.event_id,
            "EventType": spec.event_type,
            "ResourceType": spec.resource_type,
            "Resources": list(spec.resources),
            "EventStatus": status,
            "NotBefore": not_before,
            "Description": spec.description,
            "EventSource": spec.source,
        }
        if spec.source is None:
            del event["EventSource"]
        if spec.duration is not None:
            event["DurationInSeconds"] = spec.duration
        return event

    def current(self) -> tuple[int, list[dict[str, Any]]]:
        """The incarnation and events at this moment, in the newest format."""
        with self._lock:
            now = self.now()
            events = []
            for live in self._lives(now):
                if live.spec.event_id in self._approvals and live.approved_at is None:
                    live.approved_at = self._approvals[live.spec.event_id]
                status = live.status(now)
                if status is not None:
                    events.append(self._event(live, status))
            key = tuple((e["EventId"], e["EventStatus"]) for e in events)
            if key != self._last_key:
                self._incarnation += 1
                self._record_transitions(now, events)
                self._last_key = key
            return self._incarnation, events

    def _record_transitions(self, now: float, events: list[dict[str, Any]]) -> None:
        seen = {e["EventId"]: (e["EventStatus"], e["EventType"]) for e in events}
        for event_id, (status, event_type) in seen.items():
            if self._last_status.get(event_id, ("", ""))[0] != status:
                self.transitions.append(Transition(now, event_id, status, event_type))
        for event_id, (_, event_type) in self._last_status.items():
            if event_id not in seen:
                self.transitions.append(Transition(now, event_id, "", event_type))
        self._last_status = seen

    def document(self, api_version: str) -> dict[str, Any]:
        """The document as IMDS of `api_version` would send it: older versions lack newer fields."""
        incarnation, events = self.current()
        shaped = []
        for event in events:
            if not type_in_version(event["EventType"], api_version):
                continue
            event = {k: v for k, v in event.items() if field_in_version(k, api_version)}
            if api_version < "2017-08-01":
                # The first preview prefixed IaaS resource names with an underscore.
                event["Resources"] = [f"_{name}" for name in event["Resources"]]
            shaped.append(event)
        return {"DocumentIncarnation": incarnation, "Events": shaped}

    def compute(self) -> dict[str, Any]:
        name = self.scenario.vm_name
        vm_id = str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{name}.forewarn.invalid"))
        scale_set = name.rsplit("_", 1)[0] if "_" in name else ""
        rg = "forewarn-sim"
        sub = "00000000-0000-0000-0000-000000000000"
        kind = f"virtualMachineScaleSets/{scale_set}/virtualMachines/{name.rsplit('_', 1)[1]}" if scale_set else \
            f"virtualMachines/{name}"
        return {
            "name": name, "vmId": vm_id, "location": "westeurope", "zone": "1", "subscriptionId": sub,
            "resourceGroupName": rg, "vmScaleSetName": scale_set, "vmSize": "Standard_D2s_v5",
            "priority": "Spot" if any(e.event_type == "Preempt" for e in self.scenario.events) else "Regular",
            "osType": "Linux",
            "resourceId": f"/subscriptions/{sub}/resourceGroups/{rg}/providers/Microsoft.Compute/{kind}",
        }

    # --- changes from outside -----------------------------------------------------------------
    def approve(self, event_ids: Sequence[str], caller: str = "") -> None:
        with self._lock:
            now = self.now()
            self.approval_posts.append({"at": now, "event_ids": list(event_ids), "caller": caller})
            for event_id in event_ids:
                self._approvals.setdefault(event_id, now)

    def inject(self, raw: Mapping[str, Any]) -> str:
        """Add an event now (or `at` seconds from now); same fields as a scenario file's events."""
        with self._lock:
            now = self.now()
            index = len(self._injected)
            fields = dict(raw)
            offset = float(fields.pop("at", 0))
            fields.setdefault("id", str(uuid.uuid4()).upper())
            spec = parse_event(fields, index, "injected", self.scenario.vms or (self.scenario.vm_name,))
            self._injected.append(_Live(spec, at=now + offset))
            return spec.event_id

    def remove(self, event_id: str) -> bool:
        with self._lock:
            now = self.now()
            for live in self._lives(now):
                if live.spec.event_id == event_id and live.status(now) is not None:
                    live.removed_at = now
                    return True
            return False

    def over_rate(self, caller: str = "") -> bool:
        """Count a request against the 5-per-second budget; True when it exceeds it (IMDS says 429)."""
        with self._lock:
            wall = self.clock()
            self.request_times.setdefault(caller, collections.deque(maxlen=1_000_000)).append(wall)
            if self.rate_limit is None:
                return False
            while self._recent and self._recent[0] <= wall - 1.0:
                self._recent.popleft()
            if len(self._recent) >= self.rate_limit:
                self.rate_violations += 1
                return True
            self._recent.append(wall)
            return False

    def max_rate(self, caller_prefix: str) -> int:
        """The most requests that callers whose User-Agent starts with `caller_prefix` made in any 1 s."""
        with self._lock:
            times = sorted(t for caller, stamps in self.request_times.items() if caller.startswith(caller_prefix)
                           for t in stamps)
        best, low = 0, 0
        for high, stamp in enumerate(times):
            while stamp - times[low] >= 1.0:
                low += 1
            best = max(best, high - low + 1)
        return best

    def first_request(self) -> bool:
        with self._lock:
            first = not self._first_served
            self._first_served = True
            return first

    def state(self) -> dict[str, Any]:
        with self._lock:
            incarnation, events = self.current()
            return {
                "scenario": self.scenario.name, "speed": self.speed, "scenario_time": self.now(),
                "incarnation": incarnation, "events": events,
                "approvals": list(self.approval_posts), "requests": dict(self.requests),
                "rate_violations": self.rate_violations,
                "transitions": [dataclasses.asdict(t) for t in self.transitions],
                "api_versions": list(API_VERSIONS),
            }
