"""A hostile IMDS on loopback, on raw sockets, so it can send what no well-behaved server does.

Each accepted connection reads request heads and answers every request with the peer's current
`Behaviour`: a normal reply, raw bytes, a reply trickled a byte at a time, an endless chunked body, a
huge body, a reset, or nothing at all. Every request is recorded (method, path, arrival time), so tests
can check pacing (requests per second during an outage) and what was sent.
Instance metadata (`/metadata/instance/compute`) gets a fixed good answer unless `compute` is changed.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

COMPUTE = {"name": "vm-hostile", "vmId": "00000000-0000-0000-0000-00000000beef", "location": "westeurope"}


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    at: float  # time.monotonic() on arrival


def document(incarnation: int = 1, *events: dict[str, Any]) -> dict[str, Any]:
    return {"DocumentIncarnation": incarnation, "Events": list(events)}


def event(event_id: str = "E1", event_type: str = "Reboot", status: str = "Scheduled",
          resources: tuple[str, ...] = ("vm-hostile",), not_before: str = "Mon, 19 Sep 2039 18:29:47 GMT",
          **extra: Any) -> dict[str, Any]:
    return {"EventId": event_id, "EventType": event_type, "ResourceType": "VirtualMachine",
            "Resources": list(resources), "EventStatus": status, "NotBefore": not_before,
            "Description": "maintenance", "EventSource": "Platform", "DurationInSeconds": -1, **extra}


def http_reply(status: int, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    head = [f"HTTP/1.1 {status} X", f"Content-Length: {len(body)}", "Content-Type: application/json"]
    head += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class Behaviour:
    """How to answer one request on `conn`. Return False to close the connection afterwards."""

    def answer(self, conn: socket.socket, stop: threading.Event) -> bool:
        raise NotImplementedError


@dataclass
class Reply(Behaviour):
    status: int = 200
    body: bytes | str | dict[str, Any] = field(default_factory=lambda: document(1))
    headers: dict[str, str] = field(default_factory=dict)

    def answer(self, conn: socket.socket, stop: threading.Event) -> bool:
        body = self.body
        data = json.dumps(body).encode() if isinstance(body, dict) else body.encode() if isinstance(body, str) \
            else body
        conn.sendall(http_reply(self.status, data, self.headers))
        return True


@dataclass
class Raw(Behaviour):
    """Exactly these bytes, then close."""
    data: bytes

    def answer(self, conn: socket.socket, stop: threading.Event) -> bool:
        conn.sendall(self.data)
        return False


@dataclass
class Trickle(Behaviour):
    """A well-formed reply sent one byte every `interval` seconds."""
    body: bytes
    interval: float = 0.5

    def answer(self, conn: socket.socket, stop: threading.Event) -> bool:
        for byte in http_reply(200, self.body):
            if stop.wait(self.interval):
                return False
            conn.sendall(bytes([byte]))
        return True


class Hang(Behaviour):
    """Read the request, never answer."""

    def answer(self, conn: socket.socket, stop: threading.Event) -> bool:
        stop.wait()
        return False


@dataclass
class Endless(Behaviour):
    """200 with a chunked body that never ends (as fast as the client reads)."""
    chunk: bytes = b"[" * 65536

    def answer(self, conn: socket.socket, stop: threading.Event) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n")
        frame = f"{len(self.chunk):x}\r\n".encode() + self.chunk + b"\r\n"
        while not stop.is_set():
            conn.sendall(frame)
        return False


@dataclass
class Huge(Behaviour):
    """200 with a Content-Length body of `size` bytes (a long JSON string), sent in full if read."""
    size: int

    def answer(self, conn: socket.socket, stop: threading.Event) -> bool:
        conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {self.size}\r\n\r\n".encode())
        block = b" " * 65536
        left = self.size
        while left > 0 and not stop.is_set():
            piece = block[:min(left, len(block))]
            conn.sendall(piece)
            left -= len(piece)
        return False


class Reset(Behaviour):
    """Close with a TCP reset instead of an answer."""

    def answer(self, conn: socket.socket, stop: threading.Event) -> bool:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return False


class HostileImds:
    """The peer. `behaviour` answers Scheduled Events requests; it may be swapped at any time."""

    def __init__(self, behaviour: Behaviour | None = None) -> None:
        self.behaviour: Behaviour = behaviour or Reply()
        self.compute: Behaviour = Reply(body=COMPUTE)
        self.requests: list[Request] = []
        self.on_request: Callable[[Request], None] | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="hostile-imds", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def events_requests(self, method: str | None = None) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.path.startswith("/metadata/scheduledevents")
                    and (method is None or r.method == method)]

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _read_request(self, conn: socket.socket, pending: bytearray) -> Request | None:
        while b"\r\n\r\n" not in pending:
            data = conn.recv(65536)
            if not data:
                return None
            pending += data
        head, _, rest = bytes(pending).partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        body = bytearray(rest)
        while len(body) < length:
            data = conn.recv(65536)
            if not data:
                return None
            body += data
        pending[:] = body[length:]
        return Request(method, path, headers, bytes(body[:length]), time.monotonic())

    def _serve(self, conn: socket.socket) -> None:
        pending = bytearray()
        try:
            while not self._stop.is_set():
                request = self._read_request(conn, pending)
                if request is None:
                    return
                with self._lock:
                    self.requests.append(request)
                if self.on_request is not None:
                    self.on_request(request)
                behaviour = self.compute if request.path.startswith("/metadata/instance") else self.behaviour
                if not behaviour.answer(conn, self._stop):
                    return
        except OSError:
            return
        finally:
            conn.close()

    def close_connections(self) -> None:
        """Close every open connection (as a server does to idle kept-alive ones); keep listening."""
        with self._lock:
            conns, self._conns = list(self._conns), []
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone does not)
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        self._thread.join(5)
