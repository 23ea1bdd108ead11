"""Azure's part in the simulated fleet, on loopback: Resource Graph's query route and the Maintenance RP's
acknowledge routes (`FleetStandIn`), the credential that gets their token (`SimulatedCredential`), and Event
Grid's deliveries to fleet mode's push route (`EventGridPusher`), all for one FleetTimeline.

What the stand-in checks is what ARM checks (shared FLEET-FACTS.md, sections 1a and 3): the bearer token, the
api-version, the body of a query (scopes, `maintenanceresources`, options) and of an acknowledgement (no body
for one event, `{"value": [...]}` for the list form, on the api-versions that have it), the event being a
Scheduled one of that target. It answers ARM's error shape, and keeps every refusal for `/admin/state`.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import secrets
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple
from urllib.parse import quote, urlsplit

from forewarn.deadline import Deadline
from forewarn.httpconn import DeadlineConnection
from forewarn.simulator.fleet_timeline import FleetEventSpec, FleetTimeline, Milestone
from forewarn.web.server import HttpServer, Request, Response

log = logging.getLogger(__name__)

RESOURCES_PATH = "/providers/Microsoft.ResourceGraph/resources"
#: Resource Graph api-versions the stand-in answers (shared FLEET-FACTS.md, section 1a).
RESOURCE_GRAPH_VERSIONS = ("2021-03-01", "2022-10-01", "2024-04-01")
#: The Maintenance RP's api-versions with the acknowledge call, and those with its list form (section 3).
ACKNOWLEDGE_VERSIONS = ("2023-10-01-preview", "2025-10-01-preview", "2026-02-01-preview")
LIST_FORM_VERSIONS = ("2025-10-01-preview", "2026-02-01-preview")
VALIDATION_EVENT = "Microsoft.EventGrid.SubscriptionValidationEvent"
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
        """One request, done within PUSH_TIMEOUT in all; (0, b"") when there was no answer."""
        context = None
        if self.https:
            import ssl

            # forewarn's own server on loopback with its own certificate (--web.config.file): Event Grid
            # checks it, this stand-in has no way to; what it proves here is the route, not the certificate.
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        conn = DeadlineConnection(self.host, self.port, context=context, connect_timeout=PUSH_TIMEOUT,
                                  deadline=Deadline(PUSH_TIMEOUT))
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
