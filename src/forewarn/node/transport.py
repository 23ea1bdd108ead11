"""The HTTP transport under the Kubernetes client: each request has one deadline, and a stop ends it.

lightkube talks through httpx, whose timeouts bound each step (connect, each read), not the request: an
API server (or a proxy in front of it) that trickles its answer could hold a node action, and forewarn's
shutdown, indefinitely. This transport sends each request over a kept-alive HTTP/1.1 connection from
forewarn.deadline, so connect, TLS handshake, send and every read share one deadline for the whole
request, a set stop signal ends any wait within a quarter second, and an answer is read up to a size cap.
It also spares the default transport's HTTP/2 and async stack (about 3 MiB of memory, docs/kubernetes.md; the
memory budget of node actions is in docs/performance.md).

HTTP proxies are not used: forewarn talks to the API server directly, as a pod does in-cluster.
"""

from __future__ import annotations

import http.client
import ssl
import threading
from collections.abc import Callable
from urllib.parse import urlsplit

import httpx2

from forewarn.deadline import Deadline
from forewarn.httpconn import DeadlineConnection

#: The largest answer read from the API server: a list of a full node's pods is a few MB at most.
MAX_REPLY_BYTES = 32 * 2**20
#: Kept-alive connections held for reuse (node actions run a few requests at once at most).
IDLE_CONNECTIONS = 4
#: Errors that mean a kept-alive connection had been closed by the server before the request reached it.
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


class ReplyTooLarge(httpx2.ReadError):
    """The API server's answer exceeded MAX_REPLY_BYTES; the connection was dropped."""


class DeadlineTransport(httpx2.BaseTransport):
    """httpx transport for one API server (`server`, its base URL); `context` for https.

    `timeout`: seconds each request may take in all. `stop`: when set, waits end with `stopped()`.
    """

    def __init__(self, server: str, context: ssl.SSLContext | None, *, timeout: float,
                 stop: threading.Event, stopped: Callable[[], BaseException],
                 max_reply_bytes: int = MAX_REPLY_BYTES, connect_timeout: float = 5.0) -> None:
        parts = urlsplit(server)
        self.tls = parts.scheme == "https"
        if self.tls and context is None:
            raise ValueError(f"an https server needs a TLS context: {parts.scheme}://{parts.hostname}")
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.tls else 80)
        self.context = context if self.tls else None
        self.timeout = timeout
        self.stop = stop
        self.stopped = stopped
        self.max_reply_bytes = max_reply_bytes
        self.connect_timeout = connect_timeout
        self._idle: list[DeadlineConnection] = []
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        deadline = Deadline(self.timeout, self.stop, self.stopped)
        body = request.read()
        try:
            reused, conn = self._connection(deadline)
            try:
                status, headers, content, keep = self._exchange(conn, request, body)
            except _STALE:
                if not reused:
                    raise
                # The server had closed the kept-alive connection: once more, on a new one.
                conn = DeadlineConnection(self.host, self.port, context=self.context,
                                          connect_timeout=self.connect_timeout, deadline=deadline)
                status, headers, content, keep = self._exchange(conn, request, body)
        except TimeoutError as exc:
            raise httpx2.ReadTimeout(f"no complete answer within {self.timeout:g} s ({exc})",
                                     request=request) from None
        except (OSError, http.client.HTTPException) as exc:
            raise httpx2.ConnectError(f"{type(exc).__name__}: {exc}", request=request) from None
        if keep:
            self._release(conn)
        return httpx2.Response(status, headers=headers, content=content, request=request)

    def _connection(self, deadline: Deadline) -> tuple[bool, DeadlineConnection]:
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if conn.stale():
                    conn.close()
                    continue
                conn.deadline = deadline
                return True, conn
        return False, DeadlineConnection(self.host, self.port, context=self.context,
                                         connect_timeout=self.connect_timeout, deadline=deadline)

    def _release(self, conn: DeadlineConnection) -> None:
        with self._lock:
            if len(self._idle) < IDLE_CONNECTIONS:
                self._idle.append(conn)
                return
        conn.close()

    def _exchange(self, conn: DeadlineConnection, request: httpx2.Request,
                  body: bytes) -> tuple[int, list[tuple[str, str]], bytes, bool]:
        """One request on `conn`: status, headers, the whole body (at most max_reply_bytes), and whether
        the connection may be kept. The connection is closed on any failure."""
        try:
            conn.putrequest(request.method, request.url.raw_path.decode("ascii"), skip_host=True,
                            skip_accept_encoding=True)
            for name, value in request.headers.multi_items():
                if name.lower() == "accept-encoding":
                    continue   # answers are read as sent: ask for them uncompressed
                conn.putheader(name, value)
            conn.putheader("Accept-Encoding", "identity")
            if body and "content-length" not in request.headers:
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            response = conn.getresponse()
            limit = self.max_reply_bytes
            if response.length is not None and response.length > limit:
                raise ReplyTooLarge(f"the answer to {request.method} {request.url.path} exceeds {limit} bytes",
                                    request=request)
            data = bytearray()
            while piece := response.read(min(65536, limit + 1 - len(data))):
                data += piece
                if len(data) > limit:
                    raise ReplyTooLarge(f"the answer to {request.method} {request.url.path} exceeds {limit} "
                                        "bytes", request=request)
        except BaseException:
            conn.close()
            raise
        return response.status, response.getheaders(), bytes(data), not response.will_close
