"""The collector's HTTP endpoints: /metrics, /healthz (alive), /readyz (a good poll lately).

One acceptor thread owns every connection while it is waiting for a request: it accepts, reads request
heads without blocking, and drops a connection whose head has not fully arrived within the read timeout
(counted from the connection's start, or from its previous reply, not reset by each byte). Only a
complete head is handed to the bounded worker pool. A flood of silent or trickling clients therefore
costs file descriptors, never threads, and cannot keep a worker from the next Prometheus scrape.
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

_LANDING = b"""<!doctype html><html><head><title>forewarn</title></head><body>
<h1>forewarn</h1><p>Azure Scheduled Events exporter.</p>
<ul><li><a href="metrics">metrics</a></li><li><a href="healthz">healthz</a></li>
<li><a href="readyz">readyz</a></li></ul></body></html>
"""

#: Connections waiting for a request at once; past this the oldest is dropped, so a flood can use up
#: neither the descriptor limit (often 1024) nor the room for new scrapers.
MAX_WAITING = 512
#: After refusing a request, how long its connection is read and discarded before it is closed: closing
#: with unread input sends a reset, which can destroy the refusal before the client read it.
LINGER_SECONDS = 1.0
_READ_CHUNK = 65536


class _Handler(BaseHTTPRequestHandler):
    """Answers one request head that the acceptor has read completely; the reply is built in memory and
    sent by the worker in one write."""

    protocol_version = "HTTP/1.1"
    server_version = "forewarn"
    # A malformed request line would otherwise get an HTTP/0.9 reply: a body without status or headers.
    default_request_version = "HTTP/1.0"

    def __init__(self, head: bytes, client_address: Any, web: MetricsServer) -> None:
        # Deliberately not BaseRequestHandler.__init__, which would read from and serve a socket itself.
        self.rfile = io.BytesIO(head)
        self.reply = io.BytesIO()
        self.wfile = self.reply
        self.client_address = client_address
        self.web = web
        self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.client_address[0], *args)

    def handle_expect_100(self) -> bool:
        # No endpoint takes a body: never invite one with "100 Continue".
        return True

    def _send(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:
        if self.headers.get("Transfer-Encoding") or self.headers.get("Content-Length", "0").strip() != "0":
            # The body was never read, so the connection cannot be reused; send_error closes it.
            self.send_error(413, "requests to these endpoints have no body")
            return
        path = urlsplit(self.path).path
        if path == "/metrics":
            body, content_type = self.web.render(self.headers.get("Accept", ""))
            self._send(200, body, content_type)
        elif path == "/healthz":
            self._send(200, b"ok\n")
        elif path == "/readyz":
            ready, reason = self.web.readiness()
            self._send(200 if ready else 503, (reason + "\n").encode())
        elif path == "/":
            self._send(200, _LANDING, "text/html; charset=utf-8")
        else:
            self._send(404, b"not found\n")

    do_HEAD = do_GET


class _Connection:
    __slots__ = ("address", "buffer", "deadline", "scanned", "sock")

    def __init__(self, sock: socket.socket, address: Any, deadline: float) -> None:
        self.sock = sock
        self.address = address
        self.buffer = bytearray()
        self.scanned = 0  # where the search for the end of the head resumes
        self.deadline = deadline

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def _head_end(conn: _Connection) -> int | None:
    """The length of the complete request head at the start of the buffer, or None while incomplete.
    A head ends with an empty line; like http.client, a bare LF is accepted as a line end."""
    start = max(0, conn.scanned - 2)
    ends = [i for i in (conn.buffer.find(b"\n\r\n", start), conn.buffer.find(b"\n\n", start)) if i >= 0]
    conn.scanned = len(conn.buffer)
    if not ends:
        return None
    i = min(ends)
    return i + (3 if conn.buffer.startswith(b"\n\r\n", i) else 2)


def _refusal(code: int, reason: str) -> bytes:
    body = f"{code} {reason}\n".encode()
    return (f"HTTP/1.1 {code} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


class MetricsServer:
    """The one background HTTP server: a selector-driven acceptor and at most `max_connections` worker
    threads, started as requests need them and kept."""

    # socketserver's default backlog is 5: a burst of scrapers connecting at once (many Prometheus
    # replicas, a restart of the monitoring stack) overflowed it and waited 1-3 s for TCP retries.
    request_queue_size = 128

    def __init__(self, host: str, port: int, render: Callable[[str], tuple[bytes, str]],
                 readiness: Callable[[], tuple[bool, str]], read_timeout: float = 10.0,
                 max_connections: int = 16, max_request_bytes: int = 16384) -> None:
        self.render = render
        self.readiness = readiness
        self.read_timeout = read_timeout
        self.max_connections = max_connections
        self.max_request_bytes = max_request_bytes
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((host, port))
            self.socket.listen(self.request_queue_size)
            self.socket.setblocking(False)
        except OSError:
            self.socket.close()
            raise
        self.server_address: tuple[Any, ...] = self.socket.getsockname()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._waiting: dict[_Connection, None] = {}    # in deadline order: the oldest first
        self._lingering: dict[_Connection, None] = {}  # refused, read and discarded until closed
        self._returned: collections.deque[_Connection] = collections.deque()  # kept alive, back from workers
        self._jobs: collections.deque[tuple[_Connection, bytes]] = collections.deque()
        self._busy: set[_Connection] = set()
        self._pool = threading.Condition()
        self._idle_workers = 0
        self._workers: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        shown = str(host) if host not in ("", "0.0.0.0") else "127.0.0.1"  # noqa: S104
        if ":" in shown:
            shown = f"[{shown}]"
        return f"http://{shown}:{port}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._accept_loop, name="metrics-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting, close every connection (a worker blocked on a client that does not read its
        reply is woken by the shutdown) and end the threads."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(2.0)
        with self._pool:
            jobs = list(self._jobs)
            self._jobs.clear()
            busy = list(self._busy)
            self._pool.notify_all()
        for conn, _ in jobs:
            conn.close()
        for conn in busy:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + 1.0
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        for conn in [*self._waiting, *self._lingering, *self._returned]:
            conn.close()
        self._waiting.clear()
        self._lingering.clear()
        self._returned.clear()
        self._selector.close()
        self.socket.close()
        self._wake_r.close()
        self._wake_w.close()

    # --- the acceptor ----------------------------------------------------------------------------
    def _wake(self) -> None:
        # Full (a wake-up is pending anyway) or already closed: either way nothing is lost.
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _accept_loop(self) -> None:
        self._selector.register(self.socket, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        while not self._stopping.is_set():
            # Sleep until the oldest connection's deadline, or indefinitely when none waits: an idle
            # agent stays idle.
            first = [next(iter(d)).deadline for d in (self._waiting, self._lingering) if d]
            timeout = max(0.0, min(first) - time.monotonic()) if first else None
            for key, _ in self._selector.select(timeout):
                if key.fileobj is self.socket:
                    self._accept()
                elif key.fileobj is self._wake_r:
                    self._take_back()
                else:
                    self._read(key.data)
            self._expire(time.monotonic())

    def _accept(self) -> None:
        for _ in range(64):  # a burst at a time, so that reads are not starved by a connect flood
            try:
                sock, address = self.socket.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # out of descriptors: make room, or let workers finish first
                log.warning("web: cannot accept a connection (%s)", exc.strerror or exc)
                if self._waiting:
                    self._drop(next(iter(self._waiting)))
                else:
                    time.sleep(0.05)
                return
            if len(self._waiting) >= MAX_WAITING:
                self._drop(next(iter(self._waiting)))
            sock.setblocking(False)
            # The reply goes out in one write, but keep small replies from waiting on delayed ACKs.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._wait_for_request(_Connection(sock, address, 0.0))

    def _wait_for_request(self, conn: _Connection) -> None:
        conn.deadline = time.monotonic() + self.read_timeout
        self._waiting[conn] = None
        self._selector.register(conn.sock, selectors.EVENT_READ, conn)
        if conn.buffer:
            self._check(conn)  # a pipelined request may already be complete

    def _take_back(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while self._returned:
            conn = self._returned.popleft()
            if len(self._waiting) >= MAX_WAITING:
                self._drop(next(iter(self._waiting)))
            self._wait_for_request(conn)

    def _read(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(_READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
        elif conn in self._waiting:
            conn.buffer += data
            self._check(conn)

    def _check(self, conn: _Connection) -> None:
        end = _head_end(conn)
        limit = self.max_request_bytes
        if end is not None and end <= limit:
            head = bytes(conn.buffer[:end])
            del conn.buffer[:end]
            conn.scanned = 0
            self._selector.unregister(conn.sock)
            del self._waiting[conn]
            self._submit(conn, head)
        elif end is not None or len(conn.buffer) > limit:
            line_end = conn.buffer.find(b"\n")
            if line_end < 0 or line_end >= limit:
                self._refuse(conn, 414, "URI Too Long")
            else:
                self._refuse(conn, 431, "Request Header Fields Too Large")

    def _refuse(self, conn: _Connection, code: int, reason: str) -> None:
        log.debug("%s: refused with %d (request head over %d bytes)", conn.address[0], code, self.max_request_bytes)
        try:
            conn.sock.send(_refusal(code, reason))  # small enough for any socket buffer
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._drop(conn)
            return
        del self._waiting[conn]
        conn.buffer.clear()
        conn.deadline = time.monotonic() + LINGER_SECONDS
        self._lingering[conn] = None

    def _drop(self, conn: _Connection) -> None:
        self._waiting.pop(conn, None)
        self._lingering.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.close()

    def _expire(self, now: float) -> None:
        for connections in (self._waiting, self._lingering):
            while connections:
                conn = next(iter(connections))
                if conn.deadline > now:
                    break
                self._drop(conn)

    # --- the workers -----------------------------------------------------------------------------
    def _submit(self, conn: _Connection, head: bytes) -> None:
        with self._pool:
            self._jobs.append((conn, head))
            if len(self._jobs) > self._idle_workers and len(self._workers) < self.max_connections:
                worker = threading.Thread(target=self._work, name=f"metrics-http-{len(self._workers) + 1}",
                                          daemon=True)
                self._workers.append(worker)
                worker.start()
            else:
                self._pool.notify()

    def _work(self) -> None:
        while True:
            with self._pool:
                while not self._jobs and not self._stopping.is_set():
                    self._idle_workers += 1
                    self._pool.wait()
                    self._idle_workers -= 1
                if self._stopping.is_set():
                    return
                conn, head = self._jobs.popleft()
                self._busy.add(conn)
            keep = False
            try:
                keep = self._answer(conn, head)
            except OSError as exc:
                log.debug("%s: connection lost while answering: %s", conn.address[0], exc)
            except Exception:
                log.exception("web: request from %s failed", conn.address[0])
            with self._pool:
                self._busy.discard(conn)
                keep = keep and not self._stopping.is_set()
                if keep:
                    self._returned.append(conn)
            if keep:
                self._wake()
            else:
                conn.close()

    def _answer(self, conn: _Connection, head: bytes) -> bool:
        """Answer one request; True when the connection stays open for the next."""
        handler = _Handler(head, conn.address, self)
        handler.handle_one_request()
        # A client that does not read its reply holds this worker for at most the read timeout (the
        # timeout bounds the whole sendall); the kernel's send buffer usually takes the reply at once.
        conn.sock.settimeout(self.read_timeout)
        conn.sock.sendall(handler.reply.getvalue())
        conn.sock.setblocking(False)
        return not handler.close_connection


def readiness_check(last_success: Callable[[], float | None], window: float,
                    clock: Callable[[], float] = time.time) -> Callable[[], tuple[bool, str]]:
    def check() -> tuple[bool, str]:
        last = last_success()
        if last is None:
            return False, "no successful IMDS poll yet"
        age = clock() - last
        if age > window:
            return False, f"last successful IMDS poll {age:.0f} s ago (window {window:g} s)"
        return True, "ok"
    return check
