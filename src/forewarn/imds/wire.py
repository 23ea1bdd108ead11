"""IMDS's HTTP/1.1, without http.client: a request's bytes written at once, its reply read with a few byte
operations.

The poll is the same request every second, forever, and nearly every reply is the same few hundred bytes.
Through `http.client` each one built the request header by header and parsed the reply's headers with the
`email` package, which was half the CPU of a poll that changes nothing; here the poll's bytes are built
once (`PreparedGet`). The IMDS client's other requests (instance metadata, approvals) go through the same
reader (`Wire.send`), so an idle collector loads neither http.client nor the `email` package and `ssl` they
import (6 MiB of resident memory together). Connect, the TLS handshake and every send and read go through
`forewarn.deadline.Connection`, so the request's `Deadline` and the stop signal bound them all.

What is read, and the limits that protect it (http.client's own, so a hostile reply fails the same way):
the status line and headers (at most `MAX_HEAD_BYTES` and `MAX_HEADERS`; interim 1xx replies are skipped),
then a body framed by Content-Length, by chunks, or by the end of the connection, at most `limit` bytes.
Anything malformed is a `ProtocolError`, which the client reports as a failed connection.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from forewarn.deadline import Connection, Deadline, DeadlineSocket

#: The status line and headers together (http.client allows 65,536 bytes per line and 100 headers).
MAX_HEAD_BYTES = 65536
MAX_HEADERS = 100
#: A chunk-size line, extensions included.
MAX_CHUNK_LINE = 1024
READ_SIZE = 65536
#: RFC 9112 4: status-line = HTTP-version SP status-code SP [ reason-phrase ] (a reason of visible characters,
#: obs-text, SP and HTAB; its space may be missing, as h11 and http.client allow).
_STATUS_LINE = re.compile(rb"HTTP/1\.([0-9]) ([0-9]{3})(?: [\t \x21-\x7e\x80-\xff]*)?")
#: RFC 9112 5 and RFC 9110 5.5: a token, a colon, a value without NUL, CR, LF or another control but HTAB. A
#: name with a CR, an LF or a space in it hid a framing field from this reader that another reader would
#: see (tests/test_http_differential.py found it).
_FIELD_LINE = re.compile(rb"([-!#$%&'*+.^_`|~0-9A-Za-z]+):([^\x00-\x08\x0a-\x1f\x7f]*)")
#: RFC 9112 7.1: chunk-size = 1*HEXDIG (int(..., 16) also takes "0x", "+", "_" and blanks).
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")


class ProtocolError(ValueError):
    """The reply is not HTTP/1.x as this reader accepts it."""


class TooLarge(Exception):
    """The body is longer than the limit; the connection has been dropped."""


class Reply(NamedTuple):
    """Status, body and the one header the client uses (Retry-After)."""

    status: int
    body: bytes
    retry_after: str | None


def request_bytes(connection: Connection, method: str, target: str, headers: dict[str, str],
                  body: bytes | None = None) -> bytes:
    """A request as http.client writes it: Host and Accept-Encoding first, the body's length (a POST or PUT
    without a body says 0), then `headers`, then the body."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: {_host_header(connection)}", "Accept-Encoding: identity"]
    if body is not None or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body or b'')}")
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


class Wire:
    """Requests on one connection, kept alive between them while the server allows it."""

    def __init__(self, connection: Connection) -> None:
        self._conn = connection
        self._buffer = bytearray()
        self._fills = 0  # reads of the socket so far (PreparedGet tells a reply that came in one read by it)

    def close(self) -> None:
        self._conn.close()
        self._buffer.clear()

    def send(self, request: bytes, deadline: Deadline, limit: int) -> Reply:
        """Send `request` (from `request_bytes`) and read its reply within `deadline`; the body at most
        `limit` bytes (TooLarge beyond, with the connection dropped)."""
        conn = self._conn
        conn.deadline = deadline
        if conn.stale():
            conn.close()  # the server closed the idle connection (or sent stray bytes): start afresh
        try:
            sock = conn.sock
            if sock is None:
                sock = conn.connect()
                self._buffer.clear()
            sock.sendall(request)
            known = self._known_reply(sock)
            if known is not None:
                return known
        except BaseException:
            self.close()
            raise
        return self._reply(limit)

    def _reply(self, limit: int) -> Reply:
        """The reply, read on from what the buffer holds, and what it leaves of the connection."""
        fills = self._fills
        try:
            reply, keep = self._read_reply(limit)
        except BaseException:
            self.close()
            raise
        if not keep or self._buffer:
            self.close()  # the server is done with it, or sent more than one reply: start afresh next time
        else:
            self._kept(reply, in_one_read=self._fills == fills)
        return reply

    def _known_reply(self, sock: DeadlineSocket) -> Reply | None:
        """A reply told from its first bytes without reading it again (PreparedGet); None: read it."""
        return None

    def _kept(self, reply: Reply, in_one_read: bool) -> None:
        """`reply` was read whole and left the connection open; `in_one_read`: `_known_reply`'s read had it all."""

    # --- reading -------------------------------------------------------------------------------
    def _fill(self) -> None:
        self._fills += 1
        data = self._conn.sock.recv(READ_SIZE)  # type: ignore[union-attr]  # connected by `send`
        if not data:
            raise ProtocolError("the connection closed before the reply was complete")
        self._buffer += data

    def _take(self, size: int) -> bytes:
        while len(self._buffer) < size:
            self._fill()
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    def _take_line(self, most: int) -> bytes:
        while (end := self._buffer.find(b"\r\n")) < 0:
            if len(self._buffer) > most:
                raise ProtocolError(f"a line longer than {most} bytes")
            self._fill()
        if end > most:
            raise ProtocolError(f"a line longer than {most} bytes")
        line = bytes(self._buffer[:end])
        del self._buffer[:end + 2]
        return line

    def _read_head(self) -> tuple[int, bool, dict[bytes, bytes]]:
        """Status, whether the server speaks HTTP/1.1, and the headers (names in lower case)."""
        while (end := self._buffer.find(b"\r\n\r\n")) < 0:
            if len(self._buffer) > MAX_HEAD_BYTES:
                raise ProtocolError(f"reply headers longer than {MAX_HEAD_BYTES} bytes")
            self._fill()
        if end > MAX_HEAD_BYTES:
            raise ProtocolError(f"reply headers longer than {MAX_HEAD_BYTES} bytes")
        lines = bytes(self._buffer[:end]).split(b"\r\n")
        del self._buffer[:end + 4]
        status = _STATUS_LINE.fullmatch(lines[0])
        if status is None:
            raise ProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        if len(lines) - 1 > MAX_HEADERS:
            raise ProtocolError(f"more than {MAX_HEADERS} reply headers")
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            field = _FIELD_LINE.fullmatch(line)
            if field is None:
                raise ProtocolError(f"not a header line: {line[:80]!r}")
            name = field[1].lower()
            value = field[2].strip(b" \t")
            # Repeated headers are joined, as http.client's getheader does.
            headers[name] = headers[name] + b", " + value if name in headers else value
        # The framing fields, checked on every head (an interim one, a 204 too), as h11 checks them.
        coding = headers.get(b"transfer-encoding")
        if coding is not None and coding.lower() != b"chunked":  # read as anything else, by another reader too?
            raise ProtocolError(f"a transfer coding other than chunked: {coding[:40]!r}")
        length = headers.get(b"content-length")
        if length is not None and not (length.isdigit() and coding is None):
            # Not a number, a list, or beside Transfer-Encoding (RFC 9112 6.3: "ought to be handled as an error").
            raise ProtocolError(f"Content-Length {length[:40]!r}" + (" with Transfer-Encoding" if coding else ""))
        return int(status[2]), status[1] != b"0", headers

    def _read_reply(self, limit: int) -> tuple[Reply, bool]:
        """The reply, and whether the connection may carry the next request."""
        status, http11, headers = self._read_head()
        while 100 <= status < 200:  # interim replies (100 Continue) precede the real one
            status, http11, headers = self._read_head()
        connection = headers.get(b"connection", b"").lower()
        keep = b"close" not in connection if http11 else b"keep-alive" in connection
        retry_after = headers.get(b"retry-after")
        coding = headers.get(b"transfer-encoding")
        if status in (204, 304):
            body = b""
        elif coding is not None:
            body = self._read_chunked(limit)
        elif (length := headers.get(b"content-length")) is not None:
            if len(length) > 18 or int(length) > limit:
                raise TooLarge()
            body = self._take(int(length))
        else:  # the body ends with the connection
            body = self._read_to_close(limit)
            keep = False
        return Reply(status, body, retry_after.decode("latin-1") if retry_after is not None else None), keep

    def _read_chunked(self, limit: int) -> bytes:
        body = bytearray()
        while True:
            size_text = self._take_line(MAX_CHUNK_LINE).partition(b";")[0].rstrip(b" \t")
            if _CHUNK_SIZE.fullmatch(size_text) is None:
                raise ProtocolError(f"not a chunk size: {size_text[:40]!r}")
            size = int(size_text, 16)
            if size == 0:
                break
            if len(body) + size > limit:
                raise TooLarge()
            body += self._take(size)
            if self._take(2) != b"\r\n":
                raise ProtocolError("a chunk does not end with CRLF")
        for _ in range(MAX_HEADERS + 1):  # trailers, up to the empty line
            line = self._take_line(MAX_HEAD_BYTES)
            if not line:
                return bytes(body)
            if _FIELD_LINE.fullmatch(line) is None:
                raise ProtocolError(f"not a trailer line: {line[:80]!r}")
        raise ProtocolError(f"more than {MAX_HEADERS} trailer lines")

    def _read_to_close(self, limit: int) -> bytes:
        while True:
            if len(self._buffer) > limit:
                raise TooLarge()
            data = self._conn.sock.recv(READ_SIZE)  # type: ignore[union-attr]  # connected by `send`
            if not data:
                body = bytes(self._buffer)
                self._buffer.clear()
                return body
            self._buffer += data


class PreparedGet(Wire):
    """The same GET each time (the poll), its bytes built once."""

    def __init__(self, connection: Connection, target: str, headers: dict[str, str]) -> None:
        super().__init__(connection)
        self._request = request_bytes(connection, "GET", target, headers)
        #: The last reply that came whole in one read and left the connection open, without its Date line,
        #: and what it said: nearly every poll's reply is this one again.
        self._same: tuple[bytes, Reply] | None = None
        self._key: bytes | None = None  # this exchange's first read, without its Date line

    def exchange(self, deadline: Deadline, limit: int) -> Reply:
        """Send the GET and read its reply within `deadline`; the body at most `limit` bytes."""
        conn = self._conn
        same = self._same
        sock = conn.sock
        if same is None or sock is None or self._buffer or conn.stale():
            return self.send(self._request, deadline, limit)
        # Nearly every poll: the connection is open and quiet and the last reply is remembered. This is
        # `send` and `_known_reply` in one, the request and the first read straight on the socket with the
        # deadline's slice as its timeout (what DeadlineSocket does in a call each); a slice that runs out
        # goes on through DeadlineSocket, so the deadline and the stop signal bound it all the same.
        # Every poll runs it, and each call saved is CPU that a quiet collector spends for nothing.
        conn.deadline = deadline
        raw = sock.sock
        request = self._request
        try:
            timeout = deadline.slice()
            if raw.gettimeout() != timeout:
                raw.settimeout(timeout)
            try:
                sent = raw.send(request)
            except TimeoutError:
                sent = 0  # a send that timed out sent nothing
            if sent < len(request):
                sock.sendall(request[sent:])
            try:
                data = raw.recv(READ_SIZE)
            except sock.again:
                data = sock.recv(READ_SIZE)
            known = self._compare(data)
        except BaseException:
            self.close()
            raise
        return known if known is not None else self._reply(limit)

    def _known_reply(self, sock: DeadlineSocket) -> Reply | None:
        """The reply's first read, compared with the last reply that came whole (but for its Date line): the
        same bytes are the same reply. Anything else is read the long way, from those bytes on."""
        self._key = None
        if self._buffer:
            return None
        return self._compare(sock.recv(READ_SIZE))

    def _compare(self, data: bytes) -> Reply | None:
        """The remembered reply when `data`, a reply's first read, is its bytes but for the Date line; else
        None, with `data` kept to be read on from."""
        if not data:
            raise ProtocolError("the connection closed before the reply was complete")
        key = _without_date(data)
        if self._same is not None and self._same[0] == key:
            return self._same[1]
        self._buffer += data
        self._key = key
        return None

    def _kept(self, reply: Reply, in_one_read: bool) -> None:
        # Remembered only when it came in that one read: then its bytes are all of it.
        key = self._key
        self._same = (key, reply) if in_one_read and key is not None and len(key) <= MAX_REMEMBERED else None


#: The longest reply remembered for the comparison (a steady document is a few hundred bytes; the cap keeps
#: a large one from being held twice).
MAX_REMEMBERED = 65536


def _without_date(data: bytes) -> bytes:
    """A reply without its Date header line (the one header that changes every second), up to its end."""
    date = data.find(b"\r\nDate: ")
    if date < 0:
        return data
    after = data.find(b"\r\n", date + 2)
    return data[:date] + (data[after:] if after >= 0 else b"")


def _host_header(connection: Connection) -> str:
    """The Host header as http.client writes it: the port only when it is not the scheme's default."""
    host = f"[{connection.host}]" if ":" in connection.host else connection.host
    default = 443 if connection.context is not None else 80
    return host if connection.port == default else f"{host}:{connection.port}"
