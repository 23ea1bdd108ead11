"""A stand-in for Azure Resource Manager over TLS on loopback: the Resource Graph query route and the IMDS
managed identity token endpoint, checking what the real services require and refusing the rest.

- `POST /providers/Microsoft.ResourceGraph/resources?api-version=<api_version>` with `Authorization: Bearer
  <token>` and a JSON body `{subscriptions | managementGroups, query, options}`: subscriptions are GUIDs (at
  most `max_scopes` of them), the query is KQL over `maintenanceresources`, options hold only `$top`
  (1..1000), `$skip`, `$skipToken` (one this stand-in issued, for the same scopes and query),
  `resultFormat` ("objectArray": the stand-in serves no other), `allowPartialScopes`,
  `authorizationScopeFilter`. It answers `{totalRecords, count, resultTruncated, $skipToken?, data}` with the
  rows of `rows` whose subscriptionId is in scope (a management group stands for the subscriptions
  `groups` gives it) and, when the query has `| where resourceGroup in~ ("a", ...)`, whose resourceGroup is
  one of those (without regard to case, as KQL's `in~`; such a clause that is not a list of string literals is
  400), `$top` (or `faults.page_rows`, when smaller) at a time. As Resource Graph does, a
  query whose projection drops `id` cannot be paged: more rows than a page give resultTruncated "true"
  and no $skipToken. A wrong path is 404, a wrong method 405, a missing or wrong token 401 (an ARM error
  object that never repeats the token), anything else malformed 400 with the reason; every refusal is
  also kept in `received.errors`.
- `GET /metadata/identity/oauth2/token?api-version=...&resource=<base>` with `Metadata: true`, as
  azure-identity's ManagedIdentityCredential asks IMDS (point AZURE_POD_IDENTITY_AUTHORITY_HOST here):
  gives `token` for the audience `base` (the ARM endpoint, so the scope `{base}/.default`) only.

- `POST {target}/providers/Microsoft.Maintenance/scheduledevents/{EventId}/acknowledge?api-version=<v>` (no
  body) and its list form `POST {target}/providers/Microsoft.Maintenance/scheduledevents?api-version=<v>` with
  `{"value": [EventId, ...]}` (only on the api-versions whose spec defines it, LIST_ACK_VERSIONS), where the
  target is a VM, scale set or availability set: the bearer token as for queries, an api-version of
  ACK_VERSIONS, and events that `rows` lists for that target (ARM compares names without regard to case);
  an unknown one is 404. Answers `{"value": "Successfully Approved"}`; every acknowledgement is kept in
  `received.acks`, and `ack_faults` (throttle, fail, hang, delay) shapes the next answers to them, or
  `target_faults[target]` (the target's ARM ID in lower case) the answers for that target alone. Every
  acknowledge POST is kept in `received.ack_calls` (when it arrived and was answered), and the stand-in counts
  how many were under way at once, in all and per target (`ack_most_in_flight`, `ack_most_per_target`).

`faults` shapes the next answers to queries: 429 with Retry-After, 5xx, a hang (no answer until `stop()`),
a trickled body, bad JSON, a reply of the wrong shape, an oversized reply, a truncated result, a small
server page size, and a quota (`quota_limit` queries per `quota_window` s, reported in
x-ms-user-quota-remaining / x-ms-user-quota-resets-after as hh:mm:ss, answered with 429 when spent).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import ssl
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from peers.pki import Authority

RESOURCES_PATH = "/providers/Microsoft.ResourceGraph/resources"
TOKEN_PATH = "/metadata/identity/oauth2/token"
GUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
OPTIONS = {"$top", "$skip", "$skipToken", "resultFormat", "allowPartialScopes", "authorizationScopeFilter"}
BODY_KEYS = {"subscriptions", "managementGroups", "query", "options", "facets"}
#: KQL string literals: double-quoted, a backslash escapes the next character.
_KQL_STRING = r'"(?:[^"\\\n]|\\.)*"'
_RESOURCE_GROUP_FILTER = re.compile(r"\|\s*where\s+resourceGroup\s+in~\s*\(")
_RESOURCE_GROUP_LIST = re.compile(rf"\s*({_KQL_STRING}(?:\s*,\s*{_KQL_STRING})*)\s*\)")
#: The Maintenance RP's preview api-versions with the acknowledge operation, and those whose spec also has the
#: list form (shared FLEET-FACTS.md, section 3).
ACK_VERSIONS = ("2023-10-01-preview", "2025-10-01-preview", "2026-02-01-preview")
LIST_ACK_VERSIONS = ("2025-10-01-preview", "2026-02-01-preview")
ACK_PATH = re.compile(
    r"(?P<target>/subscriptions/[^/]+/resourceGroups/[^/]+/providers/Microsoft\.Compute/"
    r"(?:virtualMachines|virtualMachineScaleSets|availabilitySets)/[^/]+)"
    r"/providers/Microsoft\.Maintenance/scheduledevents(?:/(?P<event>[^/]+)/acknowledge)?", re.IGNORECASE)


class Refused(Exception):
    """A request the real service would refuse: the status and the reason."""

    def __init__(self, status: int, code: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.code = code


@dataclass
class Faults:
    """How the next query answers go wrong. Counters count down as they are used."""

    throttle: int = 0                    # answer 429 this many times
    retry_after: str | None = "1"        # the Retry-After of those 429s (None: leave it out)
    fail: int = 0                        # answer `fail_status` this many times
    fail_status: int = 503
    fail_retry_after: str | None = None
    hang: bool = False                   # read the request, never answer (until stop())
    trickle: float = 0.0                 # seconds between the bytes of a 200 body
    bad_json: bool = False               # a 200 whose body is not JSON
    bad_shape: bool = False              # a 200 of JSON that is not a query response (data is an object)
    oversize: int = 0                    # a 200 of this many bytes
    oversize_declared: bool = True       # ... with its Content-Length (False: ended by closing)
    truncate: bool = False               # resultTruncated "true" and no $skipToken
    page_rows: int | None = None         # the server's page size when smaller than $top
    quota_limit: int | None = None       # queries per quota_window; None: no quota headers
    quota_window: float = 5.0
    delay: float = 0.0                   # acknowledgements only: seconds before the answer (a slow reply)


@dataclass
class Received:
    lock: threading.Lock = field(default_factory=threading.Lock)
    queries: list[dict[str, Any]] = field(default_factory=list)   # every well-formed query body, in order
    times: list[float] = field(default_factory=list)              # monotonic arrival of every query POST
    statuses: list[int] = field(default_factory=list)             # the status answered to each query POST
    errors: list[str] = field(default_factory=list)               # every refusal, with its reason
    headers: list[dict[str, str]] = field(default_factory=list)   # each query's headers, without Authorization
    tokens_issued: int = 0
    over_quota: int = 0
    #: (target resource ID in lower case, EventId, "single" or "list", api-version) per event acknowledged
    acks: list[tuple[str, str, str, str]] = field(default_factory=list)
    ack_statuses: list[int] = field(default_factory=list)   # the status answered to each acknowledge POST
    ack_times: list[float] = field(default_factory=list)    # time.time() of each event acknowledged (as acks)
    ack_calls: list[AckCall] = field(default_factory=list)  # every acknowledge POST, in the order answered
    ack_in_flight: dict[str, int] = field(default_factory=dict)        # POSTs under way, by target
    ack_most_in_flight: int = 0                                        # the most under way at once, in all
    ack_most_per_target: dict[str, int] = field(default_factory=dict)  # ... and for one target


@dataclass(frozen=True)
class AckCall:
    """One acknowledge POST: its target (lower case), its events, when it arrived and when its answer began
    to be written (time.monotonic(): before the client can have it), and the status (None: hung until stop())."""

    target: str
    event_ids: tuple[str, ...]
    arrived: float
    answered: float
    status: int | None


def _event_ids(path: str, body: bytes) -> tuple[str, ...]:
    """The events an acknowledge POST names (none when its body is not the list form)."""
    found = ACK_PATH.fullmatch(path)
    if found is not None and found.group("event"):
        return (found.group("event"),)
    try:
        value = json.loads(body).get("value")
    except (ValueError, AttributeError):
        return ()
    return tuple(str(i) for i in value) if isinstance(value, list) else ()


def resets_after_text(seconds: float) -> str:
    whole = max(0, math.ceil(seconds))
    return f"{whole // 3600:02d}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


class ArmPeer:
    def __init__(self, authority: Authority, *, token: str = "test-arm-token", api_version: str = "2024-04-01",
                 rows: list[dict[str, Any]] | None = None, groups: dict[str, list[str]] | None = None,
                 max_scopes: int = 300) -> None:
        self.token = token
        self.api_version = api_version
        self.rows = list(rows or [])
        self.groups = dict(groups or {})
        self.max_scopes = max_scopes
        self.faults = Faults()
        self.ack_faults = Faults()
        self.target_faults: dict[str, Faults] = {}   # by target in lower case; ack_faults for the others
        self._faults_lock = threading.Lock()
        self.received = Received()
        self.released = threading.Event()   # set at stop(): hung answers end
        self._quota_used = 0
        self._quota_since = time.monotonic()
        peer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: Any) -> None:
                return None

            def setup(self) -> None:
                if isinstance(self.request, ssl.SSLSocket):  # the handshake here, not in accept()
                    self.request.settimeout(10)
                    self.request.do_handshake()
                super().setup()

            def do_GET(self) -> None:
                peer._serve(self, "GET")

            def do_POST(self) -> None:
                peer._serve(self, "POST")

            def do_PUT(self) -> None:
                peer._serve(self, "PUT")

            def do_PATCH(self) -> None:
                peer._serve(self, "PATCH")

            def do_DELETE(self) -> None:
                peer._serve(self, "DELETE")

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                return None  # clients that leave mid-answer (deadlines, stops) are expected here

        self.server = Server(("127.0.0.1", 0), Handler)
        context = authority.server_context("arm")
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True, do_handshake_on_connect=False)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), name="arm-peer",
                                       daemon=True)
        self.thread.start()
        host, port = self.server.server_address[:2]
        self.base = f"https://{host}:{port}"

    def stop(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()

    # --- one request -------------------------------------------------------------------------------------
    def _serve(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        url = urlsplit(handler.path)
        headers = {name.lower(): value for name, value in handler.headers.items()}
        length = int(headers.get("content-length") or 0)
        body = handler.rfile.read(length) if length else b""
        if url.path == TOKEN_PATH:
            status, extra, answer = self._token(method, url.query, headers)
        elif url.path == RESOURCES_PATH:
            if method != "POST":
                status, extra, answer = self._refuse(Refused(405, "MethodNotAllowed", f"{method} {url.path}: "
                                                             "only POST queries Resource Graph"))
            else:
                with self.received.lock:
                    self.received.times.append(time.monotonic())
                    self.received.headers.append({k: v for k, v in headers.items() if k != "authorization"})
                if self.faults.hang:
                    self.released.wait()
                    handler.close_connection = True
                    return
                status, extra, answer = self._query(url.query, headers, body)
                with self.received.lock:
                    self.received.statuses.append(status)
        elif found := ACK_PATH.fullmatch(url.path):
            self._serve_acknowledge(handler, method, found.group("target").lower(), url.path, url.query, headers,
                                    body)
            return
        else:
            status, extra, answer = self._refuse(Refused(404, "NotFound", f"no route {method} {url.path}"))
        self._write(handler, status, extra, answer)

    def _write(self, handler: BaseHTTPRequestHandler, status: int, extra: dict[str, str], answer: bytes) -> None:
        faults = self.faults
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json; charset=utf-8")
        handler.send_header("x-ms-request-id", str(uuid.uuid4()))
        for name, value in extra.items():
            handler.send_header(name, value)
        if status == 200 and faults.oversize and not faults.oversize_declared:
            handler.send_header("Connection", "close")
            handler.end_headers()
            handler.close_connection = True
            try:
                chunk = b" " * 65536
                sent = 0
                while sent < faults.oversize and not self.released.is_set():
                    handler.wfile.write(chunk)
                    sent += len(chunk)
            except OSError:
                pass
            return
        handler.send_header("Content-Length", str(len(answer)))
        handler.end_headers()
        try:
            if status == 200 and faults.trickle:
                for index in range(len(answer)):
                    if self.released.wait(faults.trickle):
                        break
                    handler.wfile.write(answer[index:index + 1])
                    handler.wfile.flush()
            else:
                handler.wfile.write(answer)
        except OSError:
            handler.close_connection = True

    def _refuse(self, refused: Refused) -> tuple[int, dict[str, str], bytes]:
        with self.received.lock:
            self.received.errors.append(f"{refused.status} {refused.code}: {refused}")
        extra = {"WWW-Authenticate": 'Bearer error="invalid_token"'} if refused.status == 401 else {}
        return refused.status, extra, json.dumps({"error": {"code": refused.code, "message": str(refused)}}).encode()

    def _token(self, method: str, query: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        params = parse_qs(query)
        if method != "GET":
            return self._refuse(Refused(405, "MethodNotAllowed", f"{method} {TOKEN_PATH}: only GET"))
        if headers.get("metadata") != "true":
            return self._refuse(Refused(400, "invalid_request", "token request without Metadata: true"))
        if not params.get("api-version"):
            return self._refuse(Refused(400, "invalid_request", "token request without api-version"))
        if params.get("resource") != [self.base]:
            return self._refuse(Refused(400, "invalid_resource", f"token request for {params.get('resource')}, "
                                                                 f"this stand-in issues tokens for {self.base}"))
        with self.received.lock:
            self.received.tokens_issued += 1
        return 200, {}, json.dumps({"access_token": self.token, "expires_in": "86399", "token_type": "Bearer",
                                    "expires_on": str(int(time.time()) + 86399), "resource": self.base}).encode()

    # --- the acknowledge route -------------------------------------------------------------------------
    def _ack_faults_for(self, target: str) -> Faults:
        return self.target_faults.get(target, self.ack_faults)

    def _serve_acknowledge(self, handler: BaseHTTPRequestHandler, method: str, target: str, path: str, query: str,
                           headers: dict[str, str], body: bytes) -> None:
        """One acknowledge POST, counted while under way and kept in `received.ack_calls`."""
        arrived = time.monotonic()
        faults = self._ack_faults_for(target)
        with self.received.lock:
            received = self.received
            received.ack_in_flight[target] = now = received.ack_in_flight.get(target, 0) + 1
            received.ack_most_per_target[target] = max(received.ack_most_per_target.get(target, 0), now)
            received.ack_most_in_flight = max(received.ack_most_in_flight, sum(received.ack_in_flight.values()))
        status: int | None = None
        answered = 0.0
        try:
            if faults.hang:
                self.released.wait()
                handler.close_connection = True
                return
            status, extra, answer = self._acknowledge(method, path, query, headers, body)
            with self.received.lock:
                self.received.ack_statuses.append(status)
            if faults.delay:
                self.released.wait(faults.delay)
            answered = time.monotonic()
            self._write(handler, status, extra, answer)
        finally:
            with self.received.lock:
                self.received.ack_in_flight[target] -= 1
                self.received.ack_calls.append(AckCall(target, _event_ids(path, body), arrived,
                                                       answered or time.monotonic(), status))

    def _acknowledge(self, method: str, path: str, query: str, headers: dict[str, str],
                     body: bytes) -> tuple[int, dict[str, str], bytes]:
        found = ACK_PATH.fullmatch(path)
        assert found is not None
        target, single = found.group("target").lower(), found.group("event")
        version = (parse_qs(query).get("api-version") or [""])[0]
        try:
            if method != "POST":
                raise Refused(405, "MethodNotAllowed", f"{method} {path}: acknowledge is a POST")
            if version not in ACK_VERSIONS:
                raise Refused(400, "InvalidApiVersionParameter", f"api-version {version!r}: not one of {ACK_VERSIONS}")
            if headers.get("authorization") != f"Bearer {self.token}":
                raise Refused(401, "AuthenticationFailed", "missing or invalid bearer token")
            if single is not None:
                if body:
                    raise Refused(400, "InvalidRequestContent", "the acknowledge POST takes no body")
                ids, form = [single], "single"
            else:
                if version not in LIST_ACK_VERSIONS:
                    raise Refused(404, "NotFound", f"api-version {version} has no list acknowledge")
                try:
                    request = json.loads(body)
                except ValueError as exc:
                    raise Refused(400, "InvalidRequestContent", f"body is not JSON: {exc}") from None
                ids = request.get("value") if isinstance(request, dict) and set(request) == {"value"} else None
                if not isinstance(ids, list) or not ids or not all(isinstance(i, str) and i for i in ids):
                    raise Refused(400, "InvalidRequestContent", 'the body must be {"value": [EventId, ...]}')
                form = "list"
            known = {str(row.get("name", "")).lower() for row in self.rows
                     if str(row.get("id", "")).lower().startswith(target + "/providers/microsoft.maintenance/")}
            unknown = [event for event in ids if event.lower() not in known]
            if unknown:
                raise Refused(404, "ScheduledEventNotFound", f"no scheduled event {unknown[0]} on {target}")
        except Refused as refused:
            return self._refuse(refused)
        faults = self._ack_faults_for(target)
        with self._faults_lock:   # answers to one target may be under way at once
            throttled = faults.throttle > 0
            failing = not throttled and faults.fail > 0
            faults.throttle -= throttled
            faults.fail -= failing
        if throttled:
            retry = {"Retry-After": faults.retry_after} if faults.retry_after is not None else {}
            return 429, retry, json.dumps({"error": {"code": "TooManyRequests", "message": "throttled"}}).encode()
        if failing:
            retry = {"Retry-After": faults.fail_retry_after} if faults.fail_retry_after is not None else {}
            return faults.fail_status, retry, json.dumps(
                {"error": {"code": "InternalServerError", "message": "the stand-in is failing"}}).encode()
        with self.received.lock:
            self.received.acks.extend((target, event, form, version) for event in ids)
            self.received.ack_times.extend(time.time() for _ in ids)
        return 200, {}, json.dumps({"value": "Successfully Approved"}).encode()

    # --- the query route ---------------------------------------------------------------------------------
    def _query(self, query: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str], bytes]:
        try:
            request = self._checked(query, headers, body)
        except Refused as refused:
            return self._refuse(refused)
        with self.received.lock:
            self.received.queries.append(request)
        faults = self.faults
        quota = self._spend_quota()
        if quota is not None and int(quota["x-ms-user-quota-remaining"]) < 0:
            with self.received.lock:
                self.received.over_quota += 1
            quota["x-ms-user-quota-remaining"] = "0"
            return 429, {**quota, "Retry-After": str(math.ceil(self._quota_left()))}, json.dumps(
                {"error": {"code": "RateLimiting", "message": "quota spent"}}).encode()
        extra = quota or {}
        if faults.throttle > 0:
            faults.throttle -= 1
            retry = {"Retry-After": faults.retry_after} if faults.retry_after is not None else {}
            return 429, {**extra, **retry}, json.dumps(
                {"error": {"code": "RateLimiting", "message": "too many requests"}}).encode()
        if faults.fail > 0:
            faults.fail -= 1
            retry = {"Retry-After": faults.fail_retry_after} if faults.fail_retry_after is not None else {}
            return faults.fail_status, {**extra, **retry}, json.dumps(
                {"error": {"code": "ServiceUnavailable", "message": "the stand-in is failing"}}).encode()
        if faults.bad_json:
            return 200, extra, b'{"totalRecords": 1, "count": 1, "data": [{"id": '
        if faults.bad_shape:
            return 200, extra, json.dumps({"totalRecords": 1, "count": 1, "resultTruncated": "false",
                                           "data": {"columns": [], "rows": []}}).encode()
        if faults.oversize:
            return 200, extra, b" " * faults.oversize
        return 200, extra, json.dumps(self._page(request)).encode()

    def _checked(self, query: str, headers: dict[str, str], body: bytes) -> dict[str, Any]:
        versions = parse_qs(query).get("api-version")
        if versions != [self.api_version]:
            raise Refused(400, "InvalidApiVersionParameter",
                          f"api-version {versions}: this stand-in serves {self.api_version}")
        if headers.get("authorization") != f"Bearer {self.token}":
            raise Refused(401, "AuthenticationFailed", "missing or invalid bearer token")
        if not headers.get("content-type", "").startswith("application/json"):
            raise Refused(400, "UnsupportedMediaType", f"content-type {headers.get('content-type')!r}")
        try:
            request = json.loads(body)
        except ValueError as exc:
            raise Refused(400, "InvalidRequestContent", f"body is not JSON: {exc}") from None
        if not isinstance(request, dict):
            raise Refused(400, "InvalidRequestContent", "body is not a JSON object")
        unknown = set(request) - BODY_KEYS
        if unknown:
            raise Refused(400, "InvalidRequestContent", f"unknown body fields {sorted(unknown)}")
        if ("subscriptions" in request) == ("managementGroups" in request):
            raise Refused(400, "InvalidScope", "give subscriptions or managementGroups (one of them)")
        key = "subscriptions" if "subscriptions" in request else "managementGroups"
        scopes = request[key]
        if not isinstance(scopes, list) or not scopes or not all(isinstance(s, str) and s for s in scopes):
            raise Refused(400, "InvalidScope", f"{key} must be a non-empty array of ids")
        if len(scopes) > self.max_scopes:
            raise Refused(400, "InvalidScope", f"{len(scopes)} {key}, this stand-in takes at most {self.max_scopes}")
        if len(set(scopes)) != len(scopes):
            raise Refused(400, "InvalidScope", f"{key} repeats an id")
        if key == "subscriptions" and not all(GUID.fullmatch(s) for s in scopes):
            raise Refused(400, "InvalidSubscriptionId", "subscriptions must be GUIDs")
        if key == "managementGroups" and not all(s in self.groups for s in scopes):
            raise Refused(400, "ManagementGroupNotFound",
                          f"unknown management groups {sorted(set(scopes) - set(self.groups))}")
        text = request.get("query")
        if not isinstance(text, str) or not text.strip():
            raise Refused(400, "InvalidQuery", "query must be a non-empty string")
        if not text.lstrip().startswith("maintenanceresources"):
            raise Refused(400, "InvalidQuery", "this stand-in serves the maintenanceresources table only")
        self._resource_groups(text)
        options = request.get("options", {})
        if not isinstance(options, dict):
            raise Refused(400, "InvalidRequestContent", "options must be an object")
        if set(options) - OPTIONS:
            raise Refused(400, "InvalidRequestContent", f"unknown options {sorted(set(options) - OPTIONS)}")
        top = options.get("$top", 1000)
        if isinstance(top, bool) or not isinstance(top, int) or not 1 <= top <= 1000:
            raise Refused(400, "InvalidRequestContent", f"$top {top!r}: 1 to 1000")
        if options.get("resultFormat", "objectArray") != "objectArray":
            raise Refused(400, "InvalidRequestContent", "this stand-in serves resultFormat objectArray only")
        if "$skipToken" in options:
            self._offset(options["$skipToken"], request)
        return request

    @staticmethod
    def _resource_groups(query: str) -> set[str] | None:
        """The resource groups of the query's `| where resourceGroup in~ (...)`, lower-cased; None without one."""
        clause = _RESOURCE_GROUP_FILTER.search(query)
        if clause is None:
            return None
        names = _RESOURCE_GROUP_LIST.match(query, clause.end())
        if names is None:
            raise Refused(400, "InvalidQuery", "resourceGroup in~ takes a list of string literals")
        return {json.loads(literal).lower() for literal in re.findall(_KQL_STRING, names.group(1))}

    def _key(self, request: dict[str, Any]) -> str:
        scope = request.get("subscriptions") or request.get("managementGroups")
        return hashlib.sha256(json.dumps([scope, request["query"]]).encode()).hexdigest()[:16]

    def _offset(self, token: Any, request: dict[str, Any]) -> int:
        try:
            decoded = json.loads(base64.urlsafe_b64decode(token.encode()))
            offset, key = decoded["offset"], decoded["key"]
        except (ValueError, KeyError, TypeError, AttributeError):
            raise Refused(400, "InvalidSkipToken", "$skipToken is not one this service issued") from None
        if key != self._key(request):
            raise Refused(400, "InvalidSkipToken", "$skipToken belongs to another query or scope")
        return int(offset)

    def _page(self, request: dict[str, Any]) -> dict[str, Any]:
        if "subscriptions" in request:
            wanted = set(request["subscriptions"])
        else:
            wanted = {sub for group in request["managementGroups"] for sub in self.groups[group]}
        groups = self._resource_groups(request["query"])
        rows = [row for row in self.rows if row.get("subscriptionId") in wanted
                and (groups is None or str(row.get("resourceGroup", "")).lower() in groups)]
        options = request.get("options", {})
        size = min(options.get("$top", 1000), self.faults.page_rows or 1000)
        start = self._offset(options["$skipToken"], request) if "$skipToken" in options else 0
        page = rows[start:start + size]
        more = start + size < len(rows)
        projection = re.search(r"\|\s*project\s+([^|]*)", request["query"])
        pageable = projection is None or "id" in {name.strip() for name in projection.group(1).split(",")}
        reply: dict[str, Any] = {"totalRecords": len(rows), "count": len(page), "resultTruncated": "false",
                                 "data": page, "facets": []}
        if more and pageable and not self.faults.truncate:
            reply["$skipToken"] = base64.urlsafe_b64encode(
                json.dumps({"offset": start + size, "key": self._key(request)}).encode()).decode()
        elif more or self.faults.truncate:
            reply["resultTruncated"] = "true"
        return reply

    # --- the quota -----------------------------------------------------------------------------------------
    def _quota_left(self) -> float:
        return max(0.0, self._quota_since + self.faults.quota_window - time.monotonic())

    def _spend_quota(self) -> dict[str, str] | None:
        """Quota headers after this query is counted; a negative remaining means it was over."""
        if self.faults.quota_limit is None:
            return None
        if time.monotonic() >= self._quota_since + self.faults.quota_window:
            self._quota_since, self._quota_used = time.monotonic(), 0
        self._quota_used += 1
        return {"x-ms-user-quota-remaining": str(self.faults.quota_limit - self._quota_used),
                "x-ms-user-quota-resets-after": resets_after_text(self._quota_left())}
