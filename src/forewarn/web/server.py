"""HttpServer: the one background HTTP server, with handlers registered by path and hardened limits.

The agent's endpoints (web/endpoints.py) and the IMDS simulator both run on it. A handler takes a Request
(the whole request: head and body) and returns a Response; a Response can also be an action instead of an
answer: reset the connection, or hold it unanswered for a while (the simulator's faults).

One acceptor thread owns every connection while it is waiting for a request: it accepts, reads requests
without blocking, and drops a connection whose request has not fully arrived within the read timeout
(counted from the connection's start, or from its previous reply, not reset by each byte). Only a
complete request is handed to the bounded worker pool. A flood of silent or trickling clients therefore
costs file descriptors, never threads, and cannot keep a worker from the next Prometheus scrape.
Connections are kept alive (HTTP/1.1, or HTTP/1.0 with `Connection: keep-alive`) and pipelining works.

A route registered `inline` (the agent's /metrics and probes: answers made from memory in well under a
millisecond) is answered by the acceptor itself, without the two thread hand-offs a worker costs (to the
worker and back): about 90 µs of a 0.5 ms kept-alive scrape of 100 events. The acceptor writes without blocking:
what the kernel does not take at once (a client that does not read, a large reply) goes to a worker to
finish, so no client can hold the acceptor. Only on a plain-text port and for requests that need no
password check: a TLS write and a bcrypt belong on a worker.

TLS and authentication live here too, in one place for every endpoint, given by a `Gate` (the web
configuration file, forewarn.web.config). With TLS, the acceptor peeks at a new connection's first byte:
a TLS handshake record is wrapped and its handshake driven without blocking by the same selector, under
the same read deadline; anything else (plain HTTP sent to the TLS port) gets a plain-text 400 at once, as
Go's servers answer, instead of waiting for a handshake that never comes. Authentication is checked in
`_dispatch` before the handler, for every path (unknown ones too) except routes registered `public`.
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import re
import selectors
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol
from urllib.parse import parse_qs, urlsplit

from forewarn.httpdate import rfc1123

if TYPE_CHECKING:
    import ssl

log = logging.getLogger(__name__)

#: Connections waiting for a request at once; past this the oldest is dropped, so a flood can use up
#: neither the descriptor limit (often 1024) nor the room for new scrapers.
MAX_WAITING = 512
#: After refusing a request, how long its connection is read and discarded before it is closed: closing
#: with unread input sends a reset, which can destroy the refusal before the client read it.
LINGER_SECONDS = 1.0
_READ_CHUNK = 65536
#: Header lines in one request, as http.client allows.
_MAX_HEADERS = 100
#: A body longer than this is not copied behind the head: the acceptor writes both in one sendmsg, a worker
#: writes the body after the head. A fleet's /metrics is megabytes (6 MB at 10,000 VMs), and each copy is
#: memory CPython's allocator keeps; the agent's is 86 kB with 100 events, and copying it showed as 7% of the
#: collector's CPU on a scrape (perf).
SEPARATE_BODY_BYTES = 16 * 1024
#: The reason phrase of each status (HTTPStatus(status) is an enum lookup, at every answer).
_PHRASES = {status.value: status.phrase for status in HTTPStatus}


class Headers:
    """A request's headers, read by name whatever its case; a repeated header keeps every value."""

    __slots__ = ("_by_name", "_items")

    def __init__(self, items: list[tuple[str, str]] | None = None) -> None:
        self._items: list[tuple[str, str]] = []
        self._by_name: dict[str, list[str]] = {}
        for name, value in items or ():
            self.add(name, value)

    def add(self, name: str, value: str) -> None:
        self._items.append((name, value))
        self._by_name.setdefault(name.lower(), []).append(value)

    def get(self, name: str, default: Any = None) -> Any:
        """The first value of `name`, or `default`."""
        values = self._by_name.get(name.lower())
        return values[0] if values else default

    def get_all(self, name: str) -> list[str]:
        return list(self._by_name.get(name.lower(), ()))

    def items(self) -> list[tuple[str, str]]:
        """Every header as sent, in order."""
        return list(self._items)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._by_name

    def __getitem__(self, name: str) -> str | None:
        values = self._by_name.get(name.lower())
        return values[0] if values else None

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Headers({self._items!r})"


@dataclass(frozen=True)
class Request:
    """One complete request. `target` is the path and query as sent; `body` is empty unless the server
    takes bodies (max_body_bytes) and the request had one."""

    method: str
    target: str
    headers: Headers
    body: bytes
    client: tuple[Any, ...]

    @property
    def path(self) -> str:
        return urlsplit(self.target).path

    def query(self, name: str) -> str | None:
        """The first value of a query parameter, or None."""
        values = parse_qs(urlsplit(self.target).query).get(name)
        return values[0] if values else None


@dataclass(frozen=True)
class Stream:
    """A body sent part after part as `parts()` yields them, `length` bytes in all (its Content-Length): a
    large body made on the way out is never whole in memory (fleet mode inflates its compressed exposition
    for a client that takes no gzip)."""

    length: int
    parts: Callable[[], Iterator[bytes]]


@dataclass(frozen=True)
class Response:
    """What a handler returns: an answer (status, body, headers), or with `action` something lower-level:
    "reset" closes the connection with a TCP reset and no answer; "hang" holds it unanswered for `hold`
    seconds (less when the server stops) and then resets it. A HEAD request gets the headers alone. A body
    given as parts goes out part after part, never joined into one copy (a fleet's /metrics)."""

    status: int
    body: bytes | tuple[bytes, ...] | Stream = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: Mapping[str, str] = field(default_factory=dict)
    action: Literal["answer", "reset", "hang"] = "answer"
    hold: float = 0.0

    @classmethod
    def reset(cls) -> Response:
        return cls(0, action="reset")

    @classmethod
    def hang(cls, seconds: float) -> Response:
        return cls(0, action="hang", hold=seconds)


Handler = Callable[[Request], Response]


class Gate(Protocol):
    """What the server asks of the web configuration: whether the port speaks TLS (fixed at start), the
    context for each new connection (certificates may have been rotated), whether a request may go on
    (None) or its refusal, and headers added to every answer."""

    @property
    def tls_enabled(self) -> bool: ...

    def tls_context(self) -> ssl.SSLContext | None: ...

    def check(self, request: Request) -> Response | None: ...

    def headers(self) -> Mapping[str, str]: ...


def plain_error(status: int) -> Response:
    """The default answer for the errors the server gives itself: "not found", "method not allowed"..."""
    return Response(status, f"{HTTPStatus(status).phrase.lower()}\n".encode())


@dataclass(frozen=True)
class _Route:
    handler: Handler
    methods: frozenset[str] | None  # None: the handler takes every method
    public: bool = False  # answered without the Gate's authentication (a load balancer's probe)
    inline: bool = False  # answered by the acceptor itself (see the module's docstring)


_date_cache: tuple[int, str] = (0, "")


def http_date(moment: float | None = None) -> str:
    """`moment` (now by default) as an HTTP Date header writes it: "Tue, 24 Nov 2026 09:30:00 GMT"."""
    global _date_cache
    second = int(time.time() if moment is None else moment)
    cached = _date_cache
    if cached[0] == second:
        return cached[1]
    t = time.gmtime(second)
    text = rfc1123(t.tm_wday, t.tm_mday, t.tm_mon, t.tm_year, t.tm_hour, t.tm_min, t.tm_sec)
    _date_cache = (second, text)
    return text


_PYTHON = "Python/{}.{}.{}".format(*sys.version_info[:3])


# --- the request head: one reading, at RFC 9110/9112 strictness -------------------------------------
# Every request is read here once, before anything else sees it: where its body ends, whether its
# connection goes on and what its handler gets all come from this one reading. A request that two readers
# of one stream could read differently (a proxy before forewarn, and forewarn) is refused with 400 and its
# connection closed: that disagreement is how requests get smuggled. docs/security.md lists the rules with
# their RFC sections; tests/test_http_differential.py holds them against h11 on generated and mutated input.
#
# Line ends: CRLF, or a bare LF (RFC 9112 2.2 lets a recipient take one; h11 and http.client do). A CR not
# followed by LF is refused wherever it is, so there is exactly one reading of where a line ends.

#: RFC 9110 5.6.2: token = 1*tchar. Methods and field names are tokens.
_TCHARS = r"[-!#$%&'*+.^_`|~0-9A-Za-z]+"
#: RFC 9112 3: request-line = method SP request-target SP HTTP-version, single spaces, the target visible
#: ASCII only (RFC 9112 3.2 and RFC 3986: no control, space or byte past 0x7E); RFC 9112 5: field-line =
#: field-name ":" OWS field-value OWS, no whitespace before the name (obs-fold, RFC 9112 5.2) or the colon
#: (RFC 9112 5.1). What a value holds is checked on the whole head at once (`_CONTROL`); with every CR
#: before an LF, no quantifier here can give back what the next one takes: a hostile head fails in linear time.
_HEAD = re.compile(rf"({_TCHARS}) ([\x21-\x7e]+) HTTP/([0-9])\.([0-9])\r?\n((?:{_TCHARS}:[^\r\n]*\r?\n)*)\r?\n")
_FIELD = re.compile(rf"({_TCHARS}):[\t ]*([^\r\n]*)")
#: RFC 9110 5.5: a field value is visible characters and obs-text, with SP and HTAB between them: no NUL,
#: no other control character (CR and LF end lines, and are checked apart).
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_LENGTH = re.compile(r"[0-9]+")


class Refusal(NamedTuple):
    """Why a request head is refused: the status and a reason in words (never a piece of the request)."""

    status: int
    why: str


class RequestHead(NamedTuple):
    """A request line and its fields as read, and what follows from them: the body's length and whether
    the connection carries another request after this one."""

    method: str
    target: str  # as sent
    version: tuple[int, int]
    headers: Headers
    body_length: int
    keep_alive: bool


def parse_head(head: bytes, max_body_bytes: int) -> RequestHead | Refusal:
    """The request `head` (request line and fields, up to and with the empty line), or the Refusal of a
    request that cannot be taken: 400 for anything malformed, for no Host field in HTTP/1.1 or several in any
    version (RFC 9112 3.2), and for framing that two readers could read differently; 505 from HTTP/2 on;
    431 past 100 fields. A body is taken only by Content-Length and only up to `max_body_bytes` (413; with
    0, any body); a chunked one gets 411 (413 with 0), other transfer codings 501."""
    text = head.decode("latin-1")
    if text.count("\n") > _MAX_HEADERS + 2:  # the request line, the fields and the empty line
        return Refusal(431, "too many header fields")
    match = _HEAD.fullmatch(text)
    if match is None or _CONTROL.search(text) is not None or text.count("\r") != text.count("\r\n"):
        return Refusal(400, _why(text))
    method, target, major, minor, block = match.groups()
    version = (int(major), int(minor))
    if version[0] >= 2:
        return Refusal(505, f"HTTP version {major}.{minor} is not supported")
    headers = Headers()
    for name, value in _FIELD.findall(block) if block else ():
        headers.add(name, value.rstrip("\t "))
    by_name = headers._by_name
    hosts = by_name.get("host")
    if hosts is None:
        if version >= (1, 1):
            return Refusal(400, "no Host field")
    elif len(hosts) > 1:
        return Refusal(400, "more than one Host field")
    lengths = by_name.get("content-length")
    codings = by_name.get("transfer-encoding")
    if codings is not None:
        if lengths is not None:
            return Refusal(400, "both Content-Length and Transfer-Encoding")
        names = [coding.strip("\t ").lower() for value in codings for coding in value.split(",")]
        if names[-1] != "chunked":  # RFC 9112 6.3: then the body's length cannot be known
            return Refusal(400, "a Transfer-Encoding that does not end with chunked")
        if names != ["chunked"]:
            return Refusal(501, "a transfer coding other than chunked")
        if max_body_bytes == 0:
            return Refusal(413, "no body is taken here")
        return Refusal(411, "a chunked body; send a Content-Length")
    length = 0
    if lengths is not None:
        # One field of ASCII digits: not a list (even "5, 5"), no sign, not the same field twice (RFC 9110
        # 8.6 lets a recipient refuse those).
        if len(lengths) > 1 or _LENGTH.fullmatch(lengths[0]) is None:
            return Refusal(400, "Content-Length is not one number")
        if len(lengths[0]) > 18 or int(lengths[0]) > max_body_bytes:
            return Refusal(413, "the body is too large" if max_body_bytes else "no body is taken here")
        length = int(lengths[0])
    connection = by_name.get("connection")
    if connection is None:
        keep_alive = version >= (1, 1)
    else:  # a list of options, in any case (RFC 9110 7.6.1)
        options = {option.strip("\t ").lower() for value in connection for option in value.split(",")}
        keep_alive = "close" not in options and (version >= (1, 1) or "keep-alive" in options)
    return RequestHead(method, target, version, headers, length, keep_alive)


_TOKEN_ONLY = re.compile(_TCHARS)
_TARGET = re.compile(r"[\x21-\x7e]+")
_VERSION = re.compile(r"HTTP/[0-9]\.[0-9]")
_FIELD_VALUE = re.compile(r"[^\x00-\x08\x0a-\x1f\x7f]*")


def _why(text: str) -> str:
    """The first rule of `_HEAD` that `text` breaks, for the log and the 400's text: never a piece of the
    request itself, whose query may hold a secret."""
    if re.search(r"\r(?!\n)", text):
        return "a CR that does not end a line"
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    words = lines[0].split(" ")
    if not lines[0]:
        return "an empty line before the request line"
    if len(words) != 3:
        return "a request line that is not method, target and version with one space between"
    if _VERSION.fullmatch(words[2]) is None:
        return "bad request version"
    if _TOKEN_ONLY.fullmatch(words[0]) is None:
        return "a method that is not a token"
    if _TARGET.fullmatch(words[1]) is None:
        return "a control character, space or non-ASCII byte in the request target"
    for line in lines[1:]:
        if not line:
            break
        name, colon, value = line.partition(":")
        if line[0] in "\t ":
            return "whitespace before a field name (obs-fold is not accepted)"
        if not colon:
            return "a field line without a colon"
        if _TOKEN_ONLY.fullmatch(name) is None:
            return "a field name that is not a token"
        if _FIELD_VALUE.fullmatch(value) is None:
            return "a NUL in a field value" if "\0" in value else "a control character in a field value"
    return "a malformed head"


class _Exchange:
    """Dispatches one request that the acceptor has read completely and parsed (`parse_head`), and builds
    the reply in memory: the status line and headers in `reply`, a large body apart in `payload`; the
    worker sends them. The connection goes on after HTTP/1.1 unless it asked to close, after HTTP/1.0 only
    when it asked to; every reply carries Date and Server."""

    def __init__(self, head: RequestHead, body: bytes, client_address: Any, http: HttpServer) -> None:
        self.head = head
        self.body = body
        self.client_address = client_address
        self.http = http
        self.reply = io.BytesIO()
        self.close_connection = not head.keep_alive
        self.command = head.method
        self.action: Response | None = None  # a reset or a hang instead of an answer
        #: A large body, sent after `reply` (the status and headers) as it is, rather than copied behind them.
        self.payload: tuple[bytes, ...] | Stream = ()

    def _start(self, status: int, reason: str, headers: list[tuple[str, str]]) -> None:
        lines = [f"HTTP/1.1 {status} {reason}", f"Server: {self.http.server_version} {_PYTHON}",
                 f"Date: {http_date()}"]
        lines += [f"{name}: {value}" for name, value in headers]
        self.reply.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace"))

    def run(self) -> None:
        head = self.head
        target = head.target
        if target.startswith("//"):  # not a scheme-relative URL to whoever reads it later
            target = "/" + target.lstrip("/")
        request = Request(head.method, target, head.headers, self.body, self.client_address)
        try:
            response = self.http._dispatch(request)
        except Exception:
            log.exception("web: %s %s from %s failed", self.command, request.path, self.client_address[0])
            response = self.http.error(500)
        if response.action != "answer":
            self.action = response
            self.close_connection = True
            return
        body = response.body
        length = len(body) if isinstance(body, bytes) else body.length if isinstance(body, Stream) else sum(
            map(len, body))
        headers = [("Content-Type", response.content_type), ("Content-Length", str(length))]
        extra = self.http.gate.headers() if self.http.gate is not None else {}
        for name, value in {**extra, **response.headers}.items():
            headers.append((name, value))
            if name.lower() == "connection":  # a handler may end the connection (or keep an HTTP/1.0 one)
                if value.lower() == "close":
                    self.close_connection = True
                elif value.lower() == "keep-alive":
                    self.close_connection = False
        status = response.status
        phrase = _PHRASES.get(status, "")
        # The request line without its query, which may carry a secret (an Event Grid webhook's ?code=).
        log.debug('%s "%s %s HTTP/%d.%d" %s %s', self.client_address[0], self.command,
                  request.target.split("?", 1)[0], *self.head.version, status, length)
        self._start(status, phrase, headers)
        if self.command == "HEAD":
            return
        if not isinstance(body, bytes):
            self.payload = body
        elif len(body) > SEPARATE_BODY_BYTES:
            self.payload = (body,)
        else:
            self.reply.write(body)


class _Connection:
    __slots__ = ("address", "buffer", "deadline", "head", "head_length", "need", "scanned", "sock", "stage")

    def __init__(self, sock: socket.socket, address: Any, deadline: float,
                 stage: Literal["hello", "handshake", "open"] = "open") -> None:
        self.sock = sock
        self.stage = stage  # with TLS: waiting for the first byte, then the handshake, then requests
        self.address = address
        self.buffer = bytearray()
        self.scanned = 0  # where the search for the end of the head resumes
        self.head: RequestHead | None = None  # once the head is complete: what it says,
        self.head_length = 0  # its length,
        self.need = 0  # and the length of head and body together
        self.deadline = deadline

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def head_length(buffer: bytes | bytearray, start: int = 0) -> int | None:
    """The length of the request head at the start of `buffer` (up to and with the empty line that ends it),
    or None while it is incomplete; `start`: where the search may begin (what was searched already, but
    for the last two bytes). A line ends with LF, CRLF or not (see `parse_head`)."""
    start = max(0, start - 2)
    crlf, lf = buffer.find(b"\n\r\n", start), buffer.find(b"\n\n", start)
    if crlf < 0:
        return lf + 2 if lf >= 0 else None
    return crlf + 3 if lf < 0 or crlf < lf else lf + 2


def _refusal(code: int, reason: str, text: str, server: str) -> bytes:
    body = (text or f"{code} {reason}\n").encode()
    return (f"HTTP/1.1 {code} {reason}\r\nServer: {server} {_PYTHON}\r\nDate: {http_date()}\r\n"
            f"Content-Type: text/plain; charset=utf-8\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


def _reset(sock: socket.socket) -> None:
    # SO_LINGER with a zero timeout makes close() send RST: the client sees "connection reset".
    linger = getattr(socket, "SO_LINGER", None)  # not on every platform forewarn runs on
    with contextlib.suppress(OSError):
        if linger is not None:
            sock.setsockopt(socket.SOL_SOCKET, linger, struct.pack("ii", 1, 0))
        sock.close()


class HttpServer:
    """A background HTTP server: handlers registered by path with `route`, a selector-driven acceptor and
    at most `max_connections` worker threads, started as requests need them and kept.

    Limits: a request must arrive completely within `read_timeout` seconds; its head may have at most
    `max_request_bytes` (414 for a longer request line, 431 for longer headers); a body is refused (413)
    unless `max_body_bytes` allows it, and then it needs a Content-Length (411 otherwise). `error` builds
    the answers the server gives itself (404, 405, 500).
    """

    # socketserver's default backlog is 5: a burst of scrapers connecting at once (many Prometheus
    # replicas, a restart of the monitoring stack) overflowed it and waited 1-3 s for TCP retries.
    request_queue_size = 128

    def __init__(self, host: str, port: int, *, read_timeout: float = 10.0, max_connections: int = 16,
                 max_request_bytes: int = 16384, max_body_bytes: int = 0, name: str = "http",
                 server_version: str = "forewarn", error: Callable[[int], Response] = plain_error,
                 gate: Gate | None = None) -> None:
        self.read_timeout = read_timeout
        self.gate = gate
        self.tls = gate is not None and gate.tls_enabled
        # Reads that found nothing to read yet; with TLS, also a record only partly arrived (ssl is loaded
        # only for a TLS port: 4 MiB an idle collector without TLS does not pay).
        self._not_yet: tuple[type[BaseException], ...] = (BlockingIOError,)
        if self.tls:
            import ssl

            self._not_yet = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)
        self.max_connections = max_connections
        self.max_request_bytes = max_request_bytes
        self.max_body_bytes = max_body_bytes
        self.name = name
        self.server_version = server_version
        self.error = error
        self._routes: dict[str, _Route] = {}
        self._prefixes: list[tuple[str, _Route]] = []  # the longest prefix first
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
        self._jobs: collections.deque[tuple[_Connection, _Exchange, bytes | None]] = collections.deque()
        self._busy: set[_Connection] = set()
        self._pool = threading.Condition()
        self._idle_workers = 0
        self._workers: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the handlers ------------------------------------------------------------------------------
    def route(self, path: str, handler: Handler, methods: Collection[str] | None = ("GET", "HEAD"),
              prefix: bool = False, public: bool = False, inline: bool = False) -> None:
        """Send requests for `path` (or, with `prefix`, every path starting with it) to `handler`; other
        methods than `methods` get 405 (None: the handler takes every method). A `public` route is
        answered without authentication. An `inline` route (not a prefix) is answered by the acceptor
        itself when it can be (see the module's docstring): its handler must answer from memory, at once,
        since the acceptor reads nothing else while it runs. Register before `start`."""
        entry = _Route(handler, frozenset(methods) if methods is not None else None, public, inline and not prefix)
        if prefix:
            self._prefixes = sorted([*self._prefixes, (path, entry)], key=lambda item: -len(item[0]))
        else:
            self._routes[path] = entry

    def _dispatch(self, request: Request) -> Response:
        path = request.path
        entry = self._routes.get(path) or next((r for p, r in self._prefixes if path.startswith(p)), None)
        if self.gate is not None and (entry is None or not entry.public):
            # Before the 404 too: without credentials, which paths exist is not told either.
            refused = self.gate.check(request)
            if refused is not None:
                return refused
        if entry is None:
            return self.error(404)
        if entry.methods is not None and request.method not in entry.methods:
            refused = self.error(405)
            return Response(refused.status, refused.body, refused.content_type,
                            {**refused.headers, "Allow": ", ".join(sorted(entry.methods))})
        return entry.handler(request)

    # --- start and stop ----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        shown = str(host) if host not in ("", "0.0.0.0") else "127.0.0.1"  # noqa: S104
        if ":" in shown:
            shown = f"[{shown}]"
        return f"{'https' if self.tls else 'http'}://{shown}:{port}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._accept_loop, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting, close every connection (a worker blocked on a client that does not read its
        reply is woken by the shutdown, one holding a connection unanswered is woken too) and end the
        threads."""
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
        for conn, _, _ in jobs:
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
                elif key.data.stage == "open":
                    self._read(key.data)
                elif key.data.stage == "hello":
                    self._hello(key.data)
                else:
                    self._handshake(key.data)
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
            self._wait_for_request(_Connection(sock, address, 0.0, "hello" if self.tls else "open"))

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

    def _hello(self, conn: _Connection) -> None:
        """The first byte on a TLS port: a handshake record (0x16) is wrapped and its handshake begun;
        anything else is refused in plain text, so a client speaking HTTP learns why at once."""
        try:
            first = conn.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return
        except OSError:
            first = b""
        if not first:
            self._drop(conn)
            return
        context = self.gate.tls_context() if self.gate is not None else None
        if first != b"\x16" or context is None:
            conn.stage = "open"  # read and discarded from now on, as any refused connection is
            self._refuse(conn, 400, "Bad Request", "Client sent an HTTP request to an HTTPS server.\n")
            return
        self._selector.unregister(conn.sock)
        try:
            conn.sock = context.wrap_socket(conn.sock, server_side=True, do_handshake_on_connect=False)
        except (OSError, ValueError) as exc:
            log.debug("%s: cannot start TLS: %s", conn.address[0], exc)
            self._waiting.pop(conn, None)
            conn.close()
            return
        conn.stage = "handshake"
        self._selector.register(conn.sock, selectors.EVENT_READ, conn)
        self._handshake(conn)

    def _handshake(self, conn: _Connection) -> None:
        """One step of a non-blocking TLS handshake; the connection's read deadline bounds all of them."""
        import ssl  # loaded already: the port speaks TLS

        assert isinstance(conn.sock, ssl.SSLSocket)
        try:
            conn.sock.do_handshake()
        except ssl.SSLWantReadError:
            self._selector.modify(conn.sock, selectors.EVENT_READ, conn)
            return
        except ssl.SSLWantWriteError:
            self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
            return
        except OSError as exc:  # refused: a version below the minimum, no client certificate, ...
            log.debug("%s: TLS handshake failed: %s", conn.address[0], exc)
            self._drop(conn)
            return
        conn.stage = "open"
        self._selector.modify(conn.sock, selectors.EVENT_READ, conn)
        self._read(conn)  # the request may have come with the handshake's last flight

    def _read(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(_READ_CHUNK)
            # TLS: the rest of a record already decrypted is in OpenSSL's buffer, which no selector sees.
            pending = getattr(conn.sock, "pending", None)  # an SSLSocket's
            while data and pending is not None and pending():
                data += conn.sock.recv(_READ_CHUNK)
        except self._not_yet:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
        elif conn in self._waiting:
            conn.buffer += data
            self._check(conn)

    def _check(self, conn: _Connection) -> None:
        """Answer each complete request (on this thread for an inline route, else by a worker); refuse one
        that cannot be taken. Pipelined requests answered here are taken in turn, not by recursion, and not
        past a stop."""
        while self._next_request(conn) and not self._stopping.is_set():
            pass

    def _next_request(self, conn: _Connection) -> bool:
        """Take the request at the start of the buffer if it is complete: True when it was answered here and
        the connection waits for the next one (which may be in the buffer already). A request that cannot be
        taken is refused, and its connection closed, as soon as its head is complete."""
        if not conn.need:
            end = head_length(conn.buffer, conn.scanned)
            conn.scanned = len(conn.buffer)
            limit = self.max_request_bytes
            if end is None or end > limit:
                if end is None and len(conn.buffer) <= limit:
                    return False
                line_end = conn.buffer.find(b"\n")
                if line_end < 0 or line_end >= limit:
                    self._refuse(conn, 414, "URI Too Long")
                else:
                    self._refuse(conn, 431, "Request Header Fields Too Large")
                return False
            parsed = parse_head(bytes(conn.buffer[:end]), self.max_body_bytes)
            if isinstance(parsed, Refusal):
                status, why = parsed
                self._refuse(conn, status, _PHRASES[status], f"{status} {_PHRASES[status]}: {why}\n")
                return False
            conn.head, conn.head_length, conn.need = parsed, end, end + parsed.body_length
        if len(conn.buffer) < conn.need:
            return False
        head = conn.head
        assert head is not None  # set with `need`
        body = bytes(conn.buffer[conn.head_length:conn.need]) if head.body_length else b""
        del conn.buffer[:conn.need]
        conn.scanned = conn.head_length = conn.need = 0
        conn.head = None
        exchange = _Exchange(head, body, conn.address, self)
        if self._inline(head.target):
            return self._answer_here(conn, exchange)
        self._hand_over(conn, exchange, None)
        return False

    def _inline(self, target: str) -> bool:
        """Whether the acceptor answers this request itself: its route is inline, the port speaks no TLS
        and the route needs no password check. Decided on the target's path as sent; `Request.path`
        reads the same path for every target this matches."""
        if self.tls:
            return False
        entry = self._routes.get(target.split("?", 1)[0])
        return entry is not None and entry.inline and (self.gate is None or entry.public)

    def _answer_here(self, conn: _Connection, exchange: _Exchange) -> bool:
        """Run an inline request's handler and write its reply without blocking; a reply the kernel does not
        take whole (or an answer that is no answer) goes to a worker to finish. True: answered here, and
        the connection waits for its next request, from now on."""
        try:
            exchange.run()  # a handler's own failure is a 500 already; this is the server's
        except Exception:
            log.exception("web: request from %s failed", conn.address[0])
            self._drop(conn)
            return False
        reply = exchange.reply.getvalue()
        if exchange.action is not None or isinstance(exchange.payload, Stream):
            self._hand_over(conn, exchange, reply)
            return False
        parts = [reply, *exchange.payload]  # the head, and the body as the handler made it: not copied
        try:
            sent = conn.sock.sendmsg(parts)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._drop(conn)
            return False
        if sent < sum(map(len, parts)):
            exchange.payload = ()
            self._hand_over(conn, exchange, b"".join(parts)[sent:])
            return False
        if exchange.close_connection:
            self._drop(conn)
            return False
        del self._waiting[conn]  # to the end of the deadline order, counted from this reply
        conn.deadline = time.monotonic() + self.read_timeout
        self._waiting[conn] = None
        return True

    def _hand_over(self, conn: _Connection, exchange: _Exchange, rest: bytes | None) -> None:
        self._selector.unregister(conn.sock)
        del self._waiting[conn]
        self._submit(conn, exchange, rest)

    def _refuse(self, conn: _Connection, code: int, reason: str, text: str = "") -> None:
        log.debug("%s: refused with %d %s", conn.address[0], code, text.rstrip() or reason)
        try:
            conn.sock.send(_refusal(code, reason, text, self.server_version))  # small enough for any socket buffer
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
    def _submit(self, conn: _Connection, exchange: _Exchange, rest: bytes | None) -> None:
        """Give a worker the request to answer (`rest` None), or the `rest` of a reply begun here to send."""
        with self._pool:
            self._jobs.append((conn, exchange, rest))
            if len(self._jobs) > self._idle_workers and len(self._workers) < self.max_connections:
                worker = threading.Thread(target=self._work, name=f"{self.name}-{len(self._workers) + 1}",
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
                conn, exchange, rest = self._jobs.popleft()
                self._busy.add(conn)
            keep = False
            try:
                keep = self._answer(conn, exchange, rest)
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

    def _answer(self, conn: _Connection, exchange: _Exchange, rest: bytes | None) -> bool:
        """Answer one request, or send the `rest` of a reply the acceptor began; True when the connection
        stays open for the next."""
        if rest is None:
            exchange.run()
            rest = exchange.reply.getvalue()
        if exchange.action is not None:
            if exchange.action.action == "hang":
                self._stopping.wait(exchange.action.hold)
            _reset(conn.sock)
            return False
        # A client that does not read its reply holds this worker for at most the read timeout (the
        # timeout bounds the whole sendall); the kernel's send buffer usually takes the reply at once.
        conn.sock.settimeout(self.read_timeout)
        conn.sock.sendall(rest)
        payload = exchange.payload
        sent = 0
        for part in payload.parts() if isinstance(payload, Stream) else payload:
            conn.sock.sendall(part)
            sent += len(part)
        if isinstance(payload, Stream) and sent != payload.length:
            # The client would wait for bytes that never come, or read ours as its next reply.
            log.error("web: a reply of %d bytes was announced as %d; closing the connection", sent, payload.length)
            return False
        conn.sock.setblocking(False)
        return not exchange.close_connection
