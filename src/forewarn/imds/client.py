"""HTTP client for IMDS: one pooled session, the headers IMDS wants, and its request budget.

Facts this relies on (see shared IMDS.md):
- every request needs `Metadata: true`; it must bypass proxies and never carry X-Forwarded-For;
- the first Scheduled Events request switches the service on and may take up to two minutes;
- at most 5 requests per second per VM, across all callers (429 beyond that);
- 410 (service updating, clears within 70 s), 429 and 5xx are passing: retry with backoff; other 4xx
  will not get better by asking again.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar
from urllib.parse import urlencode, urlsplit

from forewarn import DEFAULT_API_VERSION, __version__
from forewarn.deadline import Connection, Deadline
from forewarn.imds.document import Document, DocumentError, parse_document
from forewarn.imds.instance import COMPUTE_API_VERSION, VmInfo, parse_compute
from forewarn.imds.reply import DEFAULT_MAX_REPLY_BYTES, ReplyError, decode_reply
from forewarn.imds.wire import PreparedGet, Reply, TooLarge, Wire, request_bytes
from forewarn.retry import RetryableError, parse_retry_after

DEFAULT_ENDPOINT = "http://169.254.169.254"
SCHEDULED_EVENTS_PATH = "/metadata/scheduledevents"
COMPUTE_PATH = "/metadata/instance/compute"
USER_AGENT = f"forewarn/{__version__}"

#: IMDS may take this long to answer the first Scheduled Events request while it enables the service.
FIRST_CALL_TIMEOUT = 120.0
CONNECT_TIMEOUT = 2.0
#: Requests per window that polls leave to approvals and instance metadata (of IMDS's 5 per second).
POLL_RESERVE = 1

T = TypeVar("T")


class ImdsError(RetryableError):
    """A failed IMDS request. `code` is the HTTP status, or None for a transport failure."""

    def __init__(self, message: str, code: int | None = None, retryable: bool = False,
                 retry_after: float | None = None) -> None:
        super().__init__(message, retryable, retry_after)
        self.code = code

    @property
    def kind(self) -> str:
        """A short, stable description for logs: the status code or the transport failure."""
        return str(self.code) if self.code is not None else "transport"


def is_retryable_status(code: int) -> bool:
    return code in (410, 429) or code >= 500


class RequestObserver(Protocol):
    """Where the client reports each request (the metrics, in the collector)."""

    def __call__(self, method: str, code: str, seconds: float) -> None: ...


class RateLimiter:
    """At most `limit` requests in any `window` seconds, shared by every caller in this process.

    Keeps the times of recent requests; a new one waits until it fits. Unlike spacing requests
    1/limit apart, this allows a short burst (a retry right after a poll) without ever exceeding the
    budget in any window. The default window has a 50 ms margin over IMDS's one second, because
    requests reach IMDS with uneven delays.

    A caller may leave `reserve` slots free: polls keep one for approvals and instance metadata, so
    an approval never waits behind a poll cadence that uses the whole budget (5 polls/s). Waiting
    happens outside the lock, so a caller with room goes ahead while another waits.
    """

    def __init__(self, limit: int = 5, window: float = 1.05, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.limit = limit
        self.window = window
        self._clock = clock
        self._sleep = sleep
        self._times: collections.deque[float] = collections.deque()
        self._lock = threading.Lock()

    def acquire(self, reserve: int = 0, stop: threading.Event | None = None) -> None:
        """Wait for a slot; a set `stop` ends the wait with Stopped."""
        allowed = max(1, self.limit - reserve)
        while True:
            with self._lock:
                now = self._clock()
                while self._times and self._times[0] <= now - self.window:
                    self._times.popleft()
                if len(self._times) < allowed:
                    self._times.append(now)
                    return
                wait = self._times[len(self._times) - allowed] + self.window - now
            if stop is None:
                self._sleep(max(wait, 0.001))
            elif stop.wait(max(wait, 0.001)):
                raise Stopped()


def _status_error(what: str, status: int, body: bytes, retry_after: str | None) -> ImdsError:
    """The error for a reply other than 200, with the start of its body (IMDS explains itself there)."""
    snippet = body[:200].decode("utf-8", "replace").strip()
    snippet = "".join(ch if ch.isprintable() else " " for ch in snippet)
    return ImdsError(f"{what}: HTTP {status}" + (f" ({snippet})" if snippet else ""), code=status,
                     retryable=is_retryable_status(status), retry_after=parse_retry_after(retry_after))


class Stopped(ImdsError):
    """The request was abandoned because the process is stopping."""

    def __init__(self) -> None:
        super().__init__("stopping")

    @property
    def kind(self) -> str:
        return "stopped"


class ReplyTooLarge(ImdsError):
    """The reply was longer than the cap; the connection was dropped without reading the rest."""

    def __init__(self, what: str, limit: int) -> None:
        super().__init__(f"{what}: reply larger than {limit} bytes (--imds-max-reply-bytes); connection "
                         "dropped", retryable=True)

    @property
    def kind(self) -> str:
        return "too_large"


def _connection(endpoint: str) -> Connection:
    """An HTTP/1.1 connection to IMDS whose every step honours the deadline its caller sets."""
    parts = urlsplit(endpoint)
    context = None
    if parts.scheme == "https":  # a test endpoint: IMDS itself is plain HTTP, and then ssl is never loaded
        import ssl

        context = ssl.create_default_context()
    return Connection(parts.hostname or "", parts.port or (443 if context else 80), context=context,
                      connect_timeout=CONNECT_TIMEOUT, deadline=Deadline(CONNECT_TIMEOUT, stopped=Stopped))


class ImdsClient:
    """Talks to one IMDS endpoint. Thread-safe; every request goes through the shared rate limiter.

    Every request has a deadline (`timeout`, or `first_timeout` for the very first Scheduled Events call)
    that bounds the whole exchange however the bytes arrive, and ends at once when `stop` is set. Replies
    are read up to `max_reply_bytes`; a longer one is an error and its connection is dropped.
    """

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        api_version: str = DEFAULT_API_VERSION,
        timeout: float = 2.0,
        first_timeout: float = FIRST_CALL_TIMEOUT,
        limiter: RateLimiter | None = None,
        observe: RequestObserver | None = None,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
        stop: threading.Event | None = None,
    ) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.api_version = api_version
        self.timeout = timeout
        self.first_timeout = first_timeout
        self.limiter = limiter or RateLimiter()
        self.max_reply_bytes = max_reply_bytes
        self.stop = stop
        self._observe = observe
        self._enabled = False
        self._headers = {"Metadata": "true", "User-Agent": USER_AGENT, "Accept": "application/json"}
        self._events_target = f"{SCHEDULED_EVENTS_PATH}?{urlencode({'api-version': api_version})}"
        self._last_reply: tuple[bytes, Document] | None = None
        # Polls (the same GET every second, forever) keep one connection alive and send prepared bytes
        # (imds/wire.py); everything else is rare and opens a connection of its own.
        self._poll = PreparedGet(_connection(self.endpoint), self._events_target, self._headers)
        self._poll_lock = threading.Lock()

    def close(self) -> None:
        with self._poll_lock:
            self._poll.close()

    @property
    def shortest_poll_interval(self) -> float:
        """Polls spaced closer than this would wait on the rate limiter (they leave POLL_RESERVE free).
        The 10 ms over the exact share lets a cadence that was pushed once (a slow reply, a retry)
        settle again instead of queueing on the limiter in bursts."""
        return self.limiter.window / max(1, self.limiter.limit - POLL_RESERVE) + 0.01

    def _exchange(self, method: str, target: str, body: bytes | None, deadline: Deadline) -> Reply:
        """Any request but the poll, on a connection of its own; the body at most max_reply_bytes."""
        conn = _connection(self.endpoint)
        headers = dict(self._headers)
        if body is not None:
            headers["Content-Type"] = "application/json"
        wire = Wire(conn)
        try:
            return wire.send(request_bytes(conn, method, target, headers, body), deadline, self.max_reply_bytes)
        finally:
            wire.close()

    def _call(self, method: str, path: str, params: dict[str, str] | None, timeout: float, body: Any = None,
              reserve: int = 0, parse: Callable[[bytes], T] | None = None, poll: bool = False) -> T | bytes:
        """A request within `timeout` seconds, observed once with its outcome: the HTTP status, `error`
        (transport or deadline), `too_large`, or `invalid` (a 200 whose body `parse` refused). The poll
        (`poll`) is the Scheduled Events GET on the kept-alive connection, its bytes prepared."""
        self.limiter.acquire(reserve, self.stop)
        started = time.monotonic()
        code = "error"
        deadline = Deadline(timeout, self.stop, Stopped)
        try:
            if poll:
                with self._poll_lock:
                    reply = self._poll.exchange(deadline, self.max_reply_bytes)
            else:
                payload = json.dumps(body).encode() if body is not None else None
                reply = self._exchange(method, f"{path}?{urlencode(params or {})}", payload, deadline)
            status = reply.status
            code = str(status)
            if status != 200:
                raise _status_error(f"{method} {path}", status, reply.body, reply.retry_after)
            if parse is None:
                return reply.body
            try:
                return parse(reply.body)
            except DocumentError:
                code = "invalid"
                raise
        except DocumentError:
            raise
        except Stopped:
            code = "stopped"  # not an outcome of IMDS: not counted
            raise
        except TooLarge:
            code = "too_large"
            raise ReplyTooLarge(f"{method} {path}", self.max_reply_bytes) from None
        except ImdsError:
            raise
        except TimeoutError:
            raise ImdsError(f"{method} {path}: no complete answer within {timeout:g} s", retryable=True) from None
        except (OSError, ValueError) as exc:  # ValueError: wire.ProtocolError
            reason = str(exc) or type(exc).__name__
            raise ImdsError(f"{method} {path}: connection failed ({reason[:200]})", retryable=True) from None
        finally:
            if self._observe is not None and code != "stopped":
                self._observe(method, code, time.monotonic() - started)

    def _parse_events(self, body: bytes) -> Document:
        # Most polls return the bytes of the last good reply: documents are immutable, so hand back the same
        # one, without decoding, checking or parsing again (the poller takes it as "nothing changed"). Only a
        # reply that parsed is remembered, so a bad reply repeated is refused (and counted) every time.
        if self._last_reply is not None and self._last_reply[0] == body:
            return self._last_reply[1]
        document = parse_document(body)
        self._last_reply = (body, document)
        return document

    def get_scheduled_events(self) -> Document:
        """One poll. Raises ImdsError for HTTP or transport failures, DocumentError for a bad body."""
        if self._enabled:
            document = self._call("GET", SCHEDULED_EVENTS_PATH, None, self.timeout, reserve=POLL_RESERVE,
                                  parse=self._parse_events, poll=True)
        else:
            # Until IMDS has answered once, allow it the two minutes it may need to switch the service on.
            document = self._call("GET", SCHEDULED_EVENTS_PATH, {"api-version": self.api_version},
                                  max(self.timeout, self.first_timeout), reserve=POLL_RESERVE,
                                  parse=self._parse_events)
            self._enabled = True
        assert isinstance(document, Document)
        return document

    def get_compute(self) -> VmInfo:
        info = self._call("GET", COMPUTE_PATH, {"api-version": COMPUTE_API_VERSION}, self.timeout,
                          parse=_parse_compute_reply)
        assert isinstance(info, VmInfo)
        return info

    def start_events(self, event_ids: Sequence[str]) -> None:
        """Approve events: one POST with every id (IMDS answers 200 even for ids already approved)."""
        body = {"StartRequests": [{"EventId": event_id} for event_id in event_ids]}
        self._call("POST", SCHEDULED_EVENTS_PATH, {"api-version": self.api_version}, self.timeout, body)


def _parse_compute_reply(body: bytes) -> VmInfo:
    try:
        data, _ = decode_reply(body)
    except ReplyError as exc:
        raise DocumentError(f"instance metadata: {exc}") from None
    if not isinstance(data, dict):
        raise DocumentError("instance metadata reply is not a JSON object")
    return parse_compute(data)

