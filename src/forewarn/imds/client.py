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
import http.client
import random
import select
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar
from urllib.parse import urlencode, urlsplit

import requests
from requests.adapters import HTTPAdapter

from forewarn import DEFAULT_API_VERSION, __version__
from forewarn.imds.document import Document, DocumentError, parse_document
from forewarn.imds.instance import COMPUTE_API_VERSION, VmInfo, parse_compute

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


class ImdsError(Exception):
    """A failed IMDS request. `code` is the HTTP status, or None for a transport failure."""

    def __init__(self, message: str, code: int | None = None, retryable: bool = False,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retryable = retryable
        self.retry_after = retry_after

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

    def acquire(self, reserve: int = 0) -> None:
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
            self._sleep(max(wait, 0.001))


class Backoff:
    """Capped exponential backoff with jitter: attempt n waits between half and all of base*2^n."""

    def __init__(self, base: float, cap: float, rng: random.Random | None = None) -> None:
        self.base = base
        self.cap = cap
        self._rng = rng or random.Random()

    def delay(self, attempt: int) -> float:
        ceiling = min(self.cap, self.base * (2 ** min(attempt, 30)))
        return self._rng.uniform(ceiling / 2, ceiling)


def _parse_retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None


def _status_error(what: str, status: int, text: str, retry_after: str | None) -> ImdsError:
    """The error for a reply other than 200, with the start of its body (IMDS explains itself there)."""
    snippet = text[:200].strip().replace("\n", " ")
    return ImdsError(f"{what}: HTTP {status}" + (f" ({snippet})" if snippet else ""), code=status,
                     retryable=is_retryable_status(status), retry_after=_parse_retry_after(retry_after))


class PollConnection:
    """The steady-state Scheduled Events GET over one kept-alive `http.client` connection.

    Polling sends the same GET every second, forever. Through `requests` that costs about 1.3 ms of CPU
    when the process wakes from its sleep (the session, adapter and urllib3 layers run cold each time);
    the same request on the standard library's connection costs about 0.55 ms, which is what puts a poll
    under the 1 ms budget. Only this one request takes the short path: the first call (which may take
    two minutes), instance metadata and approvals go through the `requests` session. Like the session,
    it never consults proxy settings and sends only the headers given.
    """

    def __init__(self, endpoint: str, target: str, headers: dict[str, str], timeout: float) -> None:
        parts = urlsplit(endpoint)
        if parts.scheme == "https":
            self._conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                parts.hostname or "", parts.port, timeout=timeout)
        else:
            self._conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
        self._target = target
        self._headers = headers
        self._lock = threading.Lock()  # one request at a time on the connection

    def get(self) -> tuple[int, bytes, str | None]:
        """Status, body and Retry-After of one GET; raises OSError or HTTPException on transport failure."""
        with self._lock:
            conn = self._conn
            if conn.sock is not None and select.select([conn.sock], [], [], 0)[0]:
                conn.close()  # the server closed the idle connection (or sent stray bytes): start afresh
            try:
                conn.request("GET", self._target, headers=self._headers)
                response = conn.getresponse()
                body = response.read()
            except BaseException:
                conn.close()
                raise
            if response.will_close:
                conn.close()
            return response.status, body, response.getheader("Retry-After")

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class ImdsClient:
    """Talks to one IMDS endpoint. Thread-safe; every request goes through the shared rate limiter."""

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        api_version: str = DEFAULT_API_VERSION,
        timeout: float = 2.0,
        first_timeout: float = FIRST_CALL_TIMEOUT,
        limiter: RateLimiter | None = None,
        observe: RequestObserver | None = None,
    ) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.api_version = api_version
        self.timeout = timeout
        self.first_timeout = first_timeout
        self.limiter = limiter or RateLimiter()
        self._observe = observe
        self._enabled = False
        session = requests.Session()
        # Ignore HTTP(S)_PROXY, NO_PROXY and .netrc: IMDS must be reached directly.
        session.trust_env = False
        session.proxies = {}
        session.headers.clear()
        headers = {"Metadata": "true", "User-Agent": USER_AGENT, "Accept": "application/json"}
        session.headers.update(headers)
        adapter = HTTPAdapter(pool_connections=1, pool_maxsize=4, max_retries=0)
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        self._session = session
        self._prepared: dict[tuple[str, str, str], requests.PreparedRequest] = {}
        self._last_reply: tuple[bytes, Document] | None = None
        self._poll = PollConnection(
            self.endpoint, f"{SCHEDULED_EVENTS_PATH}?{urlencode({'api-version': api_version})}",
            headers, timeout)

    def _prepare(self, method: str, path: str, params: dict[str, str], body: Any) -> requests.PreparedRequest:
        """The request, prepared once per (method, path, query) when it has no body: polling sends the same
        GET every second, and preparing it (URL parsing, header merging) was a third of a poll's CPU."""
        if body is not None:
            return self._session.prepare_request(
                requests.Request(method, self.endpoint + path, params=params, json=body))
        key = (method, path, repr(sorted(params.items())))
        prepared = self._prepared.get(key)
        if prepared is None:
            prepared = self._session.prepare_request(requests.Request(method, self.endpoint + path, params=params))
            self._prepared[key] = prepared
        return prepared.copy()

    def close(self) -> None:
        self._session.close()
        self._poll.close()

    @property
    def shortest_poll_interval(self) -> float:
        """Polls spaced closer than this would wait on the rate limiter (they leave POLL_RESERVE free).
        The 10 ms over the exact share lets a cadence that was pushed once (a slow reply, a retry)
        settle again instead of queueing on the limiter in bursts."""
        return self.limiter.window / max(1, self.limiter.limit - POLL_RESERVE) + 0.01

    def _request(self, method: str, path: str, params: dict[str, str], timeout: float,
                 body: Any = None, reserve: int = 0) -> requests.Response:
        self.limiter.acquire(reserve)
        started = time.monotonic()
        code = "error"
        try:
            response = self._session.send(
                self._prepare(method, path, params, body),
                timeout=(min(CONNECT_TIMEOUT, timeout), timeout), allow_redirects=False,
            )
            code = str(response.status_code)
        except requests.Timeout:
            raise ImdsError(f"{method} {path}: no answer within {timeout:g} s", retryable=True) from None
        except requests.ConnectionError as exc:
            raise ImdsError(f"{method} {path}: connection failed ({_reason(exc)})", retryable=True) from None
        except requests.RequestException as exc:
            raise ImdsError(f"{method} {path}: {_reason(exc)}", retryable=True) from None
        finally:
            if self._observe is not None:
                self._observe(method, code, time.monotonic() - started)
        if response.status_code != 200:
            raise _status_error(f"{method} {path}", response.status_code, response.text,
                                response.headers.get("Retry-After"))
        return response

    def _poll_request(self) -> bytes:
        """The steady-state poll on the kept-alive connection; same errors as `_request`."""
        self.limiter.acquire(reserve=POLL_RESERVE)
        started = time.monotonic()
        code = "error"
        what = f"GET {SCHEDULED_EVENTS_PATH}"
        try:
            status, body, retry_after = self._poll.get()
            code = str(status)
        except TimeoutError:
            raise ImdsError(f"{what}: no answer within {self.timeout:g} s", retryable=True) from None
        except (OSError, http.client.HTTPException) as exc:
            reason = str(exc) or type(exc).__name__
            raise ImdsError(f"{what}: connection failed ({reason})", retryable=True) from None
        finally:
            if self._observe is not None:
                self._observe("GET", code, time.monotonic() - started)
        if status != 200:
            raise _status_error(what, status, body[:200].decode("utf-8", "replace"), retry_after)
        return body

    def get_scheduled_events(self) -> Document:
        """One poll. Raises ImdsError for HTTP or transport failures, DocumentError for a bad body."""
        if self._enabled:
            body = self._poll_request()
        else:
            # Until IMDS has answered once, allow it the two minutes it may need to switch the service on.
            timeout = max(self.timeout, self.first_timeout)
            body = self._request("GET", SCHEDULED_EVENTS_PATH, {"api-version": self.api_version}, timeout,
                                 reserve=POLL_RESERVE).content
            self._enabled = True
        # Most polls return the bytes of the previous one; documents are immutable, so reuse it.
        if self._last_reply is not None and self._last_reply[0] == body:
            return self._last_reply[1]
        document = parse_document(body)
        self._last_reply = (body, document)
        return document

    def get_compute(self) -> VmInfo:
        response = self._request("GET", COMPUTE_PATH, {"api-version": COMPUTE_API_VERSION}, self.timeout)
        try:
            data = response.json()
        except ValueError:
            raise DocumentError("instance metadata reply is not JSON") from None
        if not isinstance(data, dict):
            raise DocumentError("instance metadata reply is not a JSON object")
        return parse_compute(data)

    def start_events(self, event_ids: Sequence[str]) -> None:
        """Approve events: one POST with every id (IMDS answers 200 even for ids already approved)."""
        body = {"StartRequests": [{"EventId": event_id} for event_id in event_ids]}
        self._request("POST", SCHEDULED_EVENTS_PATH, {"api-version": self.api_version}, self.timeout, body)


def _reason(exc: BaseException) -> str:
    """The innermost cause of a transport error, without the URL noise requests wraps around it."""
    while exc.__context__ is not None and exc.__context__ is not exc:
        exc = exc.__context__
    text = str(exc) or type(exc).__name__
    return text.split(": ", 1)[-1] if "Max retries" in text else text


def with_retries(call: Callable[[], T], attempts: int = 4, backoff: Backoff | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> T:
    """Run `call`, retrying retryable ImdsErrors; for one-shot commands (`events`, `approve`)."""
    backoff = backoff or Backoff(base=0.5, cap=5.0)
    for attempt in range(attempts):
        try:
            return call()
        except ImdsError as exc:
            if not exc.retryable or attempt == attempts - 1:
                raise
            sleep(exc.retry_after if exc.retry_after is not None else backoff.delay(attempt))
    raise AssertionError("unreachable")
