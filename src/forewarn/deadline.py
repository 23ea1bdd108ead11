"""HTTP/1.1 connections whose every step honours one deadline for the whole request, and a stop signal.

A socket timeout bounds each read, not the request: a reply trickled one byte a second never trips a 2 s
timeout. Here connect, the TLS handshake, every send and every read ask the request's `Deadline` how
long is left and wait at most `Deadline.SLICE` at a time, so a stop signal also ends any wait within that.
The IMDS client and the Kubernetes client (forewarn.node.transport) both talk through `DeadlineConnection`.
"""

from __future__ import annotations

import errno
import http.client
import io
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any


class Stopped(Exception):
    """A stop signal ended the wait (forewarn is stopping); not a failure of the peer."""

    def __init__(self) -> None:
        super().__init__("stopping")


class Deadline:
    """The moment by which a request must be done, and the stop signal that ends it sooner.

    `stopped` makes the exception raised when `stop` is set (each client has its own class for it).
    """

    SLICE = 0.25

    def __init__(self, seconds: float, stop: threading.Event | None = None,
                 stopped: Callable[[], BaseException] = Stopped) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds
        self.stop = stop
        self.stopped = stopped

    def remaining(self) -> float:
        """Seconds left; raises `stopped()` or TimeoutError when there are none."""
        if self.stop is not None and self.stop.is_set():
            raise self.stopped()
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no complete answer within {self.seconds:g} s")
        return left

    def slice(self) -> float:
        return min(self.remaining(), self.SLICE)

    def within(self, seconds: float) -> Deadline:
        """A deadline `seconds` from now, or this one when it is sooner (with the same stop signal)."""
        return Deadline(min(seconds, self.remaining()), self.stop, self.stopped)


class _DeadlineReader(io.RawIOBase):
    """The socket as http.client reads it, every read bounded by the request's deadline."""

    def __init__(self, owner: _DeadlineSocket) -> None:
        self._owner = owner

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        sock = self._owner.sock
        deadline = self._owner.connection.deadline
        while True:
            sock.settimeout(deadline.slice())
            try:
                return sock.recv_into(buffer)
            except TimeoutError:
                continue
            except ssl.SSLWantReadError:  # a TLS record only partly arrived within the slice
                continue

    def close(self) -> None:
        if not self.closed:
            super().close()
            self._owner.release()


class _DeadlineSocket:
    """What http.client holds as its socket: sends and reads both bounded by the current deadline.

    Like the standard library's socket files, a reader keeps the socket open after `close()` until the
    reader is closed too: http.client closes the connection before reading a body that ends with it.
    """

    def __init__(self, sock: socket.socket, connection: DeadlineConnection) -> None:
        self.sock = sock
        self.connection = connection
        self._readers = 0
        self._closed = False

    def _timeout(self, seconds: float) -> None:
        # Nearly always the same slice: setting it again would cost a system call for nothing.
        if self.sock.gettimeout() != seconds:
            self.sock.settimeout(seconds)

    def sendall(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            self._timeout(self.connection.deadline.slice())
            try:
                sent = self.sock.send(view)
            except TimeoutError:
                continue
            view = view[sent:]

    def recv(self, size: int) -> bytes:
        """At most `size` bytes as soon as some arrive (b"" once the peer has closed), within the deadline."""
        deadline = self.connection.deadline
        while True:
            self._timeout(deadline.slice())
            try:
                return self.sock.recv(size)
            except TimeoutError:
                continue
            except ssl.SSLWantReadError:  # a TLS record only partly arrived within the slice
                continue

    def makefile(self, mode: str) -> io.BufferedReader:
        self._readers += 1
        return io.BufferedReader(_DeadlineReader(self))

    def fileno(self) -> int:
        return self.sock.fileno()

    def release(self) -> None:
        self._readers -= 1
        if self._closed and self._readers <= 0:
            self.sock.close()

    def close(self) -> None:
        self._closed = True
        if self._readers <= 0:
            self.sock.close()


class DeadlineConnection(http.client.HTTPConnection):
    """An HTTP/1.1 connection whose every step (connect, TLS handshake, send, each read) honours
    `deadline`, which the caller sets before each request. With `context`, it speaks TLS."""

    def __init__(self, host: str, port: int, *, context: ssl.SSLContext | None = None,
                 connect_timeout: float = 2.0, deadline: Deadline | None = None) -> None:
        super().__init__(host, port)
        self.context = context
        self.connect_timeout = connect_timeout
        self.deadline = deadline or Deadline(connect_timeout)

    def connect(self) -> None:
        family, kind, proto, _, address = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            error = sock.connect_ex(address)
            connect_by = self.deadline.within(self.connect_timeout)
            while error in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EALREADY):
                try:
                    _, writable, failed = select.select([], [sock], [sock], connect_by.slice())
                except TimeoutError:
                    raise TimeoutError(f"no connection within {connect_by.seconds:g} s") from None
                if writable or failed:
                    error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if error:
                raise ConnectionError(error, os.strerror(error))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.context is not None:
                sock = self._handshake(sock)
        except BaseException:
            sock.close()
            raise
        self.sock = _DeadlineSocket(sock, self)

    def _handshake(self, sock: socket.socket) -> ssl.SSLSocket:
        """The TLS handshake, in slices of the deadline (a peer that stalls it cannot hold it longer)."""
        assert self.context is not None
        wrapped = self.context.wrap_socket(sock, server_hostname=self.host, do_handshake_on_connect=False)
        while True:
            wrapped.settimeout(self.deadline.slice())
            try:
                wrapped.do_handshake()
                return wrapped
            except (TimeoutError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                continue

    def stale(self) -> bool:
        """Whether the idle connection was closed by the server (or has stray bytes): start afresh."""
        if self.sock is None:
            return False
        # The socket itself: given the wrapper, select would call its fileno() in Python at every poll.
        raw = self.sock.sock if isinstance(self.sock, _DeadlineSocket) else self.sock
        return bool(select.select([raw], [], [], 0)[0])
