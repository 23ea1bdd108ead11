"""`DeadlineConnection`: http.client's HTTPConnection on a socket whose every step honours one deadline.

For the clients built on http.client (the Kubernetes transport, ARM): connect, the TLS handshake, every
send and every read ask the request's `forewarn.deadline.Deadline` how long is left, exactly as the IMDS
client's bare `forewarn.deadline.Connection` does.
"""

from __future__ import annotations

import http.client
import ssl

from forewarn.deadline import Deadline, DeadlineSocket, is_stale, open_socket


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
        self.sock = open_socket(self.host, self.port, self, self.context, self.connect_timeout)

    def stale(self) -> bool:
        """Whether the idle connection was closed by the server (or has stray bytes): start afresh."""
        return is_stale(self.sock if isinstance(self.sock, DeadlineSocket) else None)
