"""A simulated fleet for `forewarn fleet --simulate`: Azure's central Scheduled Events feeds, on loopback.

Fleet mode reads what Azure publishes centrally (docs/fleet.md): Resource Graph rows, Event Grid deliveries,
and it approves through the Maintenance resource provider's acknowledge call. This module plays Azure's part
for a built-in scenario, so that every part of fleet mode runs as it does against Azure:

- **Resource Graph and ARM** (`FleetStandIn`): `POST /providers/Microsoft.ResourceGraph/resources` answers
  the rows of the scenario's events in the subscriptions asked for, a minute behind (RESOURCE_GRAPH_LAG),
  paged as Resource Graph pages (`$top`, `$skipToken`), and
  `POST {target}/providers/Microsoft.Maintenance/scheduledevents[/{id}/acknowledge]` approves an event, which
  then starts START_DELAY scenario seconds later, as Azure starts an approved event early. Both check the
  bearer token, the api-version and the body, and refuse what ARM would refuse. The clients are fleet mode's
  own (forewarn.fleet.resourcegraph, forewarn.fleet.acknowledge), with their token cache.
- **Event Grid** (`EventGridPusher`): every status an event goes through (Scheduled, Started, Completed,
  Canceled) is delivered in the Event Grid schema to forewarn's own push route (`--eventgrid-path`, with its
  shared secret in the URL as a real subscription carries it), after the subscription validation handshake
  Event Grid makes first. A delivery that is not answered 200 is sent again later, as Event Grid retries; an
  event marked `delivered_twice` has each status delivered twice under one id, as Event Grid may repeat one.

Choices, and why:
- **The credential** is `SimulatedCredential`: azure-core's `get_token` shape, giving the stand-in's token (made
  at random at start) for the stand-in's scope and nothing else. azure-identity is not needed, so the
  simulator runs on the core install; the token still goes through fleet mode's token cache (`Tokens`).
- **Plain HTTP on loopback** for ARM: the stand-in listens on 127.0.0.1 only and its token is worthless
  elsewhere, so TLS would protect nothing, while making a certificate at start needs `cryptography`, which the
  core install lacks. The https-only rule stays for every endpoint a user gives (`--arm-endpoint`); only this
  module passes `loopback_http`, which allows a loopback IP address and nothing else.
- **Push, not the queue**: a Storage queue would need a queue service stand-in (Azurite's part) and
  azure-storage-queue; the push route is forewarn's own web server, with the same boundary (`parse_event_grid`)
  and the same committer as the queue.

The timeline is in scenario seconds, `--speed` times faster than real time, as in the per-VM simulator.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import re
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import quote, urlsplit

from forewarn.config import ConfigError, FleetSettings, option_key
from forewarn.imds.document import format_not_before
from forewarn.web.server import HttpServer, Request, Response

if TYPE_CHECKING:
    import tempfile

log = logging.getLogger(__name__)

RESOURCES_PATH = "/providers/Microsoft.ResourceGraph/resources"
#: Resource Graph api-versions the stand-in answers (shared FLEET-FACTS.md, section 1a).
RESOURCE_GRAPH_VERSIONS = ("2021-03-01", "2022-10-01", "2024-04-01")
#: The Maintenance RP's api-versions with the acknowledge call, and those with its list form (section 3).
ACKNOWLEDGE_VERSIONS = ("2023-10-01-preview", "2025-10-01-preview", "2026-02-01-preview")
LIST_FORM_VERSIONS = ("2025-10-01-preview", "2026-02-01-preview")
EVENT_TYPE = "Microsoft.ResourceNotifications.MaintenanceResources.ScheduledEventEmitted"
VALIDATION_EVENT = "Microsoft.EventGrid.SubscriptionValidationEvent"
#: What Event Grid's sample carries in data.apiVersion.
EVENT_GRID_API_VERSION = "2024-07-01"
TENANT = "72f988bf-0000-4000-8000-00000000f1ee"
#: Scenario seconds between an acknowledgement and the event starting (the per-VM simulator's START_DELAY).
START_DELAY = 2.0
#: Scenario seconds Resource Graph lists a change after it happened. Nothing documents its delay (the anecdotes
#: run from a minute to hours, shared FLEET-FACTS.md section 1): a minute here, so Event Grid's push brings
#: each change first and the snapshots confirm it, as fleet mode expects of the two feeds.
RESOURCE_GRAPH_LAG = 60.0
#: How often (wall seconds) the pusher looks for news, and its longest wait between retries of a delivery.
PUSH_TICK = 0.05
PUSH_MAX_BACKOFF = 5.0
PUSH_TIMEOUT = 10.0
TOKEN_SECONDS = 3600
MAX_BODY_BYTES = 64 * 1024
_ACK_PATH = re.compile(
    r"(?P<target>/subscriptions/[^/]+/resourceGroups/[^/]+/providers/Microsoft\.Compute/"
    r"(?:virtualMachines|virtualMachineScaleSets|availabilitySets)/[^/]+)"
    r"/providers/Microsoft\.Maintenance/scheduledevents(?:/(?P<event>[^/]+)/acknowledge)?", re.IGNORECASE)
#: The status filter of forewarn's query (resourcegraph.scheduled_events_query), the one KQL clause read here.
_STATUS_FILTER = re.compile(r'tostring\(properties\.EventStatus\)\s+in~\s*\(([^)]*)\)')
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
        each event as it was RESOURCE_GRAPH_LAG scenario seconds ago."""
        now = self.now() - RESOURCE_GRAPH_LAG
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


# --- the credential ------------------------------------------------------------------------------------------

class AccessToken(NamedTuple):
    """azure-core's AccessToken shape: the token and when it expires (seconds since the epoch)."""

    token: str
    expires_on: int


class SimulatedCredential:
    """A TokenCredential (azure-core's `get_token`) that gives the stand-in's token for its scope only."""

    def __init__(self, token: str, scope: str) -> None:
        self._token = token
        self.scope = scope
        self.issued = 0

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        if list(scopes) != [self.scope]:
            raise ValueError(f"the simulated fleet gives tokens for {self.scope} only, not {list(scopes)}")
        self.issued += 1
        return AccessToken(self._token, int(time.time()) + TOKEN_SECONDS)


# --- Resource Graph and ARM ----------------------------------------------------------------------------------

def _json(status: int, value: Any) -> Response:
    return Response(status, json.dumps(value).encode(), "application/json; charset=utf-8",
                    {"x-ms-request-id": str(uuid.uuid4())})


def _refuse(status: int, code: str, message: str) -> Response:
    """ARM's error shape: {"error": {"code", "message"}}."""
    return _json(status, {"error": {"code": code, "message": message}})


def _server_error(status: int) -> Response:
    return _refuse(status, "NotFound" if status == 404 else "BadRequest", f"HTTP {status}")


class FleetStandIn:
    """Resource Graph's query route and the Maintenance RP's acknowledge routes for a FleetTimeline, on
    loopback; `/admin/state` (not part of ARM) shows the timeline, the acknowledgements, the queries answered
    and the requests refused, each with ARM's error."""

    def __init__(self, timeline: FleetTimeline, token: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.timeline = timeline
        self._token = token
        self.queries = 0
        self.refusals: list[str] = []
        self.http = HttpServer(host, port, read_timeout=30.0, max_connections=16, max_body_bytes=MAX_BODY_BYTES,
                               name="fleet-simulator", server_version="forewarn-fleet-simulator", error=_server_error)
        self.http.route(RESOURCES_PATH, self._query, methods=("POST",))
        self.http.route("/subscriptions/", self._acknowledge, methods=("POST",), prefix=True)
        self.http.route("/admin/state", lambda request: _json(200, self.state()), methods=("GET",))

    @property
    def url(self) -> str:
        return self.http.url

    def start(self) -> FleetStandIn:
        self.http.start()
        return self

    def stop(self) -> None:
        self.http.stop()

    def state(self) -> dict[str, Any]:
        """The timeline, the acknowledgements, the queries answered and every request refused (with why)."""
        return {**self.timeline.state(), "queries": self.queries, "refusals": list(self.refusals)}

    def _checked(self, request: Request, versions: Sequence[str]) -> Response | None:
        """401 without the token, 400 for an api-version ARM does not know; None when both are right."""
        scheme, _, token = (request.headers.get("Authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), self._token):
            return self._refused(_refuse(401, "AuthenticationFailed", "missing or invalid bearer token"))
        version = request.query("api-version") or ""
        if version not in versions:
            return self._refused(_refuse(400, "InvalidApiVersionParameter",
                                         f"api-version {version!r} is not one of {', '.join(versions)}"))
        return None

    def _refused(self, response: Response) -> Response:
        self.refusals.append(response.body.decode() if isinstance(response.body, bytes) else str(response.status))
        return response

    def _query(self, request: Request) -> Response:
        refused = self._checked(request, RESOURCE_GRAPH_VERSIONS)
        if refused is not None:
            return refused
        try:
            body = json.loads(request.body)
        except ValueError:
            body = None
        problem = _query_problem(body)
        if problem:
            return self._refused(_refuse(400, "BadRequest", problem))
        assert isinstance(body, dict)
        self.queries += 1
        options = body.get("options") or {}
        top = int(options.get("$top", 1000))
        skip = int(options.get("$skipToken") or options.get("$skip") or 0)
        match = _STATUS_FILTER.search(body["query"])
        statuses = re.findall(r'"([A-Za-z]+)"', match.group(1)) if match else None
        rows = self.timeline.rows(body["subscriptions"], statuses)
        page = rows[skip:skip + top]
        reply: dict[str, Any] = {"totalRecords": len(rows), "count": len(page),
                                 "resultTruncated": "true" if skip + top < len(rows) else "false", "data": page}
        if skip + top < len(rows):
            reply["$skipToken"] = str(skip + top)
        return _json(200, reply)

    def _acknowledge(self, request: Request) -> Response:
        refused = self._checked(request, ACKNOWLEDGE_VERSIONS)
        if refused is not None:
            return refused
        found = _ACK_PATH.fullmatch(request.path)
        if found is None:
            return self._refused(_refuse(404, "NotFound", f"no such route: {request.path}"))
        if found.group("event"):
            if request.body:
                return self._refused(_refuse(400, "BadRequest", "the acknowledge call takes no body"))
            event_ids, form = [found.group("event")], "single"
        else:
            if request.query("api-version") not in LIST_FORM_VERSIONS:
                return self._refused(_refuse(400, "BadRequest", "the list form needs api-version "
                                             + " or ".join(LIST_FORM_VERSIONS)))
            try:
                value = json.loads(request.body).get("value")
            except (ValueError, AttributeError):
                value = None
            if not isinstance(value, list) or not value or not all(isinstance(i, str) and i for i in value):
                return self._refused(_refuse(400, "BadRequest", 'the list form takes {"value": [EventId, ...]}'))
            event_ids, form = value, "list"
        unknown = self.timeline.acknowledge(found.group("target"), event_ids, form)
        if unknown:
            return self._refused(_refuse(404, "NotFound", f"no Scheduled event {', '.join(unknown)} on "
                                         f"{found.group('target')}"))
        log.info("fleet simulator: acknowledged %s on %s", ", ".join(event_ids), found.group("target"))
        return _json(200, {"value": "Successfully Approved"})


def _query_problem(body: Any) -> str:
    """What makes a query body one Resource Graph would refuse ('' when none)."""
    if not isinstance(body, dict):
        return "the body must be a JSON object {subscriptions, query, options}"
    unknown = set(body) - {"subscriptions", "managementGroups", "query", "options", "facets"}
    if unknown:
        return f"unknown field {sorted(unknown)[0]!r}"
    subscriptions = body.get("subscriptions")
    if not isinstance(subscriptions, list) or not subscriptions or not all(isinstance(s, str) for s in subscriptions):
        return "subscriptions must be a non-empty list (the simulated fleet has no management groups)"
    query = body.get("query")
    if not isinstance(query, str) or not query.lstrip().startswith("maintenanceresources"):
        return "the query must read maintenanceresources (the simulated fleet holds scheduled events only)"
    options = body.get("options") or {}
    if not isinstance(options, dict) or options.get("resultFormat", "objectArray") != "objectArray":
        return "options.resultFormat must be objectArray (the only format served here)"
    top, skip = options.get("$top", 1000), options.get("$skipToken") or options.get("$skip") or 0
    if isinstance(top, bool) or not isinstance(top, int) or not 1 <= top <= 1000:
        return "options.$top must be 1 to 1000"
    if not (isinstance(skip, int) or (isinstance(skip, str) and skip.isdigit())):
        return "options.$skipToken is not one this service gave"
    return ""


# --- Event Grid ----------------------------------------------------------------------------------------------

class EventGridPusher:
    """Delivers every status of every event to a push endpoint, in order, as Event Grid does: first the
    subscription validation handshake, then one event per request, each sent again until it is answered 200."""

    def __init__(self, timeline: FleetTimeline, url: str, secret: str) -> None:
        parts = urlsplit(url)
        self.timeline = timeline
        self.https = parts.scheme == "https"
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or (443 if self.https else 80)
        self.target = f"{parts.path}?code={quote(secret, safe='')}"
        self.path = parts.path
        self.delivered: set[tuple[str, str]] = set()
        self.answers: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-simulator-eventgrid", daemon=True)

    def start(self) -> EventGridPusher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(PUSH_TIMEOUT + 1)

    def _post(self, value: Any) -> tuple[int, bytes]:
        """One request; (0, b"") when there was no answer."""
        if self.https:
            import ssl

            # forewarn's own server on loopback with its own certificate (--web.config.file): Event Grid
            # checks it, this stand-in has no way to; what it proves here is the route, not the certificate.
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(self.host, self.port,
                                                                            timeout=PUSH_TIMEOUT, context=context)
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=PUSH_TIMEOUT)
        try:
            conn.request("POST", self.target, body=json.dumps(value).encode(),
                         headers={"Content-Type": "application/json", "aeg-event-type": "Notification"})
            response = conn.getresponse()
            return response.status, response.read(MAX_BODY_BYTES)
        except (OSError, http.client.HTTPException):
            return 0, b""
        finally:
            conn.close()

    def _validate(self) -> bool:
        code = str(uuid.uuid4())
        status, body = self._post([{
            "id": str(uuid.uuid4()), "topic": "/subscriptions/" + self.timeline.scenario.subscriptions[0],
            "subject": "", "eventType": VALIDATION_EVENT, "eventTime": self.timeline.wall(0).isoformat(),
            "data": {"validationCode": code}, "dataVersion": "2", "metadataVersion": "1"}])
        try:
            answered = json.loads(body).get("validationResponse") if status == 200 else None
        except (ValueError, AttributeError):
            answered = None
        if answered == code:
            log.info("fleet simulator: the Event Grid subscription to %s is validated", self.path)
            return True
        log.warning("fleet simulator: validation handshake with %s answered %s; trying again", self.path,
                    status or "nothing")
        return False

    def _due(self) -> list[tuple[Milestone, FleetEventSpec]]:
        now = self.timeline.now()
        due = [(step, spec) for spec in self.timeline.scenario.events for step in self.timeline.milestones(spec)
               if step.at <= now and (spec.event_id, step.status) not in self.delivered]
        return sorted(due, key=lambda item: item[0].at)

    def _run(self) -> None:
        backoff = 0.0
        validated = False
        while not self._stop.wait(backoff or PUSH_TICK):
            if not validated:
                validated = self._validate()
                backoff = 0.0 if validated else min(max(backoff * 2, 0.5), PUSH_MAX_BACKOFF)
                continue
            backoff = 0.0
            for step, spec in self._due():
                message = [self.timeline.event_grid_event(spec, step)]
                status = self._post(message)[0]
                if status == 200 and spec.delivered_twice:
                    status = self._post(message)[0]
                self.answers.append(status)
                if status != 200:   # Event Grid retries on its schedule; here sooner, the scenario being fast
                    backoff = 0.5
                    break
                self.delivered.add((spec.event_id, step.status))


# --- the whole simulation ------------------------------------------------------------------------------------

class FleetSimulation:
    """The stand-in, its credential and, once forewarn's web server listens, the Event Grid pusher."""

    def __init__(self, scenario: FleetScenario, speed: float) -> None:
        self.timeline = FleetTimeline(scenario, speed)
        token = secrets.token_urlsafe(32)
        self.stand_in = FleetStandIn(self.timeline, token).start()
        self.credential = SimulatedCredential(token, f"{self.stand_in.url}/.default")
        self.secret = secrets.token_hex(32)
        self.pusher: EventGridPusher | None = None
        self.scratch: tempfile.TemporaryDirectory[str] | None = None   # the state dir when none was given

    @property
    def url(self) -> str:
        return self.stand_in.url

    def push_to(self, url: str, secret: str) -> None:
        """Begin the scenario, with Event Grid's deliveries to `url` (fleet mode's push route, listening)."""
        self.timeline.begin()
        self.pusher = EventGridPusher(self.timeline, url, secret).start()

    def stop(self) -> None:
        if self.pusher is not None:
            self.pusher.stop()
        self.stand_in.stop()
        if self.scratch is not None:
            self.scratch.cleanup()


def sample_messages(scenario: str = "tour") -> tuple[dict[str, Any], dict[str, Any]]:
    """The first Event Grid delivery and the first Resource Graph row the simulator sends for `scenario`, as
    docs/fleet.md shows them: the start set to 2026-01-05 09:00:00 UTC and real time (speed 1)."""
    timeline = FleetTimeline(FLEET_SCENARIOS[scenario], 1.0,
                             clock=lambda: datetime(2026, 1, 5, 9, 0, tzinfo=timezone.utc).timestamp())
    spec = timeline.scenario.events[0]
    first = timeline.milestones(spec)[0]
    return timeline.event_grid_event(spec, first), timeline.row(spec, first.status)


#: Options that point fleet mode at Azure or Kubernetes: refused with --simulate, which plays Azure's part.
AZURE_OPTIONS = ("subscription", "management-group", "resource-group", "arm-endpoint", "arm-client-id", "queue-url",
                 "queue-connection-string", "queue-connection-string-file", "queue-client-id", "lease-name",
                 "lease-namespace", "kubeconfig")


def start_fleet_simulation(settings: FleetSettings) -> tuple[FleetSettings, FleetSimulation]:
    """Start the simulated fleet of `settings.simulate` and return the settings that point fleet mode at it:
    its subscriptions and ARM base, the push route (--eventgrid-path, default /eventgrid) with a secret made at
    start unless one was given, a snapshot every 5 s unless --reconcile-interval was given, and a temporary
    state dir (removed at stop) unless --state-dir was given. ConfigError for an option that points at Azure
    or Kubernetes, or an unknown scenario."""
    given = {key for key, source in settings.sources.items() if source != "default"}
    # Named as they were given: a flag, a FOREWARN_ variable or a key of the --config file.
    refused = [settings.sources[key] for key in (option_key(name) for name in AZURE_OPTIONS) if key in given]
    if refused:
        raise ConfigError(f"--simulate plays Azure's part with a fleet of its own: {', '.join(refused)} cannot go "
                          "with it (leave --simulate out to read Azure)")
    assert settings.simulate is not None
    try:
        scenario = fleet_scenario(settings.simulate)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    simulation = FleetSimulation(scenario, settings.speed)
    state_dir = settings.state_dir
    if state_dir is None:
        import tempfile  # only for a simulated run, as in `forewarn run --simulate`

        simulation.scratch = tempfile.TemporaryDirectory(prefix="forewarn-fleet-sim-", ignore_cleanup_errors=True)
        state_dir = simulation.scratch.name
    simulated = dataclasses.replace(
        settings, subscription=list(scenario.subscriptions), arm_endpoint=simulation.url, state_dir=state_dir,
        eventgrid_path=settings.eventgrid_path or "/eventgrid",
        eventgrid_secret=settings.eventgrid_secret or simulation.secret,
        reconcile_interval=settings.reconcile_interval if "reconcile_interval" in given else 5.0)
    log.info("fleet simulator: scenario %s at %gx speed, %d subscription(s); Resource Graph and ARM on %s (admin "
             "API: %s/admin/state); Event Grid pushes to %s", scenario.name, settings.speed,
             len(scenario.subscriptions), simulation.url, simulation.url, simulated.eventgrid_path)
    return simulated, simulation
