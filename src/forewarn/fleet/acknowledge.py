"""Approving scheduled events from one place: the Maintenance resource provider's acknowledge call.

Facts this relies on (shared FLEET-FACTS.md, section 3; every api-version with it is a preview):
- one event: `POST {target}/providers/Microsoft.Maintenance/scheduledevents/{EventId}/acknowledge?api-version=V`
  with no body, answered `{"value": "Successfully Approved"}`;
- several events of one target: `POST {target}/providers/Microsoft.Maintenance/scheduledevents?api-version=V`
  with `{"value": [EventId, ...]}`, in the 2025-10-01-preview spec (and the CLI's 2026-02-01-preview); whether
  2023-10-01-preview has it is not confirmed, so older versions get one call per event;
- the target is the resource the event names: a VM, or the scale set or availability set for their events
  (acknowledging once releases the event for every VM in its Resources);
- the right needed is `Microsoft.Maintenance/scheduledevents/acknowledge/action` (the built-in role
  "Scheduled Events Contributor"); approving here or through a VM's IMDS is the same.

`Acknowledger.acknowledge` is one attempt to approve some events of one target, retried within itself on
429 and 5xx (after Retry-After, bounded; `attempts=1` leaves that to the caller, as forewarn.fleet.acks does)
and once after a 401 with a new token; it remembers nothing, so a caller that asks twice sends twice (the
service treats a repeat as harmless). Every request has one deadline for the whole exchange and the stop
signal ends any wait. Calls may run at once on several threads, each on a kept-alive connection of its own.
"""

from __future__ import annotations

import http.client
import json
import logging
import ssl
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import quote, urlencode

from forewarn.deadline import Deadline, Stopped
from forewarn.fleet.arm import ArmConnection, ArmError, TokenCredential, Tokens, arm_base, tls_context
from forewarn.fleet.armid import COMPUTE_NAMESPACE, ArmIdError, parse_arm_id
from forewarn.retry import Backoff, parse_retry_after

log = logging.getLogger(__name__)

#: The newest api-version whose spec (read) has both forms; preview, like every version with the call.
DEFAULT_API_VERSION = "2025-10-01-preview"
#: The api-versions known to have the list form; other versions acknowledge one event per call.
LIST_FORM_VERSIONS = frozenset({"2025-10-01-preview", "2026-02-01-preview"})
#: Resource types an event can name as its target.
TARGET_TYPES = ("virtualmachines", "virtualmachinescalesets", "availabilitysets")
#: Events per list call (the spec sets no limit; this keeps one request small).
MAX_PER_CALL = 50
MAX_REPLY_BYTES = 64 * 1024
#: Kept-alive connections kept idle between calls (calls at once beyond it open and then close their own).
MAX_IDLE_CONNECTIONS = 8


class AcknowledgeError(ArmError):
    """An acknowledgement that did not go through: `status` is ARM's answer (None: none came); retryable
    when a later try may succeed (429, 5xx, transport, deadline). Messages never hold the token."""


@dataclass(frozen=True)
class Acknowledged:
    """What one `acknowledge` did: the events ARM accepted, the requests sent, the 429s ridden out."""

    event_ids: tuple[str, ...]
    requests: int
    throttled: int


class Acknowledger:
    """Acknowledges scheduled events through ARM. Safe to call from several threads at once: each call takes
    a kept-alive connection of its own (at most MAX_IDLE_CONNECTIONS stay open between calls) and they share
    one token.

    - `arm_endpoint`: ARM's base URL (https only); the token's scope is `{arm_endpoint}/.default`.
    - `api_version`: the Maintenance RP's (a preview; `--acknowledge-api-version`).
    - `timeout`: seconds each request may take in all; `attempts`: tries per request on 429 and 5xx, each
      after the reply's Retry-After (or a backoff), at most `max_wait` seconds (a call may ask for fewer).
    - `stop`: ends any wait (a reply, a token, a Retry-After) with `Stopped`.
    - `loopback_http`: allow a plain `http://` loopback IP base (the simulated fleet only; `arm_base`).
    """

    def __init__(self, arm_endpoint: str, credential: TokenCredential, *, api_version: str = DEFAULT_API_VERSION,
                 timeout: float = 30.0, token_timeout: float = 60.0, attempts: int = 5, max_wait: float = 60.0,
                 stop: threading.Event | None = None, context: ssl.SSLContext | None = None,
                 loopback_http: bool = False) -> None:
        self.endpoint, host, port = arm_base(arm_endpoint, loopback_http)
        if not api_version or not all(c.isalnum() or c == "-" for c in api_version):
            raise ValueError(f"api_version {api_version!r} is not an api-version such as {DEFAULT_API_VERSION}")
        if attempts < 1 or timeout <= 0 or token_timeout <= 0 or max_wait < 0:
            raise ValueError("attempts, timeout and token_timeout must be positive, max_wait not negative")
        self.api_version = api_version
        self.timeout = timeout
        self.attempts = attempts
        self.max_wait = max_wait
        self.stop = stop
        self.list_form = api_version in LIST_FORM_VERSIONS
        self._tokens = Tokens(credential, f"{self.endpoint}/.default", token_timeout, AcknowledgeError)
        self._host, self._port, self._context = host, port, tls_context(self.endpoint, context)
        self._backoff = Backoff(base=1.0, cap=max(max_wait, 0.001))
        self._lock = threading.Lock()          # the idle connections
        self._idle: list[ArmConnection] = []
        self._closings = 0                     # close() calls so far: a connection out during one is not kept

    def close(self) -> None:
        """Closes the idle connections (and those in use, once their call ends); a later call opens anew."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._closings += 1
        for wire in idle:
            wire.close()

    def acknowledge(self, target: str, event_ids: Sequence[str], *, attempts: int | None = None) -> Acknowledged:
        """Approve `event_ids`, all of the resource `target` (an ARM ID of a VM, scale set or availability
        set), trying each request up to `attempts` times on 429 and 5xx (default: the constructor's; 1: no
        retry here, the error's `retry_after` says what ARM asked). Raises AcknowledgeError (nothing after the
        first failing call was sent), Stopped on the stop signal, ValueError for a target or id that cannot
        be one."""
        base = self._target_path(target)
        ids = list(dict.fromkeys(event_ids))
        if not ids or not all(isinstance(i, str) and i and "/" not in i and len(i) <= 64 for i in ids):
            raise ValueError(f"event ids must be non-empty ids without '/'; got {ids!r}")
        tries = self.attempts if attempts is None else attempts
        if tries < 1:
            raise ValueError(f"attempts must be at least 1; got {attempts}")
        query = urlencode({"api-version": self.api_version})
        done: list[str] = []
        requests = throttled = 0
        wire, closings = self._connection()
        try:
            if self.list_form and len(ids) > 1:
                for start in range(0, len(ids), MAX_PER_CALL):
                    part = ids[start:start + MAX_PER_CALL]
                    sent, limited = self._post(wire, f"{base}?{query}", json.dumps({"value": part}).encode(),
                                               f"{target}: {len(part)} event(s)", tries)
                    requests, throttled = requests + sent, throttled + limited
                    done += part
            else:
                for event_id in ids:
                    sent, limited = self._post(wire, f"{base}/{quote(event_id, safe='')}/acknowledge?{query}", None,
                                               f"{target}: event {event_id}", tries)
                    requests, throttled = requests + sent, throttled + limited
                    done.append(event_id)
        finally:
            self._give_back(wire, closings)
        return Acknowledged(tuple(done), requests, throttled)

    def _connection(self) -> tuple[ArmConnection, int]:
        """An idle kept-alive connection, or a new one (it connects at its first request), and the number of
        close() calls when it was taken."""
        with self._lock:
            if self._idle:
                return self._idle.pop(), self._closings
            closings = self._closings
        wire = ArmConnection(self._host, self._port, self._context, self.timeout, MAX_REPLY_BYTES,
                             lambda: AcknowledgeError(
                                 f"acknowledge: reply larger than {MAX_REPLY_BYTES} bytes; connection dropped"))
        return wire, closings

    def _give_back(self, wire: ArmConnection, closings: int) -> None:
        with self._lock:
            if closings == self._closings and len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append(wire)
                return
        wire.close()

    @staticmethod
    def _target_path(target: str) -> str:
        try:
            arm_id = parse_arm_id(target)
        except ArmIdError as exc:
            raise ValueError(f"target {target!r} is not an ARM resource ID: {exc}") from None
        if not (arm_id.resource_group and any(arm_id.is_type(COMPUTE_NAMESPACE, kind) for kind in TARGET_TYPES)):
            raise ValueError(f"target {target!r} is not a VM, scale set or availability set")
        path = str(arm_id)
        return quote(path, safe="/") + "/providers/Microsoft.Maintenance/scheduledevents"

    def _post(self, wire: ArmConnection, target: str, body: bytes | None, what: str,
              attempts: int) -> tuple[int, int]:
        """One acknowledge request, sent again after 429/5xx; (requests sent, 429s) once ARM accepts it."""
        renewed = False
        attempt = requests = throttled = 0
        while True:
            bearer = self._tokens.bearer(self.stop)
            headers = {"Authorization": f"Bearer {bearer}", "x-ms-client-request-id": str(uuid.uuid4())}
            if body is not None:
                headers["Content-Type"] = "application/json"
            requests += 1
            try:
                status, reply_headers, reply = wire.send("POST", target, body if body is not None else b"",
                                                         headers, Deadline(self.timeout, self.stop))
            except TimeoutError:
                raise AcknowledgeError(f"acknowledge {what}: no complete answer within {self.timeout:g} s",
                                       retryable=True) from None
            except (OSError, http.client.HTTPException) as exc:
                reason = str(exc) or type(exc).__name__
                raise AcknowledgeError(f"acknowledge {what}: connection failed ({reason[:200]})",
                                       retryable=True) from None
            if status in (200, 202, 204):
                return requests, throttled
            if status == 401 and not renewed:
                renewed = True
                self._tokens.forget()
                continue
            throttled += status == 429
            retry_after = parse_retry_after(reply_headers.get("retry-after"))
            retryable = status in (408, 429) or status >= 500
            attempt += 1
            if not retryable or attempt >= attempts:
                raise self._refused(status, reply, reply_headers, what, retryable, retry_after, attempt)
            wait = min(retry_after if retry_after is not None else self._backoff.delay(attempt - 1), self.max_wait)
            log.warning("acknowledge %s: HTTP %d, trying again in %.1f s (attempt %d of %d)", what, status, wait,
                        attempt + 1, attempts)
            self._sleep(wait)

    def _sleep(self, seconds: float) -> None:
        if self.stop is None:
            time.sleep(seconds)
        elif self.stop.wait(seconds):
            raise Stopped()

    @staticmethod
    def _refused(status: int, reply: bytes, headers: dict[str, str], what: str, retryable: bool,
                 retry_after: float | None, attempts: int) -> AcknowledgeError:
        """ARM explains itself in {"error": {"code", "message"}}: its code, and what the status means here."""
        code = ""
        try:
            error = json.loads(reply).get("error") or {}
            code = str(error.get("code") or "")[:80]
        except (ValueError, AttributeError):
            pass
        code = "".join(c for c in code if c.isprintable())
        meaning = {401: "the credential was refused", 403: "forbidden: the identity needs "
                   "Microsoft.Maintenance/scheduledevents/acknowledge/action (the role Scheduled Events Contributor) "
                   "on the resource", 404: "no such event (ended, or the resource is not opted in)"}.get(status, "")
        request_id = "".join(c for c in headers.get("x-ms-request-id", "")[:64] if c.isprintable())
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        return AcknowledgeError(
            f"acknowledge {what}: HTTP {status}{tries}" + (f" {code}" if code else "")
            + (f": {meaning}" if meaning else "") + (f" [x-ms-request-id {request_id}]" if request_id else ""),
            status=status, retryable=retryable, retry_after=retry_after)
