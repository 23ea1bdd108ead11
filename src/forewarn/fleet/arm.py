"""The wire to Azure Resource Manager for fleet mode: bearer tokens and deadline-bound HTTPS requests.

Resource Graph queries (resourcegraph.py) and acknowledgements (acknowledge.py) both go through here:
- `Tokens` gets the bearer token of one scope from an azure-identity credential on a thread of its own, so
  waiting for it honours a deadline and the stop signal (a credential's own HTTP calls do not), and keeps it
  until TOKEN_REFRESH_MARGIN before it expires;
- `ArmConnection` sends each request over one kept-alive HTTPS connection with one deadline for the whole
  exchange (forewarn.deadline), reads at most `max_reply_bytes` of the reply, and opens a new connection
  once when the server had closed the kept-alive one.
Both raise the caller's error type (a subclass of `ArmError`), so each client reports failures in its own
terms.
"""

from __future__ import annotations

import http.client
import ipaddress
import os
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import urlsplit

from forewarn import __version__
from forewarn.deadline import Deadline
from forewarn.httpconn import DeadlineConnection
from forewarn.retry import RetryableError

USER_AGENT = f"forewarn/{__version__}"
#: A token is fetched again this long before it expires (azure-core refreshes 300 s early too).
TOKEN_REFRESH_MARGIN = 300.0
CONNECT_TIMEOUT = 5.0


class ArmError(RetryableError):
    """A call to ARM that gave no usable answer. `status` is the HTTP status, or None when there was none
    (transport, deadline, a reply that is too large or not the documented shape)."""

    def __init__(self, message: str, status: int | None = None, retryable: bool = False,
                 retry_after: float | None = None) -> None:
        super().__init__(message, retryable, retry_after)
        self.status = status


class AccessTokenLike(Protocol):
    """What azure-core's AccessToken gives: the token and when it expires (seconds since the epoch)."""

    @property
    def token(self) -> str: ...

    @property
    def expires_on(self) -> int: ...


class TokenCredential(Protocol):
    """azure-core's TokenCredential, which every azure-identity credential implements."""

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessTokenLike: ...


def arm_base(arm_endpoint: str, loopback_http: bool = False) -> tuple[str, str, int]:
    """(base URL, host, port) of ARM's base URL; ValueError unless it is https with no path or query (every
    request carries a bearer token). `loopback_http` also lets `http://` through for a loopback IP address
    and nothing else: the simulated fleet's stand-in (forewarn.simulator.fleet), whose token is worthless
    anywhere else; --arm-endpoint never sets it."""
    parts = urlsplit(arm_endpoint)
    plain = loopback_http and parts.scheme == "http" and is_loopback(parts.hostname)
    if (parts.scheme != "https" and not plain) or not parts.hostname or parts.path.strip("/") or parts.query:
        raise ValueError(f"arm_endpoint must be an https base URL such as https://management.azure.com; "
                         f"got {arm_endpoint!r}")
    return f"{parts.scheme}://{parts.netloc}", parts.hostname, parts.port or (80 if plain else 443)


def is_loopback(host: str | None) -> bool:
    """Whether `host` is a loopback IP address (a name is not: it could resolve anywhere)."""
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def tls_context(arm_endpoint: str, context: ssl.SSLContext | None) -> ssl.SSLContext | None:
    """The TLS trust for requests to `arm_endpoint` (a base from `arm_base`): `context`, else the default;
    None (plain HTTP) for the loopback http base only `arm_base(..., loopback_http=True)` lets through."""
    return None if arm_endpoint.startswith("http://") else context or default_tls_context()


def default_tls_context() -> ssl.SSLContext:
    """Certificates checked against REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE when set, else certifi's bundle:
    the same trust azure-identity's token request has, so one setting covers both."""
    import certifi

    return ssl.create_default_context(
        cafile=os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or certifi.where())


class _Fetch:
    """One token request under way. At most one is, per scope."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.token: AccessTokenLike | None = None
        self.error: BaseException | None = None


class Tokens:
    """The bearer token for one scope, cached until TOKEN_REFRESH_MARGIN before it expires. Failures are
    raised as `error` (retryable: the next call asks again)."""

    def __init__(self, credential: TokenCredential, scope: str, timeout: float,
                 error: Callable[..., ArmError] = ArmError) -> None:
        self.credential = credential
        self.scope = scope
        self.timeout = timeout
        self.error = error
        self._token: AccessTokenLike | None = None
        self._pending: _Fetch | None = None
        self._lock = threading.Lock()

    def forget(self) -> None:
        with self._lock:
            self._token = None

    def bearer(self, stop: threading.Event | None) -> str:
        with self._lock:
            if self._token is not None and self._token.expires_on - time.time() > TOKEN_REFRESH_MARGIN:
                return self._token.token
            if self._pending is None:
                self._pending = _Fetch()
                threading.Thread(target=self._fetch, args=(self._pending,), name="arm-token", daemon=True).start()
            pending = self._pending
        deadline = Deadline(self.timeout, stop)
        try:
            while not pending.done.wait(deadline.slice()):
                pass
        except TimeoutError:
            raise self.error(f"no token for {self.scope} within {self.timeout:g} s", retryable=True) from None
        if pending.token is None:
            error = pending.error
            reason = f"{type(error).__name__}: {str(error)[:300]}" if error else "no token"
            raise self.error(f"no token for {self.scope} ({reason})", retryable=True)
        return pending.token.token

    def _fetch(self, pending: _Fetch) -> None:
        try:
            token = self.credential.get_token(self.scope)
            with self._lock:
                self._token = pending.token = token
        except BaseException as exc:  # handed to the waiter, which reports it
            pending.error = exc
        finally:
            with self._lock:
                self._pending = None
            pending.done.set()


class ArmConnection:
    """One kept-alive HTTPS connection to `host:port`, used by one caller at a time (its lock is the
    caller's). `too_large()` makes the error raised for a reply over `max_reply_bytes`. A `context` of None
    speaks plain HTTP: only to the simulated fleet on loopback (`tls_context`)."""

    def __init__(self, host: str, port: int, context: ssl.SSLContext | None, timeout: float, max_reply_bytes: int,
                 too_large: Callable[[], ArmError]) -> None:
        self.host = host
        self.port = port
        self.context = context
        self.timeout = timeout
        self.max_reply_bytes = max_reply_bytes
        self.too_large = too_large
        self._conn: DeadlineConnection | None = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def send(self, method: str, target: str, payload: bytes | None, headers: dict[str, str],
             deadline: Deadline) -> tuple[int, dict[str, str], bytes]:
        """One request (a new connection when the server had closed the kept-alive one): status, headers
        with lower-case names, and the body. Raises TimeoutError, OSError or HTTPException as they come."""
        headers = {"Accept": "application/json", "Accept-Encoding": "identity", "User-Agent": USER_AGENT, **headers}
        conn, reused = self._conn, True
        if conn is None or conn.stale():
            if conn is not None:
                conn.close()
            conn, reused = self._connect(deadline), False
        conn.deadline = deadline
        self._conn = None
        try:
            status, reply_headers, body, keep = self._exchange(conn, method, target, payload, headers)
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            if not reused:
                raise
            conn = self._connect(deadline)  # the server closed the kept-alive connection: once more, anew
            status, reply_headers, body, keep = self._exchange(conn, method, target, payload, headers)
        if keep:
            self._conn = conn
        else:
            conn.close()
        return status, reply_headers, body

    def _connect(self, deadline: Deadline) -> DeadlineConnection:
        return DeadlineConnection(self.host, self.port, context=self.context,
                                  connect_timeout=min(CONNECT_TIMEOUT, self.timeout), deadline=deadline)

    def _exchange(self, conn: DeadlineConnection, method: str, target: str, payload: bytes | None,
                  headers: dict[str, str]) -> tuple[int, dict[str, str], bytes, bool]:
        """Status, headers, body (at most max_reply_bytes) and whether the connection may be kept. The
        connection is closed on any failure."""
        limit = self.max_reply_bytes
        try:
            conn.request(method, target, body=payload, headers=headers)
            response = conn.getresponse()
            reply_headers = {name.lower(): value for name, value in response.getheaders()}
            if response.length is not None and response.length > limit:
                raise self.too_large()
            data = bytearray()
            while piece := response.read(min(65536, limit + 1 - len(data))):
                data += piece
                if len(data) > limit:
                    raise self.too_large()
        except BaseException:
            conn.close()
            raise
        return response.status, reply_headers, bytes(data), not response.will_close
