"""HTTP/1.1 connections whose every step honours one deadline for the whole request, and a stop signal.

A socket timeout bounds each read, not the request: a reply trickled one byte a second never trips a 2 s
timeout. Here connect, the TLS handshake, every send and every read ask the request's `Deadline` how
long is left and wait at most `Deadline.SLICE` at a time, so a stop signal also ends any wait within that.

`Connection` is the bare socket, for the IMDS client (imds/wire.py reads its replies); the clients built on
http.client (Kubernetes, ARM) use `forewarn.httpconn.DeadlineConnection`, which opens its socket the same
way. This module imports neither http.client nor ssl: an idle collector loads neither (`ssl` alone is
4 MiB of resident memory), and a TLS context given to a connection brings ssl with it.
"""

from __future__ import annotations

import errno
import io
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import ssl


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
        """At most SLICE of what is left (raising as `remaining` does); called before every wait."""
        if self.stop is not None and self.stop.is_set():
            raise self.stopped()
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no complete answer within {self.seconds:g} s")
        return left if left < self.SLICE else self.SLICE

    def within(self, seconds: float) -> Deadline:
        """A deadline `seconds` from now, or this one when it is sooner (with the same stop signal)."""
        return Deadline(min(seconds, self.remaining()), self.stop, self.stopped)


class _Deadlined(Protocol):
    """What a socket asks of its connection: the deadline of the request under way."""

    deadline: Deadline


class _DeadlineReader(io.RawIOBase):
    """The socket as http.client reads it, every read bounded by the request's deadline."""

    def __init__(self, owner: DeadlineSocket) -> None:
        self._owner = owner

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        owner = self._owner
        sock = owner.sock
        deadline = owner.connection.deadline
        while True:
            sock.settimeout(deadline.slice())
            try:
                return sock.recv_into(buffer)
            except owner.again:
                continue

    def close(self) -> None:
        if not self.closed:
            super().close()
            self._owner.release()


class DeadlineSocket:
    """A connected socket whose sends and reads are all bounded by its connection's current deadline (what
    http.client holds as its socket, and what imds/wire.py reads).

    Like the standard library's socket files, a reader keeps the socket open after `close()` until the
    reader is closed too: http.client closes the connection before reading a body that ends with it.
    """

    def __init__(self, sock: socket.socket, connection: _Deadlined, tls: bool) -> None:
        self.sock = sock
        self.connection = connection
        # What a read may raise and simply try again on: the slice ran out, or (TLS) a record only partly
        # arrived within it.
        self.again: tuple[type[BaseException], ...] = (TimeoutError,)
        if tls:
            import ssl

            self.again = (TimeoutError, ssl.SSLWantReadError)
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
            except self.again:
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


def _address_host(host: str) -> str | bytes:
    """The host as getaddrinfo should get it: an ASCII name as bytes, which spares the `idna` codec (and the
    `unicodedata` tables it loads) that a str always goes through."""
    return host.encode("ascii") if host.isascii() else host


def open_socket(host: str, port: int, connection: _Deadlined, context: ssl.SSLContext | None,
                connect_timeout: float) -> DeadlineSocket:
    """A connected socket to `host`:`port` (TLS with `context`), within `connect_timeout` and the connection's
    deadline, whichever ends first; connect and the handshake proceed in slices, so a stop ends them too."""
    deadline = connection.deadline
    family, kind, proto, _, address = socket.getaddrinfo(_address_host(host), port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setblocking(False)
        error = sock.connect_ex(address)
        connect_by = deadline.within(connect_timeout)
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
        if context is not None:
            sock = _handshake(sock, host, context, deadline)
    except BaseException:
        sock.close()
        raise
    return DeadlineSocket(sock, connection, tls=context is not None)


def _handshake(sock: socket.socket, host: str, context: ssl.SSLContext, deadline: Deadline) -> ssl.SSLSocket:
    """The TLS handshake, in slices of the deadline (a peer that stalls it cannot hold it longer)."""
    import ssl

    wrapped = context.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
    while True:
        wrapped.settimeout(deadline.slice())
        try:
            wrapped.do_handshake()
            return wrapped
        except (TimeoutError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            continue


def is_stale(sock: DeadlineSocket | None) -> bool:
    """Whether an idle connection was closed by the server (or has stray bytes): start afresh."""
    if sock is None:
        return False
    # The socket itself: given the wrapper, select would call its fileno() in Python at every poll.
    return bool(select.select([sock.sock], [], [], 0)[0])


class Connection:
    """One connection to `host`:`port` (TLS with `context`) whose every step (connect, the handshake, each
    send and read) honours `deadline`, which the caller sets before each request. Opened by `connect`;
    `sock` is None until then and after `close`."""

    def __init__(self, host: str, port: int, *, context: ssl.SSLContext | None = None,
                 connect_timeout: float = 2.0, deadline: Deadline | None = None) -> None:
        self.host = host
        self.port = port
        self.context = context
        self.connect_timeout = connect_timeout
        self.deadline = deadline or Deadline(connect_timeout)
        self.sock: DeadlineSocket | None = None
        self._readable: select.poll | None = None

    def connect(self) -> DeadlineSocket:
        self.sock = open_socket(self.host, self.port, self, self.context, self.connect_timeout)
        # Asked before every request (every poll): a poll object registered once answers in one call, where
        # select.select builds and parses three lists each time (a third of the cost).
        self._readable = select.poll()
        self._readable.register(self.sock.sock, select.POLLIN)
        return self.sock

    def stale(self) -> bool:
        """As `is_stale`: the server closed the idle connection, or sent stray bytes."""
        readable = self._readable
        return readable is not None and bool(readable.poll(0))

    def close(self) -> None:
        sock, self.sock, self._readable = self.sock, None, None
        if sock is not None:
            sock.close()
