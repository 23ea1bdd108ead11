"""The poll's own HTTP reader (imds/wire.py) takes every framing HTTP/1.1 allows, as http.client did: a body
sized by Content-Length, sent in chunks, or ended by the connection; interim 1xx replies; a server that
closes after each reply. Malformed replies are refused in tests/test_hostile_imds.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from forewarn.imds.client import ImdsClient, ImdsError, RateLimiter, Stopped

from peers.hostile_imds import Behaviour, HostileImds, Raw, Reply, document, event

BODY = json.dumps(document(7, event("E1"))).encode()


def chunked(body: bytes, size: int = 10) -> bytes:
    parts = [body[i:i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x;ext=1\r\n%s\r\n" % (len(part), part) for part in parts) + b"0\r\nX-Trailer: 1\r\n\r\n"


class KeptRaw(Behaviour):
    """Exactly these bytes, and the connection kept for the next request."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def answer(self, conn: socket.socket, stop: threading.Event) -> bool:
        conn.sendall(self.data)
        return True


@pytest.fixture
def peer() -> Iterator[HostileImds]:
    server = HostileImds()
    yield server
    server.stop()


def polls(peer: HostileImds, count: int = 3) -> list[int]:
    client = ImdsClient(peer.url, limiter=RateLimiter(limit=1000))
    try:
        return [client.get_scheduled_events().incarnation for _ in range(count)]
    finally:
        client.close()


@pytest.mark.parametrize("behaviour", [
    KeptRaw(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(BODY)),
    Raw(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + BODY),  # ends with the connection
    Raw(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
        % len(BODY) + BODY),
], ids=["chunked", "to-close", "interim-reply"])
def test_every_framing_of_a_reply_is_read(peer: HostileImds, behaviour: Behaviour) -> None:
    peer.behaviour = behaviour
    assert polls(peer) == [7, 7, 7]
    assert len(peer.events_requests()) == 3


def test_polls_keep_one_connection_and_send_the_imds_headers(peer: HostileImds) -> None:
    peer.behaviour = Reply(body=BODY, headers={"Retry-After": "1", "X-Repeated": "a"})
    assert polls(peer) == [7, 7, 7]
    requests = peer.events_requests("GET")
    assert len(requests) == 3
    assert {request.path for request in requests} == {"/metadata/scheduledevents?api-version=2020-07-01"}
    for request in requests:
        assert request.headers["metadata"] == "true"
        assert request.headers["user-agent"].startswith("forewarn/")
        assert request.headers["host"] == f"127.0.0.1:{peer.port}"
        assert "x-forwarded-for" not in request.headers
    assert len(peer._conns) == 2  # the first call's own (it may take two minutes), then one kept alive


def test_a_retry_after_reaches_the_error(peer: HostileImds) -> None:
    peer.behaviour = Reply(status=503, body="busy", headers={"Retry-After": "7"})
    client = ImdsClient(peer.url, limiter=RateLimiter(limit=1000))
    try:
        with pytest.raises(ImdsError) as failure:
            client.get_scheduled_events()
    finally:
        client.close()
    assert failure.value.code == 503
    assert failure.value.retry_after == 7
    assert "busy" in str(failure.value)


def test_replies_that_differ_only_in_their_date_are_read_alike_and_any_other_header_is_read_again(
        peer: HostileImds) -> None:
    # The reader parses a head once and reuses it for the next one that differs only in its Date line.
    client = ImdsClient(peer.url, limiter=RateLimiter(limit=1000))
    client._enabled = True  # the kept-alive poll connection from the first poll on

    def reply(status: int, date: str, **headers: str) -> KeptRaw:
        lines = "".join(f"{name.replace('_', '-')}: {value}\r\n" for name, value in headers.items())
        body = BODY if status == 200 else b"busy"
        return KeptRaw(b"HTTP/1.1 %d X\r\nDate: %s\r\n%sContent-Length: %d\r\n\r\n%s"
                       % (status, date.encode(), lines.encode(), len(body), body))

    retry_afters = []
    try:
        for date, seconds in [("Tue, 24 Nov 2026 10:00:00 GMT", "1"), ("Tue, 24 Nov 2026 10:00:01 GMT", "1"),
                              ("Tue, 24 Nov 2026 10:00:02 GMT", "7"), ("Tue, 24 Nov 2026 10:00:03 GMT", "3")]:
            peer.behaviour = reply(429, date, Retry_After=seconds)
            with pytest.raises(ImdsError) as failure:
                client.get_scheduled_events()
            retry_afters.append(failure.value.retry_after)
        peer.behaviour = reply(200, "Tue, 24 Nov 2026 10:00:04 GMT", Retry_After="3")
        assert client.get_scheduled_events().incarnation == 7  # the status line is read again too
        assert client._poll._conn.sock is not None  # kept alive
        peer.behaviour = reply(200, "Tue, 24 Nov 2026 10:00:05 GMT", Connection="close")
        assert client.get_scheduled_events().incarnation == 7
        assert client._poll._conn.sock is None  # "Connection: close" was obeyed
        peer.behaviour = reply(200, "Tue, 24 Nov 2026 10:00:06 GMT")
        assert client.get_scheduled_events().incarnation == 7
        assert client._poll._conn.sock is not None
    finally:
        client.close()
    assert retry_afters == [1, 1, 7, 3]


class KeptSplit(Behaviour):
    """The reply in two writes a moment apart, the connection kept: the client's first read has only part."""

    def __init__(self, data: bytes, at: int) -> None:
        self.data, self.at = data, at

    def answer(self, conn: socket.socket, stop: threading.Event) -> bool:
        conn.sendall(self.data[:self.at])
        stop.wait(0.05)
        conn.sendall(self.data[self.at:])
        return True


def test_a_reply_is_taken_as_the_last_one_only_when_every_byte_but_the_date_is_the_same(peer: HostileImds) -> None:
    client = ImdsClient(peer.url, limiter=RateLimiter(limit=1000))
    client._enabled = True  # the kept-alive poll connection from the first poll on

    def reply(incarnation: int, date: str) -> bytes:
        body = json.dumps(document(incarnation, event("E1"))).encode()
        return b"HTTP/1.1 200 OK\r\nDate: %s\r\nContent-Length: %d\r\n\r\n%s" % (date.encode(), len(body), body)

    try:
        seen = []
        for behaviour in [KeptRaw(reply(7, "Tue, 24 Nov 2026 10:00:00 GMT")),   # read, and remembered
                          KeptRaw(reply(7, "Tue, 24 Nov 2026 10:00:01 GMT")),   # the same but for the date
                          KeptRaw(reply(8, "Tue, 24 Nov 2026 10:00:02 GMT")),   # a new document, same length
                          KeptSplit(reply(9, "Tue, 24 Nov 2026 10:00:03 GMT"), 30),  # in two parts: read whole
                          KeptSplit(reply(9, "Tue, 24 Nov 2026 10:00:04 GMT"), 200),
                          KeptRaw(reply(9, "Tue, 24 Nov 2026 10:00:05 GMT")),
                          KeptRaw(reply(7, "Tue, 24 Nov 2026 10:00:06 GMT"))]:
            peer.behaviour = behaviour
            seen.append(client.get_scheduled_events().incarnation)
    finally:
        client.close()
    assert seen == [7, 7, 8, 9, 9, 9, 7]


class KeptLate(Behaviour):
    """The reply after `delay` seconds (longer than a read's slice of the deadline), the connection kept."""

    def __init__(self, data: bytes, delay: float) -> None:
        self.data, self.delay = data, delay

    def answer(self, conn: socket.socket, stop: threading.Event) -> bool:
        stop.wait(self.delay)
        conn.sendall(self.data)
        return True


def test_a_late_reply_to_a_poll_on_the_kept_connection_is_waited_for_and_a_stop_ends_the_wait(
        peer: HostileImds) -> None:
    """The steady poll (connection kept, last reply remembered) reads straight from the socket; a reply later
    than one slice of the deadline is still read whole, and a stop during the wait ends it at once."""
    client = ImdsClient(peer.url, limiter=RateLimiter(limit=1000), timeout=5)
    client._enabled = True
    stop = threading.Event()
    client.stop = stop
    date = b"Tue, 24 Nov 2026 10:00:00 GMT"
    same = b"HTTP/1.1 200 OK\r\nDate: %s\r\nContent-Length: %d\r\n\r\n%s" % (date, len(BODY), BODY)
    try:
        peer.behaviour = KeptRaw(same)
        assert [client.get_scheduled_events().incarnation for _ in range(2)] == [7, 7]  # remembered
        peer.behaviour = KeptLate(same, 0.7)
        started = time.monotonic()
        assert client.get_scheduled_events().incarnation == 7
        assert time.monotonic() - started >= 0.6
        newer = json.dumps(document(8, event("E1"))).encode()
        peer.behaviour = KeptLate(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(newer), newer), 0.7)
        assert client.get_scheduled_events().incarnation == 8
        assert client.get_scheduled_events().incarnation == 8  # the late reply was remembered in its turn
        peer.behaviour = KeptLate(same, 30)
        threading.Timer(0.5, stop.set).start()
        started = time.monotonic()
        with pytest.raises(Stopped):
            client.get_scheduled_events()
        assert time.monotonic() - started < 1.5
    finally:
        stop.set()
        client.close()
