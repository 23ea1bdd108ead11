"""The web endpoints under clients that misbehave: silent, slow, oversized, or many at once.

The collector's HTTP server must keep answering Prometheus while a flood of slow connections sits on
it, with a bounded number of threads, and must drop what never becomes a request within the read
timeout. Subprocess tests run the real `forewarn run --simulate`; the rest use the HttpServer in-process,
with the agent's endpoints or with handlers of their own (the simulator's needs: bodies, resets, hangs).
"""

from __future__ import annotations

import http.client
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import pytest
import requests

from forewarn.web.endpoints import add_metrics_endpoints, exposition
from forewarn.web.server import HttpServer, Request, Response

from conftest import CollectorProcess, sample, wait_until

SIMULATE = ("--simulate", "quiet")
LAST_SUCCESS = "azure_scheduled_events_imds_last_success_timestamp_seconds"


def connect(port: int, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (raises on the socket's timeout)."""
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def wait_readable(sock: socket.socket, seconds: float) -> bool:
    """Whether the server sends something (or closes) within `seconds`: a check that it does NOT answer."""
    return bool(select.select([sock], [], [], seconds)[0])


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


@pytest.fixture
def serve() -> Iterator[Callable[..., HttpServer]]:
    """Starts HttpServers on free loopback ports (with the given handlers by path) and stops them after."""
    started: list[HttpServer] = []

    def start(routes: dict[str, Callable[[Request], Response]] | None = None,
              setup: Callable[[HttpServer], None] | None = None, **limits: Any) -> HttpServer:
        web = HttpServer("127.0.0.1", 0, **limits)
        for path, handler in (routes or {}).items():
            web.route(path, handler, methods=None)
        if setup is not None:
            setup(web)
        web.start()
        started.append(web)
        return web

    yield start
    for web in started:
        web.stop()


@pytest.fixture
def server(serve: Callable[..., HttpServer]) -> Callable[..., HttpServer]:
    """An HttpServer with the agent's endpoints: /metrics answers `render`, /readyz is ready."""

    def start(read_timeout: float = 10.0, max_connections: int = 4, max_request_bytes: int = 16384,
              render: Callable[[str], tuple[bytes, str]] | None = None) -> HttpServer:
        endpoints = render or (lambda accept: (b"metric 1\n", "text/plain"))
        return serve(setup=lambda web: add_metrics_endpoints(web, exposition(endpoints), lambda: (True, "ok")),
                    read_timeout=read_timeout, max_connections=max_connections, max_request_bytes=max_request_bytes)

    return start


def port_of(web: HttpServer) -> int:
    return int(web.server_address[1])


# --- read timeout: a connection that is not a request is dropped -------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("sent", [b"", b"GET /metr", b"GET /metrics HTTP/1.1\r\nHost: x\r\n"],
                         ids=["nothing", "half-a-request-line", "headers-never-finished"])
def test_a_client_that_never_completes_a_request_is_disconnected_after_the_read_timeout(
        collector: Callable[..., CollectorProcess], sent: bytes) -> None:
    proc = collector("http://127.0.0.1:9", *SIMULATE, "--web-read-timeout", "1")
    with connect(proc.port, timeout=8) as sock:
        started = time.monotonic()
        sock.sendall(sent)
        read_until_closed(sock)
        elapsed = time.monotonic() - started
    assert 0.8 <= elapsed < 3.0, elapsed
    assert proc.metrics_text(), "the server still answers others"


@pytest.mark.slow
def test_an_idle_kept_alive_connection_is_closed_after_the_read_timeout(
        collector: Callable[..., CollectorProcess]) -> None:
    proc = collector("http://127.0.0.1:9", *SIMULATE, "--web-read-timeout", "1")
    conn = http.client.HTTPConnection("127.0.0.1", proc.port, timeout=8)
    conn.request("GET", "/healthz")
    response = conn.getresponse()
    assert response.status == 200 and response.read() == b"ok\n"
    assert response.getheader("Connection") != "close", "HTTP/1.1 keeps the connection open"
    assert conn.sock is not None
    started = time.monotonic()
    assert read_until_closed(conn.sock) == b""
    elapsed = time.monotonic() - started
    conn.close()
    assert 0.8 <= elapsed < 3.0, elapsed


# --- size limits -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_oversized_headers_get_431_and_a_long_request_line_414(collector: Callable[..., CollectorProcess]) -> None:
    proc = collector("http://127.0.0.1:9", *SIMULATE, "--web-max-request-bytes", "4096")
    with connect(proc.port) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 8000 + b"\r\n\r\n")
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 431 "), reply[:100]
    with connect(proc.port) as sock:
        sock.sendall(b"GET /" + b"a" * 8000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 414 "), reply[:100]
    with connect(proc.port) as sock:  # just under the limit is served
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Pad: " + b"a" * 3900 + b"\r\n\r\n")
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 200 ") and reply.endswith(b"\r\n\r\nok\n"), reply[:100]


@pytest.mark.slow
@pytest.mark.parametrize("framing", [b"Content-Length: 5\r\n", b"Transfer-Encoding: chunked\r\n"],
                         ids=["content-length", "chunked"])
def test_a_request_body_is_refused_with_413_and_the_connection_closed(
        collector: Callable[..., CollectorProcess], framing: bytes) -> None:
    proc = collector("http://127.0.0.1:9", *SIMULATE)
    with connect(proc.port) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\nhello")
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 413 "), reply[:100]
    assert b"Connection: close" in reply


# --- a flood of slow connections -------------------------------------------------------------------

@pytest.mark.slow
def test_a_flood_of_slow_connections_neither_starves_scrapes_nor_grows_threads(
        collector: Callable[..., CollectorProcess]) -> None:
    proc = collector("http://127.0.0.1:9", *SIMULATE, "--web-read-timeout", "30", "--poll-interval", "0.3")
    assert proc.proc is not None
    pid = proc.proc.pid
    before = threads_of(pid)
    first_success = sample(proc.metrics(), LAST_SUCCESS)
    slow: list[socket.socket] = []
    try:
        for i in range(400):
            sock = connect(proc.port)
            if i % 2:
                sock.sendall(b"G")  # the start of a request line, trickled on below
            slow.append(sock)
        most_threads = 0
        for _ in range(6):
            for i, sock in enumerate(slow):
                if i % 2:
                    sock.sendall(b"E")
            started = time.monotonic()
            response = requests.get(proc.url + "/metrics", timeout=10)
            elapsed = time.monotonic() - started
            assert response.status_code == 200 and elapsed < 2.0, elapsed
            most_threads = max(most_threads, threads_of(pid))
        # At most --web-max-connections (16) workers join the acceptor; the simulator may add a few of
        # its own for instance metadata. A thread per connection would be 400 more.
        assert most_threads <= before + 16 + 4, (before, most_threads)
        wait_until(lambda: (sample(proc.metrics(), LAST_SUCCESS) or 0) > (first_success or 0),
                   message="polling goes on during the flood")
        assert proc.alive()
    finally:
        for sock in slow:
            sock.close()


# --- in-process: what Prometheus and browsers rely on ------------------------------------------------

def test_keep_alive_serves_several_requests_on_one_connection(server: Callable[..., HttpServer]) -> None:
    web = server()
    conn = http.client.HTTPConnection("127.0.0.1", port_of(web), timeout=5)
    for path, status, body in [("/metrics", 200, b"metric 1\n"), ("/nope", 404, b"not found\n"),
                               ("/healthz", 200, b"ok\n"), ("/readyz", 200, b"ok\n")]:
        conn.request("GET", path)
        response = conn.getresponse()
        assert (response.status, response.read()) == (status, body)
        assert response.getheader("Content-Length") == str(len(body))
    conn.request("GET", "/")
    response = conn.getresponse()
    assert response.status == 200 and b"<h1>forewarn</h1>" in response.read()
    assert response.getheader("Content-Type") == "text/html; charset=utf-8"
    conn.close()


def test_head_sends_the_length_without_a_body(server: Callable[..., HttpServer]) -> None:
    web = server()
    with connect(port_of(web), timeout=5) as sock:
        sock.sendall(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\n"
                     b"Connection: close\r\n\r\n")
        reply = read_until_closed(sock)
    head, _, rest = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"Content-Length: 9" in head
    assert rest.startswith(b"HTTP/1.1 200 ") and rest.endswith(b"\r\n\r\nok\n"), "the pipelined request follows"


def test_a_body_of_megabytes_arrives_whole_and_the_next_reply_after_it(server: Callable[..., HttpServer]) -> None:
    body = b"".join(b"azure_scheduled_event_info{vm=\"vm-%07d\"} 1.0\n" % n for n in range(100_000))
    web = server(render=lambda accept: (body, "text/plain"))
    with connect(port_of(web), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\nHEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
                     b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reply = read_until_closed(sock)
    head, _, rest = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and f"Content-Length: {len(body)}".encode() in head
    assert rest[:len(body)] == body
    second, _, third = rest[len(body):].partition(b"\r\n\r\n")
    assert second.startswith(b"HTTP/1.1 200 ") and f"Content-Length: {len(body)}".encode() in second
    assert third.startswith(b"HTTP/1.1 200 ") and third.endswith(b"\r\n\r\nok\n"), "HEAD sent no body"


def test_http_1_0_without_keep_alive_is_closed_after_the_reply(server: Callable[..., HttpServer]) -> None:
    web = server()
    with connect(port_of(web), timeout=5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 200 ") and reply.endswith(b"ok\n")


def test_a_malformed_request_line_gets_400(server: Callable[..., HttpServer]) -> None:
    web = server()
    with connect(port_of(web), timeout=5) as sock:
        sock.sendall(b"HELLO\r\n\r\n")
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 400 ")


def test_workers_are_bounded_and_taken_only_by_complete_requests(server: Callable[..., HttpServer]) -> None:
    """Two workers, both busy rendering: a third scrape waits for one rather than getting a thread, and
    forty idle connections cost no thread at all."""
    release = threading.Event()
    rendering = threading.Semaphore(0)

    def slow_render(accept: str) -> tuple[bytes, str]:
        rendering.release()
        release.wait(10)
        return b"metric 1\n", "text/plain"

    web = server(max_connections=2, render=slow_render)
    before = threading.active_count()
    idle = [connect(port_of(web), timeout=5) for _ in range(40)]
    results: list[int] = []

    def scrape() -> None:
        results.append(requests.get(web.url + "/metrics", timeout=10).status_code)

    scrapers = [threading.Thread(target=scrape) for _ in range(3)]
    try:
        for thread in scrapers:
            thread.start()
        assert rendering.acquire(timeout=5) and rendering.acquire(timeout=5)
        assert not rendering.acquire(timeout=0.3), "the third request waits for a free worker"
        # 3 scraper threads of this test, at most 2 workers and the acceptor of the server.
        assert threading.active_count() <= before + 3 + 2 + 1
        release.set()
        for thread in scrapers:
            thread.join(10)
        assert results == [200, 200, 200]
    finally:
        release.set()
        for sock in idle:
            sock.close()


def test_stop_closes_open_connections_and_ends_its_threads(server: Callable[..., HttpServer]) -> None:
    before = threading.active_count()
    web = server()
    sock = connect(port_of(web), timeout=5)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert sock.recv(1024).startswith(b"HTTP/1.1 200 ")
    web.stop()
    assert read_until_closed(sock) == b""
    sock.close()
    wait_until(lambda: threading.active_count() <= before, timeout=5, message="the server's threads to end")


# --- the helper's own interface: routes, methods, bodies, and answers that are no answer ------------

def echo(request: Request) -> Response:
    return Response(200, f"{request.method} {request.path} q={request.query('q')} ".encode() + request.body)


def test_routes_by_path_and_prefix_and_the_methods_each_takes(serve: Callable[..., HttpServer]) -> None:
    def setup(web: HttpServer) -> None:
        web.route("/items", echo, methods=("GET",))
        web.route("/items/", echo, methods=("DELETE",), prefix=True)
        web.route("/items/special/", lambda request: Response(200, b"special\n"), prefix=True)

    web = serve(setup=setup)
    assert requests.get(web.url + "/items?q=1", timeout=5).text == "GET /items q=1 "
    assert requests.delete(web.url + "/items/7", timeout=5).text == "DELETE /items/7 q=None "
    assert requests.get(web.url + "/items/special/x", timeout=5).text == "special\n", "the longest prefix wins"
    refused = requests.post(web.url + "/items", timeout=5)
    assert (refused.status_code, refused.headers["Allow"], refused.text) == (405, "GET", "method not allowed\n")
    assert requests.get(web.url + "/elsewhere", timeout=5).status_code == 404


def test_the_agent_endpoints_take_no_other_method_and_no_body(server: Callable[..., HttpServer]) -> None:
    web = server()
    refused = requests.post(web.url + "/metrics", timeout=5)
    assert refused.status_code == 405 and refused.headers["Allow"] == "GET, HEAD"
    assert requests.post(web.url + "/metrics", data=b"x", timeout=5).status_code == 413


def test_a_server_that_takes_bodies_gets_them_whole_even_when_they_trickle_in(
        serve: Callable[..., HttpServer]) -> None:
    web = serve({"/echo": echo}, max_body_bytes=100, read_timeout=5)
    with connect(port_of(web), timeout=5) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\nhello")
        assert not wait_readable(sock, 0.2), "no answer before the whole body is there"
        sock.sendall(b" world")
        sock.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")  # pipelined after the body
        reply = read_until_closed(sock)
    first, _, second = reply.partition(b"HTTP/1.1 200 OK")[2].partition(b"HTTP/1.1 ")
    assert first.endswith(b"\r\n\r\nPOST /echo q=None hello world") and second.endswith(b"GET /echo q=None ")


@pytest.mark.parametrize(("framing", "status"), [
    (b"Content-Length: 101\r\n", b"413"), (b"Transfer-Encoding: chunked\r\n", b"411"),
    (b"Content-Length: ten\r\n", b"400"), (b"Content-Length: 1\r\nContent-Length: 2\r\n", b"400"),
    (b"Content-Length: 1\r\nContent-Length: 1\r\n", b"400"), (b"Content-Length: 1, 1\r\n", b"400"),
    (b"Content-Length: +1\r\n", b"400"), (b"Content-Length: 1\r\nTransfer-Encoding: chunked\r\n", b"400"),
    (b"Transfer-Encoding: xchunked\r\n", b"400"), (b"Transfer-Encoding: gzip, chunked\r\n", b"501"),
], ids=["too-large", "chunked", "not-a-number", "two-lengths", "the-same-length-twice", "a-length-list",
        "a-signed-length", "length-and-chunked", "xchunked", "gzip-chunked"])
def test_a_body_it_cannot_take_is_refused_before_any_handler_runs(
        serve: Callable[..., HttpServer], framing: bytes, status: bytes) -> None:
    called: list[Request] = []

    def record(request: Request) -> Response:
        called.append(request)
        return echo(request)

    web = serve({"/echo": record}, max_body_bytes=100)
    with connect(port_of(web), timeout=5) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n0")
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 " + status + b" ") and b"Connection: close" in reply, reply[:100]
    assert called == []


def test_a_body_that_never_completes_is_dropped_after_the_read_timeout(serve: Callable[..., HttpServer]) -> None:
    web = serve({"/echo": echo}, max_body_bytes=100, read_timeout=0.5)
    with connect(port_of(web), timeout=5) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nhalf")
        assert read_until_closed(sock) == b""
    assert 0.4 <= time.monotonic() - started < 3.0


def test_a_reset_answer_resets_the_connection(serve: Callable[..., HttpServer]) -> None:
    web = serve({"/reset": lambda request: Response.reset()})
    with pytest.raises(requests.ConnectionError):
        requests.get(web.url + "/reset", timeout=5)
    with connect(port_of(web), timeout=5) as sock:
        sock.sendall(b"GET /reset HTTP/1.1\r\nHost: x\r\n\r\n")
        with pytest.raises(ConnectionResetError):
            sock.recv(1024)


def test_a_hang_holds_the_request_unanswered_then_resets_and_stop_ends_it_early(
        serve: Callable[..., HttpServer]) -> None:
    web = serve({"/short": lambda request: Response.hang(0.5), "/long": lambda request: Response.hang(60)})
    started = time.monotonic()
    with pytest.raises(requests.ConnectionError):
        requests.get(web.url + "/short", timeout=5)
    assert 0.4 <= time.monotonic() - started < 3.0
    sock = connect(port_of(web), timeout=5)
    sock.sendall(b"GET /long HTTP/1.1\r\nHost: x\r\n\r\n")
    assert not wait_readable(sock, 0.3), "no answer while it hangs"
    started = time.monotonic()
    web.stop()
    assert read_until_closed(sock) == b""
    sock.close()
    assert time.monotonic() - started < 2.0


def test_a_failing_handler_gets_500_and_the_server_goes_on(serve: Callable[..., HttpServer]) -> None:
    def broken(request: Request) -> Response:
        raise RuntimeError("a bug")

    web = serve({"/broken": broken, "/echo": echo})
    conn = http.client.HTTPConnection("127.0.0.1", port_of(web), timeout=5)
    conn.request("GET", "/broken")
    response = conn.getresponse()
    assert (response.status, response.read()) == (500, b"internal server error\n")
    conn.request("GET", "/echo")
    assert conn.getresponse().read() == b"GET /echo q=None ", "the same connection goes on"
    conn.close()


def test_readiness_names_what_must_have_succeeded_and_how_long_ago() -> None:
    from forewarn.web.endpoints import readiness_check

    last: list[float | None] = [None]
    check = readiness_check(lambda: last[0], window=60, clock=lambda: 1000.0, what="read of a source")
    assert check() == (False, "no successful read of a source yet")
    last[0] = 900.0
    assert check() == (False, "last successful read of a source 100 s ago (window 60 s)")
    last[0] = 950.0
    assert check() == (True, "ok")
    assert readiness_check(lambda: None, window=60)() == (False, "no successful IMDS poll yet")


# --- the request line and the headers, read without the email package ---------------------------------

@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Folded: a\r\n b\r\n\r\n", b"400"),       # obs-fold
    (b"GET /echo HTTP/1.1\r\nHost : x\r\n\r\n", b"400"),                          # space before the colon
    (b"GET /echo HTTP/1.1\r\nno colon here\r\n\r\n", b"400"),
    (b"GET /echo HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(101)) + b"\r\n", b"431"),
    (b"GET /echo HTTP/2.0\r\nHost: x\r\n\r\n", b"505"),
    (b"GET /echo HTTP/1.x\r\nHost: x\r\n\r\n", b"400"),
    (b"GET /echo FTP/1.1\r\nHost: x\r\n\r\n", b"400"),
    (b"GET /echo HTTP/1.1 extra\r\nHost: x\r\n\r\n", b"400"),
    (b"GET /echo HTTP/1.1\r\n\r\n", b"400"),                                       # RFC 9112 3.2
    (b"GET /echo HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", b"400"),
    (b"GET /echo HTTP/1.0\r\nHost: x\r\nHost: y\r\n\r\n", b"400"),
    (b"GET /echo HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", b"400"),           # RFC 9110 5.5
    (b"GET /echo HTTP/1.1\r\nHost: x\r\nX-A: a\x01b\r\n\r\n", b"400"),
    (b"GET /echo HTTP/1.1\r\nHost: x\r\nX A: b\r\n\r\n", b"400"),                 # RFC 9110 5.1
    (b"GET /echo HTTP/1.1\r\n\tHost: x\r\n\r\n", b"400"),
    (b"GET /echo HTTP/1.1\r\nHost\t: x\r\n\r\n", b"400"),
    (b"G@T /echo HTTP/1.1\r\nHost: x\r\n\r\n", b"400"),                             # RFC 9110 5.6.2
    (b"GET /ec\x7fho HTTP/1.1\r\nHost: x\r\n\r\n", b"400"),                         # RFC 9112 3.2
    (b"GET /ec\tho HTTP/1.1\r\nHost: x\r\n\r\n", b"400"),
    (b"GET /echo\r HTTP/1.1\r\nHost: x\r\n\r\n", b"400"),                           # a lone CR
    (b"\r\nGET /echo HTTP/1.1\r\nHost: x\r\n\r\n", b"400"),
], ids=["folded", "space-before-colon", "no-colon", "101-headers", "http2", "bad-version", "not-http", "four-words",
        "no-host", "two-hosts", "two-hosts-http-1.0", "nul-in-value", "control-in-value", "space-in-name",
        "tab-before-name", "tab-before-colon", "method-not-a-token", "del-in-target", "tab-in-target",
        "lone-cr-in-request-line", "empty-line-first"])
def test_a_malformed_request_gets_its_error_and_no_handler_runs(
        serve: Callable[..., HttpServer], request_bytes: bytes, status: bytes) -> None:
    called: list[Request] = []

    def record(request: Request) -> Response:
        called.append(request)
        return echo(request)

    web = serve({"/echo": record})
    with connect(port_of(web), timeout=5) as sock:
        sock.sendall(request_bytes)
        reply = read_until_closed(sock)
    assert reply.split(b"\r\n", 1)[0].split(b" ")[1] == status, reply[:100]
    assert b"Connection: close" in reply.partition(b"\r\n\r\n")[0].split(b"\r\n")
    assert called == []


def test_a_lone_cr_cannot_hide_a_content_length_and_smuggle_a_request(serve: Callable[..., HttpServer]) -> None:
    """The issue's case: http.server reads the CR as a line end and a five-byte body; forewarn used to keep it in
    the value, see no body and read `hello` as the next request. Now: 400, the connection closed, nothing else."""
    called: list[Request] = []

    def record(request: Request) -> Response:
        called.append(request)
        return echo(request)

    web = serve({"/echo": record}, max_body_bytes=100)
    with connect(port_of(web), timeout=5) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nX-A: a\rContent-Length: 5\r\n\r\nhello"
                     b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 400 ") and reply.count(b"HTTP/1.1 ") == 1, reply
    assert called == []


def test_http_1_0_without_host_is_served_and_a_connection_list_with_close_closes(
        serve: Callable[..., HttpServer]) -> None:
    web = serve({"/echo": lambda request: Response(200, b"ok\n")})
    with connect(port_of(web), timeout=5) as sock:
        sock.sendall(b"GET /echo HTTP/1.0\r\n\r\n")
        assert read_until_closed(sock).startswith(b"HTTP/1.1 200 ")
    with connect(port_of(web), timeout=5) as sock:
        sock.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: TE, Close\r\n\r\n")
        assert read_until_closed(sock).count(b"HTTP/1.1 200 ") == 1, "closed after the reply"


def test_headers_are_read_by_name_whatever_the_case_and_the_connection_header_is_obeyed(
        serve: Callable[..., HttpServer]) -> None:
    seen: list[Request] = []

    def record(request: Request) -> Response:
        seen.append(request)
        return Response(200, b"ok\n")

    web = serve({"/echo": record})
    with connect(port_of(web), timeout=5) as sock:
        sock.sendall(b"GET //echo HTTP/1.1\nhost: x\nX-Token:\t  spaced value \t\nAccept: a\n\n"
                     b"GET /echo HTTP/1.1\r\nHost: x\r\nCONNECTION: close\r\n\r\n")
        replies = read_until_closed(sock)
    assert replies.count(b"HTTP/1.1 200 ") == 2, replies   # the second asked to close: the server did
    first = seen[0]
    assert first.headers.get("X-TOKEN") == "spaced value" and first.headers.get("accept") == "a"
    assert first.target == "/echo"                          # never a scheme-relative //host/...


def test_http_1_0_closes_unless_it_asks_for_keep_alive_and_0_9_is_refused(serve: Callable[..., HttpServer]) -> None:
    web = serve({"/echo": lambda request: Response(200, b"ok\n")})
    with connect(port_of(web), timeout=5) as sock:
        sock.sendall(b"GET /echo HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /echo HTTP/1.0\r\n\r\n")
        assert read_until_closed(sock).count(b" 200 ") == 2
    for request_line in (b"POST /echo\r\n\r\n", b"GET /echo\r\n\r\n"):  # no version: RFC 9112 3
        with connect(port_of(web), timeout=5) as sock:
            sock.sendall(request_line)
            assert b" 400 " in read_until_closed(sock).split(b"\r\n", 1)[0]


def test_the_date_header_is_written_as_http_wants_it() -> None:
    from email.utils import formatdate

    from forewarn.web.server import http_date

    for moment in (0, 951782400, 1_795_000_000.7, 4_102_444_799):  # 1970, a leap day, 2026, the end of 2099
        assert http_date(moment) == formatdate(int(moment), usegmt=True)


def test_every_answer_carries_date_and_server(serve: Callable[..., HttpServer]) -> None:
    web = serve({"/echo": echo})
    with connect(port_of(web), timeout=5) as sock:
        sock.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        head = read_until_closed(sock).split(b"\r\n\r\n", 1)[0].decode()
    fields = dict(line.split(": ", 1) for line in head.split("\r\n")[1:])
    assert fields["Server"].startswith("forewarn Python/")
    assert abs(parsedate_to_datetime(fields["Date"]).timestamp() - time.time()) < 5


# --- inline routes: answered by the acceptor itself, never held up by a client -----------------------

def _where(request: Request) -> Response:
    """Answers with the name of the thread that ran it: the acceptor's is the server's name."""
    return Response(200, threading.current_thread().name.encode())


def test_an_inline_route_is_answered_by_the_acceptor_and_the_others_by_a_worker(
        serve: Callable[..., HttpServer]) -> None:
    def setup(web: HttpServer) -> None:
        web.route("/here", _where, inline=True)
        web.route("/pool", _where)
        web.route("/tree/", _where, prefix=True, inline=True)  # a prefix is never inline

    web = serve(setup=setup, name="web")
    conn = http.client.HTTPConnection("127.0.0.1", port_of(web), timeout=5)
    answered_by = []
    for path in ("/here", "/here?x=1", "/pool", "/tree/leaf", "/here"):
        conn.request("GET", path)
        answered_by.append(conn.getresponse().read().decode())
    conn.close()
    assert answered_by[:2] == ["web", "web"] and answered_by[4] == "web"
    assert answered_by[2].startswith("web-") and answered_by[3].startswith("web-")


def test_a_route_that_checks_a_password_is_not_inline_and_a_public_one_is(
        serve: Callable[..., HttpServer], tmp_path: Path) -> None:
    """A bcrypt may take a quarter of a second: the acceptor must not pay it."""
    import base64

    import bcrypt

    from forewarn.web.config import WebGate

    config = tmp_path / "web.yml"
    config.write_text("basic_auth_users:\n  prometheus: "
                      + bcrypt.hashpw(b"secret", bcrypt.gensalt(4)).decode() + "\n")

    def setup(web: HttpServer) -> None:
        web.route("/here", _where, inline=True)
        web.route("/probe", _where, inline=True, public=True)

    web = serve(setup=setup, name="web", gate=WebGate(config))
    auth = {"Authorization": "Basic " + base64.b64encode(b"prometheus:secret").decode()}
    assert requests.get(web.url + "/here", timeout=5).status_code == 401
    checked = requests.get(web.url + "/here", headers=auth, timeout=5)
    assert checked.status_code == 200 and checked.text.startswith("web-")
    assert requests.get(web.url + "/probe", timeout=5).text == "web"


def test_a_client_that_does_not_read_inline_replies_does_not_hold_the_acceptor(
        serve: Callable[..., HttpServer]) -> None:
    """The part of a reply the kernel does not take at once is sent by a worker; meanwhile the acceptor
    answers other clients, and the reader that comes back late gets every byte, in order."""
    body = bytes(range(256)) * 800  # 200 kB: written with its head in one sendmsg
    count = 40  # 8 MB pipelined: more than loopback's socket buffers take unread (about 3 MB here)
    web = serve(setup=lambda web: (web.route("/big", lambda request: Response(200, body), inline=True),
                                   web.route("/here", _where, inline=True)), name="web")
    with connect(port_of(web), timeout=5) as stuck:
        stuck.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n" * count
                      + b"GET /here HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        time.sleep(0.3)
        for _ in range(3):  # the acceptor answers other connections while /big waits for its reader
            started = time.monotonic()
            reply = requests.get(web.url + "/here", timeout=5)
            assert reply.text == "web" and time.monotonic() - started < 1.0
        rest = read_until_closed(stuck)
    for _ in range(count):
        head, _, rest = rest.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and f"Content-Length: {len(body)}".encode() in head
        assert rest[:len(body)] == body
        rest = rest[len(body):]
    head, _, last = rest.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and last == b"web", "the request after them, answered inline again"


def test_many_pipelined_inline_requests_are_all_answered_in_order(serve: Callable[..., HttpServer]) -> None:
    web = serve(setup=lambda web: web.route("/n", lambda request: Response(200, request.query("i").encode()),
                                             inline=True))
    count = 3000  # more than the interpreter's recursion limit: they are taken in a loop
    requests_bytes = b"".join(b"GET /n?i=%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(count))
    with connect(port_of(web), timeout=10) as sock:
        sender = threading.Thread(target=sock.sendall, args=(requests_bytes + b"GET /n?i=end HTTP/1.1\r\n"
                                                             b"Host: x\r\nConnection: close\r\n\r\n",))
        sender.start()
        replies = read_until_closed(sock)
        sender.join(10)
    bodies = [part.split(b"\r\n\r\n", 1)[1] for part in replies.split(b"HTTP/1.1 ")[1:]]
    assert bodies == [str(i).encode() for i in range(count)] + [b"end"]


def test_an_inline_handler_that_fails_gets_500_and_the_connection_goes_on(serve: Callable[..., HttpServer]) -> None:
    def broken(request: Request) -> Response:
        raise RuntimeError("a bug")

    web = serve(setup=lambda web: (web.route("/broken", broken, inline=True),
                                   web.route("/here", _where, inline=True)), name="web")
    conn = http.client.HTTPConnection("127.0.0.1", port_of(web), timeout=5)
    conn.request("GET", "/broken")
    response = conn.getresponse()
    assert (response.status, response.read()) == (500, b"internal server error\n")
    conn.request("GET", "/here")
    assert conn.getresponse().read() == b"web"
    conn.close()


def test_a_kept_alive_connection_after_an_inline_answer_times_out_from_that_answer(
        serve: Callable[..., HttpServer]) -> None:
    web = serve(setup=lambda web: web.route("/here", _where, inline=True), read_timeout=0.6)
    with connect(port_of(web), timeout=5) as sock:
        time.sleep(0.4)
        sock.sendall(b"GET /here HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
        answered = time.monotonic()
        assert not wait_readable(sock, 0.4), "the deadline starts again at the answer, not at the connect"
        assert read_until_closed(sock) == b""
        assert 0.5 <= time.monotonic() - answered < 3.0
