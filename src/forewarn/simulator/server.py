"""The simulator's HTTP face: answers like IMDS, plus a small admin API for drills and tests.

IMDS behaviour kept here: 400 without `Metadata: true`, 400 with X-Forwarded-For, 400 for an unknown
api-version, 429 beyond 5 requests per second, 405 for other methods, 400 for a malformed
StartRequests body. Admin endpoints (not part of IMDS) live under /admin:
    GET  /admin/state               scenario time, document, approvals received, transitions
    POST /admin/events              inject an event (scenario-file fields; `at` = seconds from now)
    DELETE /admin/events/<id>       remove an event now
    POST /admin/faults              {"next": ["500", "reset"], "next_post": ["500"], "rates": {"429": 0.1},
                                     "latency": 0.2}
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from forewarn.imds.document import API_VERSIONS
from forewarn.simulator.scenarios import ScenarioError
from forewarn.simulator.timeline import FAULT_KINDS, Simulator

log = logging.getLogger(__name__)

SCHEDULED_EVENTS = "/metadata/scheduledevents"
COMPUTE = "/metadata/instance/compute"
COMPUTE_VERSIONS = ("2017-04-02", "2017-08-01", "2017-12-01", "2018-10-01", "2019-06-01", "2020-09-01",
                    "2021-01-01", "2021-02-01", "2021-05-01", "2021-12-13", "2023-07-01")


class _Handler(BaseHTTPRequestHandler):
    server: SimulatorServer
    protocol_version = "HTTP/1.1"
    server_version = "forewarn-imds-simulator"
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.client_address[0], *args)

    # --- replies ------------------------------------------------------------------------------
    def _send(self, code: int, body: Any, content_type: str = "application/json; charset=utf-8",
              headers: dict[str, str] | None = None) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, message: str, headers: dict[str, str] | None = None) -> None:
        self._send(code, {"error": message}, headers=headers)

    def _reset(self) -> None:
        # SO_LINGER with a zero timeout makes close() send RST: the client sees "connection reset".
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

    # --- IMDS ---------------------------------------------------------------------------------
    def _imds_checks(self, path: str, versions: tuple[str, ...]) -> str | None:
        """Common IMDS request checks; returns the api-version, or None after answering an error."""
        sim = self.server.simulator
        if self.headers.get("Metadata", "").lower() != "true":
            self._error(400, "Bad request. Required metadata header not specified")
            return None
        if self.headers.get("X-Forwarded-For") is not None:
            self._error(400, "Bad request. Requests with X-Forwarded-For are rejected")
            return None
        query = parse_qs(urlsplit(self.path).query)
        version = (query.get("api-version") or [""])[0]
        if version not in versions:
            self._send(400, {"error": "Bad request. api-version is invalid or was not specified",
                             "newest-versions": list(versions[::-1][:3])})
            return None
        if sim.over_rate(self.headers.get("User-Agent", "")):
            self._error(429, "Too many requests", {"Retry-After": "1"})
            return None
        sim.requests[f"{self.command} {path}"] += 1
        return version

    def _apply_fault(self, is_first: bool, post: bool = False) -> bool:
        """Inject the configured faults; True when the request has been answered (or dropped)."""
        faults = self.server.simulator.faults
        if is_first and faults.slow_first:
            time.sleep(faults.slow_first)
        if faults.latency:
            time.sleep(faults.latency)
        kind = faults.draw(post)
        if kind is None:
            return False
        if kind == "reset":
            self._reset()
        elif kind == "timeout":
            time.sleep(self.server.timeout_fault_seconds)
            self._reset()
        elif kind == "malformed":
            self._send(200, b'{"DocumentIncarnation": 7, "Events": [{"EventId": ')
        else:
            code = int(kind)
            retry = {"Retry-After": "1"} if code in (429, 503) else None
            self._error(code, f"injected fault {code}", retry)
        return True

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        sim = self.server.simulator
        if path == SCHEDULED_EVENTS:
            version = self._imds_checks(path, API_VERSIONS)
            if version is None or self._apply_fault(sim.first_request()):
                return
            self._send(200, sim.document(version))
        elif path == COMPUTE:
            if self._imds_checks(path, COMPUTE_VERSIONS) is not None:
                self._send(200, sim.compute())
        elif path == "/admin/state":
            self._send(200, sim.state())
        elif path in ("/", "/healthz"):
            self._send(200, {"simulator": sim.scenario.name, "scenario_time": sim.now()})
        else:
            self._error(404, "Not found")

    def _json_body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        return json.loads(raw) if raw else None

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        sim = self.server.simulator
        try:
            body = self._json_body()
        except ValueError:
            body = ValueError
        if path == SCHEDULED_EVENTS:
            if self._imds_checks(path, API_VERSIONS) is None or self._apply_fault(False, post=True):
                return
            ids = _start_request_ids(body)
            if ids is None:
                self._error(400, "Bad request. Body must be {\"StartRequests\": [{\"EventId\": \"...\"}]}")
                return
            sim.approve(ids, caller=self.headers.get("User-Agent", ""))
            self._send(200, b"", content_type="text/plain")
        elif path == "/admin/events":
            if not isinstance(body, dict):
                self._error(400, "body must be a JSON object with scenario event fields")
                return
            try:
                event_id = sim.inject(body)
            except (ScenarioError, ValueError, TypeError) as exc:
                self._error(400, str(exc))
                return
            self._send(201, {"EventId": event_id})
        elif path == "/admin/faults":
            problem = _apply_fault_settings(sim, body)
            if problem:
                self._error(400, problem)
            else:
                self._send(200, {"ok": True})
        elif path == COMPUTE:
            self._error(405, "Method not allowed")
        else:
            self._error(404, "Not found")

    def do_DELETE(self) -> None:
        path = urlsplit(self.path).path
        prefix = "/admin/events/"
        if path.startswith(prefix):
            found = self.server.simulator.remove(path[len(prefix):])
            self._send(200 if found else 404, {"removed": found})
        elif path in (SCHEDULED_EVENTS, COMPUTE):
            self._error(405, "Method not allowed")
        else:
            self._error(404, "Not found")

    def do_PUT(self) -> None:
        self._error(405, "Method not allowed")


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


class SimulatorServer(ThreadingHTTPServer):
    """The simulator on a real socket; `serve_in_background()` for in-process use."""

    daemon_threads = True
    allow_reuse_address = True
    timeout_fault_seconds = 5.0

    def __init__(self, simulator: Simulator, host: str = "127.0.0.1", port: int = 0) -> None:
        self.simulator = simulator
        super().__init__((host, port), _Handler)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        shown = host.decode() if isinstance(host, bytes) else str(host)
        shown = "127.0.0.1" if shown == "0.0.0.0" else shown  # noqa: S104
        return f"http://{shown}:{port}"

    def serve_in_background(self) -> SimulatorServer:
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="imds-simulator", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
