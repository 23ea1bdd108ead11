"""forewarn against an IMDS that sends what no well-behaved server does (tests/peers/hostile_imds.py).

Each test reproduces one way a broken proxy, a platform bug or an attacker on the link-local network
could crash, hang, bloat or blind the collector, and checks what users rely on afterwards: the process
still runs, /metrics answers, and the next valid event is reported promptly.
"""

from __future__ import annotations

import itertools
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import requests

from forewarn.imds.client import ImdsClient, ImdsError
from forewarn.imds.document import DocumentError

from conftest import CollectorProcess, parse_metrics, sample, wait_until
from peers.hostile_imds import (
    Behaviour,
    Endless,
    Hang,
    HostileImds,
    Huge,
    Raw,
    Reply,
    Reset,
    Trickle,
    document,
    event,
    http_reply,
)


@pytest.fixture
def imds() -> Iterator[HostileImds]:
    peer = HostileImds()
    yield peer
    peer.stop()


def _timed(call: Callable[[], object]) -> tuple[float, BaseException | None]:
    started = time.monotonic()
    try:
        call()
    except (ImdsError, DocumentError) as exc:
        return time.monotonic() - started, exc
    return time.monotonic() - started, None


# --- the client: deadlines, size cap, stop -----------------------------------------------------------

def test_a_reply_trickled_one_byte_at_a_time_fails_within_the_deadline(imds: HostileImds) -> None:
    client = ImdsClient(imds.url, timeout=1.0, first_timeout=1.0)
    imds.behaviour = Trickle(json.dumps(document(1)).encode(), interval=0.05)
    elapsed, error = _timed(client.get_scheduled_events)
    assert isinstance(error, ImdsError) and error.retryable and "within 1 s" in str(error)
    assert elapsed < 1.6


def test_a_hung_approval_fails_within_the_deadline(imds: HostileImds) -> None:
    client = ImdsClient(imds.url, timeout=0.5)
    imds.behaviour = Hang()
    elapsed, error = _timed(lambda: client.start_events(["E1"]))
    assert isinstance(error, ImdsError) and elapsed < 1.1


def test_stop_interrupts_a_hung_first_call(imds: HostileImds) -> None:
    stop = threading.Event()
    client = ImdsClient(imds.url, first_timeout=120, stop=stop)
    imds.behaviour = Hang()
    threading.Timer(0.3, stop.set).start()
    elapsed, error = _timed(client.get_scheduled_events)
    assert isinstance(error, ImdsError) and error.kind == "stopped"
    assert elapsed < 0.9


def test_stop_interrupts_a_connect_that_gets_no_answer() -> None:
    stop = threading.Event()
    # 192.0.2.0/24 is TEST-NET-1: nothing answers, so connect() waits for its timeout unless stopped.
    client = ImdsClient("http://192.0.2.1", first_timeout=120, stop=stop)
    threading.Timer(0.3, stop.set).start()
    elapsed, error = _timed(client.get_scheduled_events)
    assert isinstance(error, ImdsError)
    assert elapsed < 0.9


@pytest.mark.parametrize("behaviour", [Huge(50 * 1024 * 1024), Endless()],
                         ids=["content-length-50MB", "endless-chunked"])
def test_a_reply_past_the_size_cap_is_an_error_and_the_connection_is_dropped(imds: HostileImds,
                                                                            behaviour: Behaviour) -> None:
    codes: list[str] = []
    client = ImdsClient(imds.url, timeout=2.0, first_timeout=2.0, max_reply_bytes=256 * 1024,
                        observe=lambda method, code, seconds: codes.append(code))
    imds.behaviour = behaviour
    elapsed, error = _timed(client.get_scheduled_events)
    assert isinstance(error, ImdsError) and error.kind == "too_large" and "262144 bytes" in str(error)
    assert codes == ["too_large"]
    assert elapsed < 1.5
    imds.behaviour = Reply(body=document(7))
    assert client.get_scheduled_events().incarnation == 7


@pytest.mark.parametrize("data", [
    b"garbage\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70_000 + b"\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 200 + b"\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}",
    http_reply(200, b"\xff\xfe\x00"),
    http_reply(200, b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
    http_reply(503, b"\x1b[31mred\n\x00", {"Retry-After": "nan"}),
], ids=["status", "negative-length", "bad-chunk", "long-header", "many-headers", "short-body", "not-utf8",
        "deep", "controls"])
def test_malformed_http_is_a_clean_imds_or_document_error(imds: HostileImds, data: bytes) -> None:
    client = ImdsClient(imds.url, timeout=1.0, first_timeout=1.0)
    imds.behaviour = Raw(data)
    _, error = _timed(client.get_scheduled_events)
    assert error is not None
    if isinstance(error, ImdsError) and error.code == 503:
        assert error.retry_after is None and "\x1b" not in str(error) and "\x00" not in str(error)


def test_a_reset_is_a_retryable_transport_error(imds: HostileImds) -> None:
    client = ImdsClient(imds.url, timeout=1.0, first_timeout=1.0)
    imds.behaviour = Reset()
    _, error = _timed(client.get_scheduled_events)
    assert isinstance(error, ImdsError) and error.retryable and error.code is None


# --- the collector: survives every hostile reply, reports the next valid event --------------------

HOSTILE = {
    "deep-nesting": Reply(body=b'{"DocumentIncarnation": 2, "Events": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"),
    "not-before-overflow": Reply(body=document(2, event("E2", not_before="Fri, 31 Dec 9999 23:59:59 -1200"))),
    "surrogate-event-id": Reply(body=b'{"DocumentIncarnation": 2, "Events": [{"EventId": "\\ud800", "EventType": '
                                b'"Reboot", "EventStatus": "Scheduled", "Resources": ["vm-hostile"]}]}'),
    "huge-incarnation": Reply(body=b'{"DocumentIncarnation": 1' + b"0" * 400 + b', "Events": []}'),
    "huge-duration": Reply(body=json.dumps(document(2, event("E2"))).replace('"DurationInSeconds": -1',
                                                                            '"DurationInSeconds": 1' + "0" * 400)),
    "surrogate-description": Reply(body=json.dumps(document(2, event("E2"))).replace("maintenance", "\\udfff")),
    "huge-body": Huge(20 * 1024 * 1024),
    "endless-chunked": Endless(),
    "trickle": Trickle(json.dumps(document(2, event("E2"))).encode(), interval=0.2),
    "nan": Reply(body=b'{"DocumentIncarnation": NaN, "Events": []}'),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HOSTILE))
def test_the_collector_survives_a_hostile_reply_and_reports_the_next_valid_event(
        imds: HostileImds, collector: Callable[..., CollectorProcess], name: str) -> None:
    imds.behaviour = Reply(body=document(1, event("E1")))
    proc = collector(imds.url, "--imds-timeout", "1", "--imds-max-reply-bytes", "1048576", poll_interval=0.5)
    wait_until(lambda: any(r["subject"] == "E1" for r in proc.records()), message="E1 reported")
    imds.behaviour = HOSTILE[name]
    polled = len(imds.events_requests())
    wait_until(lambda: len(imds.events_requests()) >= polled + 2, message="two polls of the hostile reply")
    assert proc.alive()
    response = requests.get(proc.url + "/metrics", timeout=2)
    assert response.status_code == 200
    parse_metrics(response.text)
    imds.behaviour = Reply(body=document(9, event("E1"), event("E9", event_type="Redeploy")))
    wait_until(lambda: any(r["subject"] == "E9" for r in proc.records()), timeout=5, message="E9 reported")
    samples = proc.metrics()
    assert sample(samples, "azure_scheduled_events_document_incarnation") == 9
    assert proc.stop() == 0


@pytest.mark.slow
def test_a_bad_reply_is_counted_by_code_and_logged_once(imds: HostileImds,
                                                        collector: Callable[..., CollectorProcess]) -> None:
    imds.behaviour = Reply(body=document(1))
    proc = collector(imds.url, "--imds-max-reply-bytes", "65536", poll_interval=0.5)
    imds.behaviour = Reply(body=b"<html>proxy error</html>")
    wait_until(lambda: (sample(proc.metrics(), "azure_scheduled_events_imds_requests_total",
                               method="GET", code="invalid") or 0) >= 3, message="three invalid replies counted")
    imds.behaviour = Huge(1024 * 1024)
    wait_until(lambda: (sample(proc.metrics(), "azure_scheduled_events_imds_requests_total",
                               method="GET", code="too_large") or 0) >= 3, message="three large replies counted")
    assert sample(proc.metrics(), "azure_scheduled_events_imds_up") == 0
    proc.stop()
    log = proc.log()
    assert log.count("not a valid document") == 1, log
    assert log.count("larger than 65536 bytes") == 1, log


@pytest.mark.slow
@pytest.mark.parametrize("first", [True, False], ids=["first-call", "poll"])
def test_sigterm_during_a_hung_read_stops_within_two_seconds(imds: HostileImds,
                                                             collector: Callable[..., CollectorProcess],
                                                             first: bool) -> None:
    if first:
        imds.behaviour = Hang()
        proc = collector(imds.url, wait_ready=False)
    else:
        proc = collector(imds.url, "--imds-timeout", "60")
        imds.behaviour = Hang()
    hung = 0 if first else len(imds.events_requests())  # the first call may have arrived already
    wait_until(lambda: len(imds.events_requests()) > hung, message="a request to hang on")
    time.sleep(0.3)  # the scenario: the agent has been waiting on the hung read for a while
    assert proc.proc is not None
    started = time.monotonic()
    proc.proc.send_signal(signal.SIGTERM)
    code = proc.proc.wait(10)
    elapsed = time.monotonic() - started
    assert code == 0 and elapsed < 2.0, (elapsed, proc.log())


@pytest.mark.slow
@pytest.mark.parametrize("outage", [Reply(status=500, body=b"{}"), Reply(status=410, body=b"{}"), Reset()],
                         ids=["500", "410", "reset"])
def test_an_event_after_an_outage_is_seen_within_one_interval_plus_a_second(
        imds: HostileImds, collector: Callable[..., CollectorProcess], outage: Behaviour) -> None:
    imds.behaviour = Reply(body=document(1))
    proc = collector(imds.url, poll_interval=1.0)
    imds.behaviour = outage
    began = time.monotonic()
    time.sleep(12)  # the outage: long enough that count-based backoff reached its 10 s cap
    recovered = time.monotonic()
    imds.behaviour = Reply(body=document(2, event("E2", event_type="Preempt")))
    wait_until(lambda: any(r["subject"] == "E2" for r in proc.records()), timeout=5, message="E2 reported")
    first_good = min(r.at for r in imds.events_requests() if r.at >= recovered)
    assert first_good - recovered <= 1.0 + 1.0
    during = [r for r in imds.events_requests() if began <= r.at < recovered]
    assert len(during) <= 2 * (recovered - began) + 1, "more than 2 requests/s during the outage"


@pytest.mark.slow
@pytest.mark.parametrize("status", [429, 503])
def test_retry_after_is_honoured(imds: HostileImds, collector: Callable[..., CollectorProcess], status: int) -> None:
    imds.behaviour = Reply(body=document(1))
    proc = collector(imds.url, poll_interval=0.5)
    assert proc.alive()
    imds.behaviour = Reply(status=status, body=b"{}", headers={"Retry-After": "3"})
    began = time.monotonic()
    wait_until(lambda: len([r for r in imds.events_requests() if r.at >= began]) >= 3, timeout=15,
               message="three requests")
    times = [r.at for r in imds.events_requests() if r.at >= began][:3]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(gap >= 2.9 for gap in gaps), gaps


@pytest.mark.parametrize("name", [n for n in HOSTILE if n not in ("trickle", "endless-chunked")])
def test_events_command_reports_a_hostile_reply_without_a_traceback(imds: HostileImds, name: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from forewarn.cli import main

    imds.behaviour = HOSTILE[name]
    code = main(["events", "--imds-endpoint", imds.url, "--timeout", "1"])
    out, err = capsys.readouterr()
    assert code in (0, 1), (code, err)
    assert "Traceback" not in err
    if code == 1:
        assert err.startswith("forewarn events: ") and len(err.splitlines()) == 1, err
    else:
        assert "DocumentIncarnation" in out


def test_events_table_escapes_control_characters(imds: HostileImds, capsys: pytest.CaptureFixture[str]) -> None:
    from forewarn.cli import main

    imds.behaviour = Reply(body=document(1, event("E\x1b[2J", Description="line\nforged")))
    assert main(["events", "--imds-endpoint", imds.url]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "E\\x1b[2J" in out and "line\\nforged" in out
