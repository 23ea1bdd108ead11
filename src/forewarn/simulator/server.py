"""The simulator's HTTP face: answers like IMDS, plus a small admin API for drills and tests.

IMDS behaviour kept here: 400 without `Metadata: true`, 400 with X-Forwarded-For, 400 for an unknown
api-version, 429 beyond 5 requests per second, 405 for other methods, 400 for a malformed
StartRequests body. Admin endpoints (not part of IMDS) live under /admin:
    GET  /admin/state               scenario time, document, approvals received, transitions
    POST /admin/events              inject an event (scenario-file fields; `at` = seconds from now)
    DELETE /admin/events/<id>       remove an event now
    POST /admin/faults              {"next": ["500", "reset"], "next_post": ["500"], "rates": {"429": 0.1},
                                     "latency": 0.2}

It runs on the agent's HttpServer (web/server.py): each path is a handler, and a fault that is no answer
at all (a reset, a request left hanging) is a Response action.
"""

from __future__ import annotations

import json
import logging
import time
from http import HTTPStatus
from typing import Any

from forewarn.imds.document import API_VERSIONS
from forewarn.simulator.scenarios import ScenarioError
from forewarn.simulator.timeline import FAULT_KINDS, Simulator
from forewarn.web.server import HttpServer, Request, Response

log = logging.getLogger(__name__)

SCHEDULED_EVENTS = "/metadata/scheduledevents"
COMPUTE = "/metadata/instance/compute"
COMPUTE_VERSIONS = ("2017-04-02", "2017-08-01", "2017-12-01", "2018-10-01", "2019-06-01", "2020-09-01",
                    "2021-01-01", "2021-02-01", "2021-05-01", "2021-12-13", "2023-07-01")

#: An idle kept-alive connection is closed after this long: well past any poll interval drills use (a
#: client that polls less often connects again, as it must with IMDS too).
READ_TIMEOUT = 60.0
#: Requests answered at once; a "timeout" fault or injected latency holds one for its duration.
MAX_CONNECTIONS = 64
#: StartRequests and admin bodies; a thousand event ids take about 50 kB.
MAX_BODY_BYTES = 1 << 20

_INVALID = object()  # a body that is not JSON


def _json(code: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(code, json.dumps(body).encode(), "application/json; charset=utf-8", headers or {})


def _error(code: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return _json(code, {"error": message}, headers)


def _server_error(code: int) -> Response:
    """The answers the HTTP server gives itself (404, 405, 500), in the simulator's JSON form."""
    return _error(code, HTTPStatus(code).phrase.capitalize())


def _json_body(request: Request) -> Any:
    try:
        return json.loads(request.body) if request.body else None
    except ValueError:
        return _INVALID


class SimulatorServer:
    """The simulator on a real socket; `serve_in_background()` starts it, `stop()` ends it."""

    #: How long a "timeout" fault leaves a request unanswered before resetting its connection.
    timeout_fault_seconds = 5.0

    def __init__(self, simulator: Simulator, host: str = "127.0.0.1", port: int = 0) -> None:
        self.simulator = simulator
        self.http = HttpServer(host, port, read_timeout=READ_TIMEOUT, max_connections=MAX_CONNECTIONS,
                               max_body_bytes=MAX_BODY_BYTES, name="imds-simulator",
                               server_version="forewarn-imds-simulator", error=_server_error)
        self.http.route(SCHEDULED_EVENTS, self._scheduled_events, methods=("GET", "POST"))
        self.http.route(COMPUTE, self._compute, methods=("GET",))
        for path in ("/", "/healthz"):
            self.http.route(path, self._health, methods=("GET",))
        self.http.route("/admin/state", lambda request: _json(200, self.simulator.state()), methods=("GET",))
        self.http.route("/admin/events", self._inject, methods=("POST",))
        self.http.route("/admin/events/", self._remove, methods=("DELETE",), prefix=True)
        self.http.route("/admin/faults", self._set_faults, methods=("POST",))

    @property
    def url(self) -> str:
        return self.http.url

    @property
    def server_address(self) -> tuple[Any, ...]:
        return self.http.server_address

    def serve_in_background(self) -> SimulatorServer:
        self.http.start()
        return self

    def stop(self) -> None:
        self.http.stop()

    # --- IMDS ---------------------------------------------------------------------------------
    def _imds_checks(self, request: Request, versions: tuple[str, ...]) -> str | Response:
        """Common IMDS request checks: the api-version, or the error to answer."""
        sim = self.simulator
        if (request.headers.get("Metadata") or "").lower() != "true":
            return _error(400, "Bad request. Required metadata header not specified")
        if request.headers.get("X-Forwarded-For") is not None:
            return _error(400, "Bad request. Requests with X-Forwarded-For are rejected")
        version = request.query("api-version") or ""
        if version not in versions:
            return _json(400, {"error": "Bad request. api-version is invalid or was not specified",
                               "newest-versions": list(versions[::-1][:3])})
        if sim.over_rate(request.headers.get("User-Agent") or ""):
            return _error(429, "Too many requests", {"Retry-After": "1"})
        sim.requests[f"{request.method} {request.path}"] += 1
        return version

    def _fault(self, is_first: bool, post: bool = False) -> Response | None:
        """The injected fault for this request, if one is due (after any configured latency)."""
        faults = self.simulator.faults
        if is_first and faults.slow_first:
            time.sleep(faults.slow_first)
        if faults.latency:
            time.sleep(faults.latency)
        kind = faults.draw(post)
        if kind is None:
            return None
        if kind == "reset":
            return Response.reset()
        if kind == "timeout":
            return Response.hang(self.timeout_fault_seconds)
        if kind == "malformed":
            return Response(200, b'{"DocumentIncarnation": 7, "Events": [{"EventId": ',
                            "application/json; charset=utf-8")
        code = int(kind)
        return _error(code, f"injected fault {code}", {"Retry-After": "1"} if code in (429, 503) else None)

    def _scheduled_events(self, request: Request) -> Response:
        sim = self.simulator
        version = self._imds_checks(request, API_VERSIONS)
        if isinstance(version, Response):
            return version
        if request.method == "GET":
            return self._fault(sim.first_request()) or _json(200, sim.document(version))
        fault = self._fault(False, post=True)
        if fault is not None:
            return fault
        ids = _start_request_ids(_json_body(request))
        if ids is None:
            return _error(400, "Bad request. Body must be {\"StartRequests\": [{\"EventId\": \"...\"}]}")
        sim.approve(ids, caller=request.headers.get("User-Agent") or "")
        return Response(200, b"", "text/plain")

    def _compute(self, request: Request) -> Response:
        checked = self._imds_checks(request, COMPUTE_VERSIONS)
        return checked if isinstance(checked, Response) else _json(200, self.simulator.compute())

    # --- admin --------------------------------------------------------------------------------
    def _health(self, request: Request) -> Response:
        return _json(200, {"simulator": self.simulator.scenario.name, "scenario_time": self.simulator.now()})

    def _inject(self, request: Request) -> Response:
        body = _json_body(request)
        if not isinstance(body, dict):
            return _error(400, "body must be a JSON object with scenario event fields")
        try:
            event_id = self.simulator.inject(body)
        except (ScenarioError, ValueError, TypeError) as exc:
            return _error(400, str(exc))
        return _json(201, {"EventId": event_id})

    def _remove(self, request: Request) -> Response:
        found = self.simulator.remove(request.path[len("/admin/events/"):])
        return _json(200 if found else 404, {"removed": found})

    def _set_faults(self, request: Request) -> Response:
        problem = _apply_fault_settings(self.simulator, _json_body(request))
        return _error(400, problem) if problem else _json(200, {"ok": True})


def _start_request_ids(body: Any) -> list[str] | None:
    if not isinstance(body, dict) or not isinstance(body.get("StartRequests"), list):
        return None
    ids = []
    for item in body["StartRequests"]:
        if not isinstance(item, dict) or not isinstance(item.get("EventId"), str) or not item["EventId"]:
            return None
        ids.append(item["EventId"])
    return ids


def _apply_fault_settings(sim: Simulator, body: Any) -> str | None:
    if not isinstance(body, dict):
        return "body must be a JSON object"
    faults = sim.faults
    nxt = body.get("next", [])
    nxt_post = body.get("next_post", [])
    rates = body.get("rates", {})
    for name, kinds in (("next", nxt), ("next_post", nxt_post)):
        if not isinstance(kinds, list) or any(kind not in FAULT_KINDS for kind in kinds):
            return f"{name} must be a list of fault kinds ({', '.join(FAULT_KINDS)})"
    if not isinstance(rates, dict) or any(k not in FAULT_KINDS or not 0 <= v <= 1 for k, v in rates.items()):
        return "rates must map fault kinds to probabilities between 0 and 1"
    faults.queue.extend(nxt)
    faults.post_queue.extend(nxt_post)
    if "rates" in body:
        faults.rates = {str(k): float(v) for k, v in rates.items()}
    if "latency" in body:
        faults.latency = float(body["latency"])
    if body.get("clear"):
        faults.queue.clear()
        faults.rates = {}
        faults.latency = 0.0
    return None
