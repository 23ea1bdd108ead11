"""Event Grid push: the route on forewarn's own web server that takes webhook deliveries for the fleet.

An Event Grid subscription on the system topic `Microsoft.ResourceNotifications.MaintenanceResources` can
deliver to a webhook instead of a Storage queue. `add_eventgrid_route` registers that webhook with the
one HttpServer (web/server.py); the server owns TLS, the read deadline, the worker pool and the body
limit, this route owns what Event Grid asks of a webhook endpoint:

- **Who may post.** Event Grid signs nothing; a webhook proves the sender by a shared secret that the
  subscription carries, either in the endpoint URL's query (`https://HOST/eventgrid?code=SECRET`, the
  "client secret as a query parameter" way of Event Grid's webhook authentication page) or in a header
  set with the subscription's delivery properties (`X-Forewarn-Key: SECRET`, or `Authorization: Bearer
  SECRET`; mark it "is secret"). Every request, OPTIONS included, is checked before anything in it is
  looked at. The check compares keyed SHA-256 digests with `hmac.compare_digest`, so neither the time
  taken nor the length tells a guesser anything. A failure is a bare 401. The query way is recommended:
  both validation handshakes go to the exact endpoint URL, while whether Event Grid adds delivery headers
  to them is not documented, and `az eventgrid event-subscription show` hides the URL's query unless asked
  for `--include-full-endpoint-url`.
- **HTTPS** is the web server's: serve it with `--web.config.file` (tls_server_config). Without it the
  secret crosses the network in clear text; Event Grid itself only delivers to https:// endpoints. The
  route is registered `public`: the web configuration's basic auth is for people and Prometheus, and the
  route has its own secret.
- **The validation handshakes.** In the Event Grid schema the subscription's creation posts a
  `Microsoft.EventGrid.SubscriptionValidationEvent`; the answer is 200 `{"validationResponse": CODE}`
  with the event's `data.validationCode` (its `validationUrl`, the manual way, is not fetched: the server
  makes no requests on a sender's say-so). In the CloudEvents 1.0 schema Event Grid uses the CloudEvents
  webhook abuse protection instead: OPTIONS with `WebHook-Request-Origin` (eventgrid.azure.net), answered
  with `WebHook-Allowed-Origin` and `WebHook-Allowed-Rate: *` for an allowed origin, 403 for another.
- **Deliveries.** A body in either schema (`application/json`, `application/cloudevents+json` for one
  event, `application/cloudevents-batch+json` for a batch) goes through `feed.parse_event_grid`, the same
  boundary as a queue message, and its scheduled events to `accept`, which commits them. Only when
  `accept` has returned is the answer 200: Event Grid treats 200-204 as delivered.
- **What Event Grid does with the answer** (its "delivery and retry" page): a webhook's 400, 401, 403 and
  413 are not retried (the event is dead-lettered when the subscription has a dead-letter destination,
  otherwise dropped); everything else, 503 included, is retried on its schedule (10 s, 30 s, 1 min, 5 min,
  ... up to 24 h). So a body that cannot be read is 400 (retrying cannot fix it), a failed commit is 503
  (retrying can), and so is a delivery a full outbox refuses (docs/fleet.md, "A full outbox"). Event Grid
  waits 30 s for an answer; a commit that takes longer is retried, and the
  tracker drops the repeat by its Event Grid id.

Bounds: the body (`max_body_bytes`, refused with 413 by the server from the Content-Length alone, before
the body is read), the events in one body (the feed's caps), the time to send a request (the server's read
timeout), and the deliveries committing at once (`max_concurrent`; past it 503, so pushes never take every
worker from the Prometheus scrape). The web server reads a request whole, body included, before any
handler runs: a stranger's body is read (within those bounds) and then refused with 401 unparsed; refusing
it from the head alone needs a check at the server's head stage. The secret is never logged: this module
logs paths without their query, and so does the web server's request log.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from forewarn.fleet.feed import DEFAULT_MAX_MESSAGE_BYTES, FeedError, FleetEvent, parse_event_grid
from forewarn.imds.document import shown
from forewarn.imds.reply import ReplyError, decode_reply
from forewarn.outbox.store import OutboxFull
from forewarn.web.server import HttpServer, Request, Response

log = logging.getLogger(__name__)

DEFAULT_PATH = "/eventgrid"
#: Event Grid caps one event, and one pushed batch, at 1 MB.
DEFAULT_MAX_BODY_BYTES = DEFAULT_MAX_MESSAGE_BYTES
#: The origin Event Grid names in the CloudEvents abuse-protection handshake.
EVENT_GRID_ORIGIN = "eventgrid.azure.net"
#: Where the secret may come: the endpoint URL's query parameter, or one of two headers.
QUERY_PARAMETER = "code"
KEY_HEADER = "X-Forewarn-Key"
VALIDATION_EVENT = "Microsoft.EventGrid.SubscriptionValidationEvent"
#: A secret travels in a URL and a header: URL-safe characters only, long enough not to be guessed, short
#: enough for an Event Grid delivery header (values up to 4096 bytes).
MIN_SECRET_CHARS = 16
MAX_SECRET_CHARS = 1024
_SECRET_CHARS = re.compile(r"[A-Za-z0-9._~-]+")
#: A validation code is a GUID; anything much longer is not one.
MAX_VALIDATION_CODE_CHARS = 256
#: Media types taken as a delivery (a missing Content-Type too).
DELIVERY_TYPES = ("application/json", "application/cloudevents+json", "application/cloudevents-batch+json")
#: At most one warning a minute about refused requests: a scanner must not flood the log (the metric counts
#: every one).
REFUSAL_LOG_SECONDS = 60.0

Result = Literal["accepted", "validated", "unauthorized", "invalid", "failed"]
#: What `on_result` is told, one per request: for the metric's label values.
RESULTS: tuple[Result, ...] = ("accepted", "validated", "unauthorized", "invalid", "failed")
_ALLOW = "OPTIONS, POST"


class SecretCheck:
    """The shared secret, compared in constant time.

    Both sides are reduced to an HMAC-SHA-256 digest under a key made at start and the digests compared
    with `hmac.compare_digest`: equal-length inputs, so the comparison's time depends on neither the
    secret's length nor how much of it a guess got right.
    """

    def __init__(self, secret: str) -> None:
        if not MIN_SECRET_CHARS <= len(secret) <= MAX_SECRET_CHARS or not _SECRET_CHARS.fullmatch(secret):
            # The secret itself is not repeated: the message may end up in a log.
            raise ValueError(f"the Event Grid secret must be {MIN_SECRET_CHARS} to {MAX_SECRET_CHARS} characters "
                             "of A-Z a-z 0-9 . _ ~ - (it travels in a URL and a header); make one with: "
                             "openssl rand -hex 32")
        self._key = os.urandom(32)
        self._expected = self._digest(secret)

    def _digest(self, value: str) -> bytes:
        return hmac.new(self._key, value.encode("utf-8", "replace"), hashlib.sha256).digest()

    def matches(self, candidate: str | None) -> bool:
        return candidate is not None and hmac.compare_digest(self._digest(candidate), self._expected)

    def allows(self, request: Request) -> bool:
        """Whether the request carries the secret in the query, X-Forewarn-Key or Authorization: Bearer.
        Every place is compared, whether an earlier one matched or not."""
        bearer = None
        scheme, _, token = (request.headers.get("Authorization") or "").strip().partition(" ")
        if scheme.lower() == "bearer":
            bearer = token.strip()
        found = False
        for candidate in (request.query(QUERY_PARAMETER), request.headers.get(KEY_HEADER), bearer):
            found |= self.matches(candidate)
        return found


class _RefusalLog:
    """Warns about requests without the secret at most once per REFUSAL_LOG_SECONDS, with how many."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._next = 0.0
        self._count = 0

    def refused(self, request: Request) -> None:
        with self._lock:
            self._count += 1
            now = self._clock()
            if now < self._next:
                return
            count, self._count, self._next = self._count, 0, now + REFUSAL_LOG_SECONDS
        log.warning("Event Grid push on %s: refused a request without the secret from %s with 401 (%d since the "
                    "last such warning; at most one a minute)", request.path,
                    request.client[0] if request.client else "?", count)


def _json(status: int, value: Any) -> Response:
    return Response(status, (json.dumps(value) + "\n").encode(), "application/json", {"Cache-Control": "no-store"})


def _text(status: int, text: str, headers: dict[str, str] | None = None) -> Response:
    return Response(status, (text + "\n").encode(), headers=headers or {})


def validation_code(value: Any) -> str | None:
    """The code of an Event Grid subscription validation event, None when `value` (a decoded body) is not
    one; FeedError for a validation event that cannot be answered."""
    items = value if isinstance(value, list) else [value]
    found = [item for item in items if isinstance(item, dict)
             and str(item.get("eventType") or item.get("type") or "").lower() == VALIDATION_EVENT.lower()]
    if not found:
        return None
    if len(items) != 1:
        raise FeedError(f"a {VALIDATION_EVENT} comes alone; this body holds {len(items)} events")
    data = found[0].get("data")
    code = data.get("validationCode") if isinstance(data, dict) else None
    if not isinstance(code, str) or not 0 < len(code) <= MAX_VALIDATION_CODE_CHARS:
        raise FeedError(f"$[0].data.validationCode is {shown(code)}; expected the code to send back "
                        f"(a string of up to {MAX_VALIDATION_CODE_CHARS} characters)")
    return code


def add_eventgrid_route(server: HttpServer, path: str = DEFAULT_PATH, *, secret: str,
                        accept: Callable[[Sequence[FleetEvent]], object],
                        allowed_origins: Sequence[str] = (EVENT_GRID_ORIGIN,),
                        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_concurrent: int | None = None,
                        on_result: Callable[[Result], None] | None = None) -> None:
    """Serve Event Grid webhook deliveries on `path` of `server` (register before `server.start()`).

    `accept(events)` gets the scheduled events of each delivery and must return only once they are
    committed, raising otherwise (FleetCommitter.news). `secret` is the shared secret (ValueError when too
    short or not URL-safe). `allowed_origins` are the WebHook-Request-Origin values granted in the
    CloudEvents handshake. `max_body_bytes` raises the server's own body limit to it when that is lower:
    the server reads a body before any handler runs, so the limit has to hold there. `max_concurrent`
    bounds the deliveries being committed at once (default: half the server's workers, at least 1).
    `on_result(kind)` is told how each request ended, one of RESULTS.
    """
    check = SecretCheck(secret)
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    origins = frozenset(origin.strip().lower() for origin in allowed_origins)
    concurrent = max_concurrent or max(1, server.max_connections // 2)
    committing = threading.BoundedSemaphore(concurrent)
    refusals = _RefusalLog()
    server.max_body_bytes = max(server.max_body_bytes, max_body_bytes)

    def ended(kind: Result, response: Response) -> Response:
        if on_result is not None:
            on_result(kind)
        return response

    def handshake(request: Request) -> Response:
        origin = (request.headers.get("WebHook-Request-Origin") or "").strip()
        allow = {"Allow": _ALLOW}
        if not origin:
            return ended("invalid", _text(400, "OPTIONS needs WebHook-Request-Origin (the CloudEvents webhook "
                                               "validation handshake)", allow))
        if origin.lower() not in origins:
            log.warning("Event Grid push on %s: CloudEvents handshake of origin %s refused; allowed: %s",
                        request.path, shown(origin), ", ".join(sorted(origins)))
            return ended("invalid", _text(403, "origin not allowed", allow))
        log.info("Event Grid push on %s: CloudEvents handshake of %s answered", request.path, shown(origin))
        # "*": no rate is promised or refused here; the worker pool and max_concurrent are the limits.
        return ended("validated", Response(200, headers={**allow, "WebHook-Allowed-Origin": origin,
                                                         "WebHook-Allowed-Rate": "*"}))

    def deliver(request: Request) -> Response:
        if len(request.body) > max_body_bytes:  # the server's limit may be higher (another route's)
            return ended("invalid", _text(413, f"body larger than {max_body_bytes} bytes"))
        media = (request.headers.get("Content-Type") or "application/json").split(";")[0].strip().lower()
        if media not in DELIVERY_TYPES:
            return ended("invalid", _text(415, "expected " + ", ".join(DELIVERY_TYPES)))
        try:
            value, _ = decode_reply(request.body)
            code = validation_code(value)
            if code is not None:
                event = value[0] if isinstance(value, list) else value
                log.info("Event Grid push on %s: subscription validated (topic %s)", request.path,
                         shown(event.get("topic"), 300))
                return ended("validated", _json(200, {"validationResponse": code}))
            result = parse_event_grid(value, max_bytes=max_body_bytes)
        except (FeedError, ReplyError) as exc:
            # Authenticated, so Event Grid's own: worth a line each time, since it will not be retried.
            log.warning("Event Grid push on %s: delivery refused with 400 and not retried by Event Grid (dead-"
                        "lettered if the subscription has a destination for that): %s", request.path, exc)
            return ended("invalid", _text(400, f"body: {exc}"[:1000]))
        for warning in result.warnings:
            log.info("Event Grid push on %s: %s", request.path, warning)
        if result.events:
            if not committing.acquire(blocking=False):
                log.warning("Event Grid push on %s: %d deliveries are being committed already; answering 503, "
                            "Event Grid retries", request.path, concurrent)
                return ended("failed", _text(503, "busy; retry later"))
            try:
                accept(result.events)
            except OutboxFull as exc:
                log.warning("Event Grid push on %s: %s; answering 503, Event Grid retries", request.path, exc)
                return ended("failed", _text(503, "outbox full; retry later"))
            except Exception:
                log.exception("Event Grid push on %s: cannot commit %d event(s); answering 503, Event Grid "
                              "retries", request.path, len(result.events))
                return ended("failed", _text(503, "not committed; retry later"))
            finally:
                committing.release()
        return ended("accepted", _text(200, f"accepted {len(result.events)} scheduled event(s), skipped "
                                            f"{result.skipped} other(s)"))

    def handle(request: Request) -> Response:
        if not check.allows(request):
            refusals.refused(request)
            return ended("unauthorized", _text(401, "unauthorized", {"WWW-Authenticate": 'Bearer realm="forewarn"'}))
        if request.method == "OPTIONS":
            return handshake(request)
        if request.method != "POST":
            return ended("invalid", _text(405, "method not allowed", {"Allow": _ALLOW}))
        return deliver(request)

    server.route(path, handle, methods=None, public=True)
