"""forewarn's own HTTP/1.1 readers, held against h11 (the reference) on generated, mutated and hostile input.

The server's request reader (web/server.py: `head_length` finds where a head ends, `parse_head` reads it and
decides the body's framing; the acceptor uses nothing else) and the IMDS reply reader (imds/wire.py,
`Wire._read_reply`) each read the same bytes as an `h11.Connection` of the same role. They must agree on
taking or refusing each message and, when both take it, on what it says: method, target, fields (names in
lower case, values), the body's framing and bytes, and whether the connection goes on. Two readers of one
stream that disagree are how requests get smuggled.

Each difference that is meant is listed below (SERVER_DIFFERENCES, CLIENT_DIFFERENCES) with its reason, and
the test accepts a disagreement only when one of them explains it. Line ends: both readers take CRLF or a
bare LF (RFC 9112 2.2 lets a recipient take a bare LF); a CR not followed by LF is refused by both.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from typing import Any

import h11
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forewarn.imds.wire import ProtocolError, TooLarge, Wire
from forewarn.web.server import HttpServer, Refusal, Request, Response, head_length, parse_head

#: The body limit the reader is driven with: a server that takes bodies (the fleet's Event Grid route).
MAX_BODY = 4096

# --- what each reader makes of a byte stream ------------------------------------------------------------


@dataclass(frozen=True)
class Took:
    """One message both readers may take: what it says."""

    method: bytes
    target: bytes
    version: bytes
    fields: tuple[tuple[bytes, bytes], ...]  # names in lower case
    framing: str  # "content-length N", "chunked" or "none"
    body: bytes
    keep_alive: bool


@dataclass(frozen=True)
class Refused:
    status: int | None  # forewarn's status; None for h11


@dataclass(frozen=True)
class Incomplete:
    """The stream ends inside a message: the reader waits for more. `head`: h11 read the head already (and
    took it), what it says."""

    head: Took | None = None


Outcome = Took | Refused | Incomplete


def forewarn_reads(data: bytes) -> list[tuple[int, Outcome]]:
    """The requests the server reads from `data` on one connection, each with where it starts, as the
    acceptor reads them (`HttpServer._next_request`): until a refusal, an incomplete request, or a request
    after which the connection closes. (Inputs here stay far below the head limit, 16 KiB, checked before.)"""
    out: list[tuple[int, Outcome]] = []
    offset = 0
    while offset < len(data):
        rest = data[offset:]
        end = head_length(rest)
        if end is None:
            out.append((offset, Incomplete()))
            break
        head = parse_head(rest[:end], MAX_BODY)
        if isinstance(head, Refusal):
            out.append((offset, Refused(head.status)))
            break
        if len(rest) < end + head.body_length:
            out.append((offset, Incomplete()))
            break
        fields = tuple((name.lower().encode("latin-1"), value.encode("latin-1"))
                       for name, value in head.headers.items())
        framing = f"content-length {head.body_length}" if "content-length" in head.headers else "none"
        out.append((offset, Took(head.method.encode(), head.target.encode(), b"%d.%d" % head.version, fields,
                                 framing, rest[end:end + head.body_length], head.keep_alive)))
        offset += end + head.body_length
        if not head.keep_alive:
            break
    return out


def h11_reads(data: bytes) -> list[Outcome]:
    """The requests an h11 server connection reads from `data`, answering each (so that it reads on) while
    the connection stays open."""
    if not data:
        return []  # h11 reads an empty receive_data as the end of the stream
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    out: list[Outcome] = []
    request: h11.Request | None = None
    body = b""
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            out.append(Refused(None))
            return out
        if event is h11.NEED_DATA:
            if request is not None:
                out.append(Incomplete(_took(request, body, keep=False)))
            elif conn.trailing_data[0]:
                out.append(Incomplete())
            return out
        if isinstance(event, h11.Request):
            request, body = event, b""
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert request is not None
            conn.send(h11.Response(status_code=200, headers=[(b"Content-Length", b"0")]))
            conn.send(h11.EndOfMessage())
            keep = conn.our_state is h11.DONE
            out.append(_took(request, body, keep))
            request = None
            if not keep:
                return out
            conn.start_next_cycle()
        else:
            raise AssertionError(f"h11 event not expected here: {event!r} in {data!r}")


def _took(request: h11.Request, body: bytes, keep: bool) -> Took:
    names = [name for name, _ in request.headers]
    framing = ("chunked" if b"transfer-encoding" in names else
               f"content-length {int(dict(request.headers)[b'content-length'])}" if b"content-length" in names
               else "none")
    return Took(request.method, request.target, request.http_version, tuple(request.headers), framing, body, keep)


# --- the differences that are meant ---------------------------------------------------------------------

#: Where forewarn refuses a request h11 takes, and why: each is a policy, never a second reading.
SERVER_DIFFERENCES = {
    "obs-fold": "a field line that starts with SP or HTAB continues the last one for h11 (RFC 9112 5.2 lets a "
                "recipient unfold it); forewarn refuses it with 400, as RFC 9112 5.2 lets a server do: proxies "
                "read folded lines differently",
    "control": "a control character other than NUL, HTAB, CR, LF, VT and FF in a field value (h11 keeps them for "
               "robustness, h11 issue #57); RFC 9110 5.5 makes every CTL but HTAB invalid and forewarn refuses them",
    "chunked": "forewarn takes no chunked request body (411, or 413 where no body is taken); it reads the "
               "Transfer-Encoding exactly as h11 does, and refuses every request that has one",
    "content-length list": "the same Content-Length twice, or as a list (`5, 5`): h11 takes the one number (RFC "
                           "9110 8.6 allows either); forewarn refuses it: one field, one number",
    "version": "HTTP/2 and later in a request line: h11 reads the message, forewarn answers 505",
    "host": "HTTP/1.2 to 1.9 without Host: h11 asks for Host only of exactly HTTP/1.1; forewarn of every 1.x from "
            "1.1 on (RFC 9110 2.5: a higher minor version is read as 1.1)",
    "size": "a body longer than the server takes (413); forewarn's head limits (414, 431) are checked before this "
            "reader and are far above these inputs",
}
#: Where forewarn and h11 read a request alike but differ on what follows it.
KEEP_ALIVE_DIFFERENCE = ("an HTTP/1.0 request with `Connection: keep-alive`: forewarn keeps the connection (RFC 9112 "
                         "9.3 allows it), h11 never keeps an HTTP/1.0 connection")
#: Where h11 refuses early what forewarn waits for.
EARLY_REFUSAL = ("h11 refuses an incomplete head whose first byte is a control or a space at once; forewarn waits "
                 "for the head to end (and then refuses it) or drops the connection at the read timeout")

_H11_ONLY_CONTROL = re.compile(rb"[\x01-\x08\x0e-\x1f\x7f]")


def server_difference(raw: bytes, theirs: Took) -> str | None:
    """The intended reason forewarn refuses `raw` (a request that h11 took as `theirs`), or None."""
    end = head_length(raw)
    assert end is not None
    lines = [line.removesuffix(b"\r") for line in raw[:end].split(b"\n")[1:]]
    if any(line[:1] in (b" ", b"\t") for line in lines):
        return "obs-fold"
    if any(_H11_ONLY_CONTROL.search(line) for line in lines):
        return "control"
    names = [name for name, _ in theirs.fields]
    if b"transfer-encoding" in names:
        return "chunked"
    lengths = [line.partition(b":")[2] for line in lines if line.partition(b":")[0].lower() == b"content-length"]
    if len(lengths) > 1 or any(b"," in value for value in lengths):
        return "content-length list"
    major, minor = (int(part) for part in theirs.version.split(b"."))
    if major >= 2:
        return "version"
    if (major, minor) > (1, 1) and b"host" not in names:
        return "host"
    if theirs.framing.startswith("content-length") and int(theirs.framing.split()[1]) > MAX_BODY:
        return "size"
    return None


def assert_agree(data: bytes) -> None:
    ours = forewarn_reads(data)
    theirs = h11_reads(data)
    for index, their in enumerate(theirs):
        if index >= len(ours):
            pytest.fail(f"h11 read on after forewarn stopped: {data!r}\nforewarn: {ours}\nh11: {theirs}")
        offset, our = ours[index]
        if isinstance(our, Took) and isinstance(their, Took):
            assert our == their or (
                our == Took(**{**their.__dict__, "keep_alive": True}) and their.version == b"1.0"
            ), f"{data!r}\nforewarn: {our}\nh11: {their}"
            if our.keep_alive != their.keep_alive:  # KEEP_ALIVE_DIFFERENCE: h11 reads no further
                return
            continue
        if isinstance(their, Incomplete) and their.head is not None and not isinstance(our, Incomplete):
            their = their.head  # h11 took the head and waits for the body; forewarn refused the head
        if isinstance(our, Refused) and isinstance(their, Took):
            why = server_difference(data[offset:], their)
            assert why in SERVER_DIFFERENCES, f"forewarn refused ({our.status}) what h11 took: {data!r}\nh11: {their}"
            return
        if isinstance(our, Incomplete) and isinstance(their, Refused):
            assert data[offset:offset + 1] < b"!" and head_length(data[offset:]) is None, EARLY_REFUSAL
            return
        assert type(our) is type(their), f"{data!r}\nforewarn: {ours}\nh11: {theirs}"
    assert len(ours) == len(theirs), f"forewarn read on after h11 stopped: {data!r}\nforewarn: {ours}\nh11: {theirs}"


# --- generated requests, then mutated byte by byte ------------------------------------------------------

TOKENS = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-!#$%&'*+.^_`|~",
                 min_size=1, max_size=12)
VALUES = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
                 max_size=20).map(lambda text: text.strip(" "))
TARGETS = st.sampled_from(["/", "/metrics", "/api/events?code=s3cret", "*", "http://vm-1:9465/metrics", "//x/y",
                           "/a%20b", "/~user/!$&'()*+,;=:@"])


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    """A valid request: method, target and version, Host (almost always), some fields, perhaps a body."""
    method = draw(st.sampled_from(["GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS"]) | TOKENS)
    version = draw(st.sampled_from(["1.1", "1.1", "1.0"]))
    fields = [("Host", draw(st.sampled_from(["vm-1:9465", "127.0.0.1", "x", ""])))]
    fields += draw(st.lists(st.tuples(TOKENS, VALUES), max_size=4))
    body = draw(st.binary(max_size=30)) if draw(st.booleans()) else None
    if body is not None:
        fields.append(("Content-Length", str(len(body))))
    connection = draw(st.sampled_from([None, "close", "keep-alive", "Keep-Alive, Upgrade"]))
    if connection:
        fields.append(("Connection", connection))
    fields = draw(st.permutations(fields))
    end = draw(st.sampled_from(["\r\n", "\r\n", "\n"]))
    blanks = st.sampled_from(["", " ", "  ", "\t"])
    head = f"{method} {draw(TARGETS)} HTTP/{version}{end}"
    head += "".join(f"{name}:{draw(blanks)}{value}{end}" for name, value in fields) + end
    return head.encode("latin-1") + (body or b"")


#: What a mutation puts in: line ends and their pieces, NUL and other controls, blanks, obs-text, separators.
INSERTS = [b"\r", b"\n", b"\r\n", b"\0", b" ", b"\t", b"\x0b", b"\x0c", b"\x01", b"\x1f", b"\x7f", b"\x80", b"\xff",
           b":", b",", b";", b"0", b"5", b"-", b"+"]
#: Whole lines a mutation puts in (or puts in place of one): the framing and Host fields attackers vary.
LINES = [b"Host: other", b"Content-Length: 5", b"Content-Length: 0", b"Content-Length: 05", b"Content-Length: +5",
         b"Content-Length: -1", b"Content-Length: 5, 5", b"Content-Length: 5,5", b"Content-Length:  5 ",
         b"Content-Length: 99999", b"Content-Length: 1e3", b"Transfer-Encoding: chunked",
         b"Transfer-Encoding: xchunked", b"Transfer-Encoding:  chunked", b"Transfer-Encoding: chunked, identity",
         b"Transfer-Encoding: identity, chunked", b"Transfer-Encoding\t: chunked", b"Transfer-Encoding : chunked",
         b" Transfer-Encoding: chunked", b"\tchunked", b"Connection: close", b"Connection: keep-alive",
         b"Expect: 100-continue", b"X-A: a\rContent-Length: 5", b"X: \x00", b"HOST: X"]


@st.composite
def mutated(draw: st.DrawFn, source: st.SearchStrategy[bytes], lines: list[bytes] = LINES) -> bytes:
    """`source`'s bytes changed in one to four places: a byte put in or taken out, a line put in, replaced,
    dropped or repeated, the stream cut short."""
    data = bytearray(draw(source))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["insert", "delete", "line", "replace-line", "drop-line", "duplicate-line",
                                     "truncate"]))
        at = draw(st.integers(0, len(data)))
        if kind == "insert":
            data[at:at] = draw(st.sampled_from(INSERTS))
        elif kind == "delete" and at < len(data):
            del data[at:at + draw(st.integers(1, 3))]
        elif kind == "truncate":
            del data[at:]
        else:
            starts = [0] + [i + 1 for i, byte in enumerate(data) if byte == 0x0A]
            start = draw(st.sampled_from(starts))
            end = data.find(b"\n", start) + 1 or len(data)
            line = draw(st.sampled_from(lines)) + draw(st.sampled_from([b"\r\n", b"\n"]))
            if kind == "line":
                data[start:start] = line
            elif kind == "replace-line":
                data[start:end] = line
            elif kind == "drop-line":
                del data[start:end]
            else:
                data[start:start] = data[start:end]
    return bytes(data)


pipelined = st.lists(requests(), min_size=1, max_size=3).map(b"".join)


@settings(max_examples=200, deadline=None)
@given(pipelined)
def test_valid_requests_are_read_alike(data: bytes) -> None:
    assert_agree(data)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated(pipelined))
def test_mutated_requests_are_taken_or_refused_alike(data: bytes) -> None:
    assert_agree(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200).map(lambda tail: b"GET / HTTP/1.1\r\nHost: x\r\n" + tail))
def test_random_bytes_after_a_request_line_are_read_alike(data: bytes) -> None:
    assert_agree(data)


# --- the classic smuggling shapes, each with its expected outcome ------------------------------------------

#: (request, forewarn's status: 200 when it takes the request, whether h11 takes it). Where the two differ,
#: the comment names the SERVER_DIFFERENCES entry. Each is also sent to a running server (below).
SHAPES = {
    "CL.TE": (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nG",
              400, True),  # chunked
    "TE.CL": (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n"
              b"8\r\nSMUGGLED\r\n0\r\n\r\n", 400, True),  # chunked
    "TE xchunked": (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n\r\n", 400, False),
    "TE space chunked": (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding:  chunked\r\n\r\n0\r\n\r\n",
                         411, True),  # chunked
    "TE chunked, identity": (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, identity\r\n\r\n",
                             400, False),
    "TE gzip, chunked": (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501, False),
    "TE twice": (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n"
                 b"\r\n", 400, False),
    "TE tab before colon": (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding\t: chunked\r\n\r\n", 400, False),
    "TE space before colon": (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding : chunked\r\n\r\n", 400, False),
    "TE folded": (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n",
                  400, True),  # obs-fold
    "lone CR in a value": (b"POST /echo HTTP/1.1\r\nHost: x\r\nX-A: a\rContent-Length: 5\r\n\r\nhello", 400, False),
    "lone CR ending a line": (b"GET /echo HTTP/1.1\rHost: x\r\n\r\n", 400, False),
    "bare LF line ends": (b"GET /echo HTTP/1.1\nHost: x\n\n", 200, True),
    "bare LF and CRLF mixed": (b"POST /echo HTTP/1.1\r\nHost: x\nContent-Length: 2\r\n\nhi", 200, True),
    "NUL in a value": (b"GET /echo HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", 400, False),
    "NUL in the target": (b"GET /echo\x00 HTTP/1.1\r\nHost: x\r\n\r\n", 400, False),
    "CL +5": (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: +5\r\n\r\nhello", 400, False),
    "CL -1": (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400, False),
    "CL 05": (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 05\r\n\r\nhello", 200, True),
    "CL 5, 5": (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5, 5\r\n\r\nhello", 400, True),  # list
    "CL 5 twice": (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello",
                   400, True),  # content-length list
    "CL 5 and 6": (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
                   400, False),
    "CL 5 5": (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5 5\r\n\r\nhello", 400, False),
    "CL superscript two": (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: \xb2\r\n\r\nhi", 400, False),
    "no Host": (b"GET /echo HTTP/1.1\r\n\r\n", 400, False),
    "two Hosts": (b"GET /echo HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400, False),
    "two Hosts in HTTP/1.0": (b"GET /echo HTTP/1.0\r\nHost: x\r\nHost: y\r\n\r\n", 400, False),
    "HTTP/1.0 without Host": (b"GET /echo HTTP/1.0\r\n\r\n", 200, True),
    "space before the first field": (b"GET /echo HTTP/1.1\r\n Host: x\r\n\r\n", 400, False),
    "space in a field name": (b"GET /echo HTTP/1.1\r\nHost: x\r\nX A: b\r\n\r\n", 400, False),
    "method not a token": (b"G@T /echo HTTP/1.1\r\nHost: x\r\n\r\n", 400, False),
    "tab in the request line": (b"GET\t/echo HTTP/1.1\r\nHost: x\r\n\r\n", 400, False),
    "two spaces in the request line": (b"GET  /echo HTTP/1.1\r\nHost: x\r\n\r\n", 400, False),
    "DEL in the target": (b"GET /echo\x7f HTTP/1.1\r\nHost: x\r\n\r\n", 400, False),
    "obs-text in the target": (b"GET /\xe9cho HTTP/1.1\r\nHost: x\r\n\r\n", 400, False),
    "space in the target": (b"GET /echo x HTTP/1.1\r\nHost: x\r\n\r\n", 400, False),
    "empty line first": (b"\r\nGET /echo HTTP/1.1\r\nHost: x\r\n\r\n", 400, False),
    "HTTP/0.9": (b"GET /echo\r\n\r\n", 400, False),
    "HTTP/2.0": (b"GET /echo HTTP/2.0\r\nHost: x\r\n\r\n", 505, True),  # version
}


@pytest.mark.parametrize(("data", "status", "h11_takes"), SHAPES.values(), ids=SHAPES.keys())
def test_each_smuggling_shape_is_read_as_expected_and_as_h11_reads_it(data: bytes, status: int,
                                                                      h11_takes: bool) -> None:
    ours = forewarn_reads(data)[0][1]
    assert (ours.status if isinstance(ours, Refused) else 200 if isinstance(ours, Took) else None) == status
    theirs = h11_reads(data)[0]
    taken = isinstance(theirs, Took) or (isinstance(theirs, Incomplete) and theirs.head is not None)
    assert taken == h11_takes
    assert_agree(data)


def _echo(request: Request) -> Response:
    return Response(200, b"%s %s %s" % (request.method.encode(), request.target.encode(), request.body))


@pytest.fixture(scope="module")
def echo_server() -> Any:
    web = HttpServer("127.0.0.1", 0, max_body_bytes=100, read_timeout=0.5)
    web.route("/echo", _echo, methods=None)
    web.start()
    yield web
    web.stop()


@pytest.mark.parametrize(("data", "status", "h11_takes"), SHAPES.values(), ids=SHAPES.keys())
def test_each_smuggling_shape_gets_its_answer_from_a_running_server_and_nothing_after_a_refusal(
        echo_server: HttpServer, data: bytes, status: int, h11_takes: bool) -> None:
    """A second request hidden behind each shape is never answered: a refusal closes the connection."""
    hidden = b"GET /echo?smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(echo_server.server_address[:2], timeout=5) as sock:
        sock.sendall(data + (hidden if status != 200 else b""))
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 %d " % status), reply[:200]
    assert reply.count(b"HTTP/1.1 ") == 1 and b"smuggled" not in reply, reply
    if status != 200:
        assert b"Connection: close" in reply.partition(b"\r\n\r\n")[0].split(b"\r\n")


# --- the IMDS reply reader (imds/wire.py), client role ----------------------------------------------------

class _Socket:
    """Hands the reader `data` in one piece, then the end of the stream."""

    def __init__(self, data: bytes) -> None:
        self._parts = [data] if data else []

    def recv(self, size: int) -> bytes:
        return self._parts.pop(0) if self._parts else b""


class _Connection:
    def __init__(self, data: bytes) -> None:
        self.sock = _Socket(data)

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    retry_after: bytes | None
    keep_alive: bool


def wire_reads(data: bytes) -> Reply | Refused:
    """The reply the IMDS reader reads from `data` (then the end of the stream), as `Wire.send` takes it."""
    wire = Wire(_Connection(data))  # type: ignore[arg-type]  # what Wire reads through: sock.recv
    try:
        reply, keep = wire._read_reply(1 << 20)
    except (ProtocolError, TooLarge):
        return Refused(None)
    retry_after = reply.retry_after.encode("latin-1") if reply.retry_after is not None else None
    return Reply(reply.status, reply.body, retry_after, keep and not wire._buffer)  # more bytes: closed


def h11_client_reads(data: bytes) -> Reply | Refused:
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/metadata/scheduledevents?api-version=2020-07-01",
                          headers=[("Host", "169.254.169.254"), ("Metadata", "true")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(data)
    conn.receive_data(b"")
    response: h11.Response | None = None
    body = b""
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            return Refused(None)
        if isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert response is not None
            values = [value for name, value in response.headers if name == b"retry-after"]
            names = {name for name, _ in response.headers}
            to_close = response.status_code not in (204, 304) and not names & {b"content-length", b"transfer-encoding"}
            keep = conn.their_state is h11.DONE and not conn.trailing_data[0] and not to_close
            return Reply(response.status_code, body, b", ".join(values) if values else None, keep)
        elif not isinstance(event, h11.InformationalResponse):
            raise AssertionError(f"h11 event not expected here: {event!r} in {data!r}")


#: Where the IMDS reader and h11 differ on a reply, and why.
CLIENT_DIFFERENCES = {
    "close": "the reader closes the connection after a reply whose Connection field holds `close` anywhere "
             "(`closed`, `x-close`), where h11 looks for the token: closing is always safe, the next poll connects",
    "keep-alive 1.0": "an HTTP/1.0 reply with `Connection: keep-alive` keeps the connection for the reader (as "
                      "http.client does), never for h11",
    "content-length list": "the same Content-Length twice or as a list: h11 takes the one number (RFC 9110 8.6 "
                           "allows either); the reader refuses the reply (a failed poll)",
    "bare LF": "a bare LF in the status line or fields: h11 takes it as a line end (RFC 9112 2.2 allows it); the "
               "reader wants CRLF, as IMDS sends, and refuses the reply",
    "obs-fold": "a field line that starts with SP or HTAB: h11 unfolds it (RFC 9112 5.2 allows a client to), the "
                "reader refuses the reply",
    "control": "a control character other than NUL, HTAB, CR, LF, VT and FF in a field value: h11 keeps it (h11 "
               "issue #57), the reader refuses the reply (RFC 9110 5.5: every CTL but HTAB is invalid)",
    "CL with TE": "both Content-Length and Transfer-Encoding: h11 reads the chunks (RFC 9112 6.3), the reader refuses "
                  "the reply, as RFC 9112 6.3 advises (\"ought to be handled as an error\"); IMDS never sends both",
    "trailers": "a trailer field is only checked for its form and dropped by the reader; h11 also holds a "
                "Content-Length or Transfer-Encoding there to its framing rules, and takes a bare LF there: the two "
                "read the same reply once the trailers are taken away",
    "chunk-ext BWS": "blanks between a chunk size and its `;` extension: RFC 9112 7.1.1 allows them (BWS) and the "
                     "reader takes them; h11 refuses them",
}


def client_difference(data: bytes, ours: Reply | Refused, theirs: Reply | Refused) -> str | None:
    """The intended reason the two read `data` differently, or None."""
    heads, rest = [], data.lower()
    while (end := re.search(rb"\n\r?\n", rest)) is not None:  # the heads as h11 finds them, interim ones first
        heads.append(rest[:end.end()])
        rest = rest[end.end():]
        if not re.match(rb"http/1\.[0-9] 1[0-9][0-9]", heads[-1]):
            break
    head = heads[-1] if heads else b""
    lines = [line.removesuffix(b"\r") for line in head.split(b"\n")[1:]]
    fields = [line.partition(b":") for line in lines]
    if isinstance(ours, Refused) and isinstance(theirs, Reply):
        if any(re.search(rb"(?<!\r)\n", one) for one in heads):
            return "bare LF"
        if any(line[:1] in (b" ", b"\t") for line in lines):
            return "obs-fold"
        if any(_H11_ONLY_CONTROL.search(one) for one in heads):
            return "control"
        names = {name.strip() for name, _, _ in fields}
        if {b"content-length", b"transfer-encoding"} <= names:
            return "CL with TE"
    trailers = _trailers_at(rest)
    if trailers is not None:
        without = data[:len(data) - len(rest) + trailers] + b"\r\n"
        ours_without, theirs_without = wire_reads(without), h11_client_reads(without)
        if ours_without == theirs_without or (isinstance(ours_without, Reply) and isinstance(theirs_without, Reply)
                                              and ours_without.body == theirs_without.body):
            return "trailers"
    if isinstance(ours, Reply) and isinstance(theirs, Refused) and re.search(rb"(^|\n)[0-9a-f]+[\t ]+;", rest):
        return "chunk-ext BWS"
    if isinstance(ours, Reply) and isinstance(theirs, Reply) and (ours.status, ours.body, ours.retry_after) == (
            theirs.status, theirs.body, theirs.retry_after):
        connection = b",".join(value for name, _, value in fields if name.strip() == b"connection")
        if not ours.keep_alive and b"close" in connection:
            return "close"
        if ours.keep_alive and head.startswith(b"http/1.0") and b"keep-alive" in connection:
            return "keep-alive 1.0"
    for one in heads:  # an interim reply's fields are checked too
        lengths = [line.partition(b":")[2] for line in one.split(b"\n") if line.partition(b":")[0] == b"content-length"]
        if isinstance(ours, Refused) and (len(lengths) > 1 or any(b"," in value for value in lengths)):
            return "content-length list"
    return None


def _trailers_at(body: bytes) -> int | None:
    """Where the trailer section of a chunked `body` starts, or None."""
    at = 0
    while (end := body.find(b"\r\n", at)) >= 0:
        size = body[at:end].partition(b";")[0].strip()
        if not re.fullmatch(rb"[0-9a-f]{1,8}", size):
            return None
        if int(size, 16) == 0:
            return end + 2
        at = end + 2 + int(size, 16) + 2
    return None


def assert_replies_agree(data: bytes) -> None:
    ours, theirs = wire_reads(data), h11_client_reads(data)
    if ours != theirs:
        assert client_difference(data, ours, theirs) in CLIENT_DIFFERENCES, (
            f"{data!r}\nwire: {ours}\nh11: {theirs}")


@st.composite
def replies(draw: st.DrawFn) -> bytes:
    """A valid reply as IMDS (or something in its place) may send it: interim replies, a status, fields, and a
    body framed by Content-Length, by chunks (with extensions and trailers) or by the end of the stream."""
    body = draw(st.binary(max_size=40))
    status = draw(st.sampled_from([200, 200, 404, 410, 429, 500, 503, 204]))
    version = draw(st.sampled_from(["1.1", "1.1", "1.0"]))
    fields = [("Content-Type", "application/json; charset=utf-8"), ("Server", "Microsoft-IIS/10.0"),
              ("Date", "Fri, 27 Nov 2026 08:00:00 GMT")]
    fields += draw(st.lists(st.tuples(TOKENS, VALUES), max_size=3))
    if status in (429, 503) or draw(st.booleans()):
        fields.append(("Retry-After", str(draw(st.integers(0, 100)))))
    connection = draw(st.sampled_from([None, "close", "keep-alive"]))
    if connection:
        fields.append(("Connection", connection))
    framing = "none" if status == 204 else draw(st.sampled_from(["length", "length", "chunked", "close"]))
    if framing == "length":
        fields.append(("Content-Length", str(len(body))))
        payload = body
    elif framing == "chunked":
        fields.append(("Transfer-Encoding", "chunked"))
        cut = draw(st.integers(0, len(body)))
        parts = [part for part in (body[:cut], body[cut:]) if part]
        payload = b"".join(b"%x%s\r\n%s\r\n" % (len(part), draw(st.sampled_from([b"", b";ext=1"])), part)
                           for part in parts)
        payload += b"0\r\n" + draw(st.sampled_from([b"", b"X-Trailer: 1\r\n"])) + b"\r\n"
    else:
        payload = b"" if status == 204 else body
    fields = draw(st.permutations(fields))
    interim = draw(st.sampled_from(["", "HTTP/1.1 100 Continue\r\n\r\n"]))
    head = interim + f"HTTP/{version} {status} {draw(st.sampled_from(['OK', 'Gone', '', 'Too Many Requests']))}\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in fields) + "\r\n"
    return head.encode("latin-1") + payload


#: Whole lines a mutation puts in a reply: framing fields and their obfuscations, and chunk-size lines.
REPLY_LINES = [*LINES, b"HTTP/1.1 200 OK", b"HTTP/1.1 100 Continue", b"0", b"5", b"0x5", b"+5", b"5 ", b" 5",
               b"1_0", b"5;ext", b"ffffffffffffffffffffff", b"Content-Length: 40", b"Retry-After: 7"]


@settings(max_examples=200, deadline=None)
@given(replies())
def test_valid_replies_are_read_alike(data: bytes) -> None:
    assert_replies_agree(data)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_replies_are_taken_or_refused_alike(data: st.DataObject) -> None:
    assert_replies_agree(data.draw(mutated(replies(), REPLY_LINES)))
