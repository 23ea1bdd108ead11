"""The IMDS client against the simulator over real HTTP."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from forewarn import __version__
from forewarn.imds.client import ImdsClient, ImdsError, RateLimiter
from forewarn.imds.document import DocumentError
from forewarn.retry import Backoff, with_retries

from conftest import SimulatorHandle, wait_until


class Recorder(BaseHTTPRequestHandler):
    """A plain HTTP server that keeps the headers and client port of every request."""

    seen: list[dict[str, str]] = []
    ports: list[int] = []
    keep_alive = False

    def do_GET(self) -> None:
        Recorder.seen.append({k.lower(): v for k, v in self.headers.items()})
        Recorder.ports.append(self.client_address[1])
        body = b'{"DocumentIncarnation": 1, "Events": []}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class KeepAliveRecorder(Recorder):
    """The same over HTTP/1.1 keep-alive, closing a connection after 0.2 s idle (as servers do)."""

    protocol_version = "HTTP/1.1"
    timeout = 0.2


@pytest.fixture(params=[Recorder, KeepAliveRecorder], ids=["http1.0", "keep-alive"])
def recorder(request: pytest.FixtureRequest) -> Iterator[str]:
    Recorder.seen = []
    Recorder.ports = []
    Recorder.keep_alive = request.param is KeepAliveRecorder
    server = ThreadingHTTPServer(("127.0.0.1", 0), request.param)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_requests_carry_metadata_header_and_user_agent_but_no_forwarded_for(recorder: str) -> None:
    client = ImdsClient(recorder)
    for _ in range(3):  # the first call and the steady-state polls take different paths
        client.get_scheduled_events()
    assert len(Recorder.seen) == 3
    for headers in Recorder.seen:
        assert headers["metadata"] == "true"
        assert headers["user-agent"] == f"forewarn/{__version__}"
        assert "x-forwarded-for" not in headers


def test_steady_state_polls_share_one_kept_alive_connection(recorder: str) -> None:
    client = ImdsClient(recorder)
    for _ in range(4):  # no more: the rate limiter would hold a fifth past the server's idle timeout
        client.get_scheduled_events()
    polls = Recorder.ports[1:]  # after the first call, which goes through the requests session
    expected = 1 if Recorder.keep_alive else 3  # an HTTP/1.0 server closes every connection
    assert len(set(polls)) == expected


def test_a_connection_closed_by_the_server_while_idle_is_replaced(recorder: str) -> None:
    client = ImdsClient(recorder)
    client.get_scheduled_events()
    client.get_scheduled_events()
    time.sleep(0.5)  # the scenario: idle past the keep-alive server's 0.2 s timeout, so that it closes
    assert client.get_scheduled_events().incarnation == 1
    assert len(Recorder.seen) == 3


def test_proxy_settings_in_the_environment_are_bypassed(recorder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A proxy on a closed port: a client that honoured it would fail to connect.
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    client = ImdsClient(recorder)
    assert client.get_scheduled_events().incarnation == 1
    assert client.get_scheduled_events().incarnation == 1


def test_reads_documents_and_instance_metadata(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator("live-migration", speed=100)
    client = ImdsClient(sim.url)
    document = wait_until(lambda: (d := client.get_scheduled_events()).events and d, timeout=5, message="the event")
    assert document.events[0].event_type == "Freeze"
    vm = client.get_compute()
    assert vm.name == "WestNO_0" and vm.vm_scale_set == "WestNO" and vm.resource_id.startswith("/subscriptions/")


def client_after(sim: SimulatorHandle, polls: int) -> ImdsClient:
    """A client that has already polled `polls` times: the first call and later polls take different paths."""
    client = ImdsClient(sim.url)
    for _ in range(polls):
        client.get_scheduled_events()
    return client


@pytest.mark.parametrize("polls", [0, 2], ids=["first-call", "steady-state"])
@pytest.mark.parametrize(("fault", "code", "retryable"), [
    ("500", 500, True), ("503", 503, True), ("429", 429, True), ("410", 410, True), ("404", 404, False),
])
def test_http_errors_are_classified(simulator: Callable[..., SimulatorHandle], fault: str, code: int,
                                    retryable: bool, polls: int) -> None:
    sim = simulator()
    client = client_after(sim, polls)
    sim.sim.faults.queue.append(fault)
    with pytest.raises(ImdsError) as info:
        client.get_scheduled_events()
    assert info.value.code == code and info.value.retryable is retryable
    assert f"HTTP {code}" in str(info.value)
    if code in (429, 503):
        assert info.value.retry_after == 1.0
    assert client.get_scheduled_events().incarnation >= 1  # and the next poll works again


def test_bad_api_version_is_a_400_that_is_not_retried(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator()
    with pytest.raises(ImdsError) as info:
        ImdsClient(sim.url, api_version="2099-01-01").get_scheduled_events()
    assert info.value.code == 400 and not info.value.retryable
    assert "api-version" in str(info.value)


@pytest.mark.parametrize("polls", [0, 2], ids=["first-call", "steady-state"])
def test_connection_reset_is_retryable(simulator: Callable[..., SimulatorHandle], polls: int) -> None:
    sim = simulator()
    client = client_after(sim, polls)
    sim.sim.faults.queue.append("reset")
    with pytest.raises(ImdsError) as info:
        client.get_scheduled_events()
    assert info.value.code is None and info.value.retryable
    assert "connection failed" in str(info.value)
    assert client.get_scheduled_events().incarnation >= 1


@pytest.mark.parametrize("polls", [0, 2], ids=["first-call", "steady-state"])
def test_malformed_document_is_a_document_error(simulator: Callable[..., SimulatorHandle], polls: int) -> None:
    sim = simulator()
    client = client_after(sim, polls)
    sim.sim.faults.queue.append("malformed")
    with pytest.raises(DocumentError):
        client.get_scheduled_events()


def test_an_unreachable_endpoint_is_a_retryable_transport_error(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator()
    client = client_after(sim, 1)
    sim.stop()
    with pytest.raises(ImdsError) as info:
        client.get_scheduled_events()
    assert info.value.code is None and info.value.retryable


def test_first_call_may_take_long_but_later_calls_time_out(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator()
    sim.sim.faults.slow_first = 1.5
    client = ImdsClient(sim.url, timeout=0.5, first_timeout=10)
    assert client.get_scheduled_events().incarnation >= 1
    sim.sim.faults.latency = 1.5
    with pytest.raises(ImdsError, match=r"no complete answer within 0\.5 s") as info:
        client.get_scheduled_events()
    assert info.value.retryable


def test_with_retries_rides_out_passing_errors(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator()
    sim.sim.faults.queue.extend(["500", "410", "reset"])
    sleeps: list[float] = []
    document = with_retries(ImdsClient(sim.url).get_scheduled_events, attempts=4, sleep=sleeps.append)
    assert document.incarnation >= 1 and len(sleeps) == 3


def test_with_retries_gives_up_at_once_on_other_4xx(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator()
    sim.sim.faults.queue.extend(["404", "500"])
    sleeps: list[float] = []
    with pytest.raises(ImdsError):
        with_retries(ImdsClient(sim.url).get_scheduled_events, sleep=sleeps.append)
    assert sleeps == []


def test_rate_limiter_never_allows_more_than_five_in_a_window() -> None:
    now = [0.0]
    limiter = RateLimiter(limit=5, window=1.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    stamps = []
    for _ in range(23):
        limiter.acquire()
        stamps.append(now[0])
    for i in range(len(stamps) - 5):
        assert stamps[i + 5] - stamps[i] >= 1.0


def test_a_caller_with_a_reserve_leaves_room_for_others() -> None:
    now = [0.0]
    limiter = RateLimiter(limit=5, window=1.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    polls = []
    for _ in range(12):
        limiter.acquire(reserve=1)
        polls.append(now[0])
    for i in range(len(polls) - 4):
        assert polls[i + 4] - polls[i] >= 1.0  # polls alone: at most 4 in any window
    moment = now[0]
    limiter.acquire()  # the fifth slot is free for anyone else, at once
    assert now[0] == moment


def test_client_stays_within_the_imds_budget_under_pressure(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator()
    client = ImdsClient(sim.url)
    threads = [threading.Thread(target=lambda: [client.get_scheduled_events() for _ in range(4)]) for _ in range(3)]
    threads.append(threading.Thread(target=lambda: [client.get_compute() for _ in range(4)]))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sim.sim.rate_violations == 0 and sim.sim.max_rate("forewarn/") == 5
    assert sum(sim.sim.requests.values()) == 16


def test_an_approval_does_not_wait_behind_polls_that_use_the_budget(
        simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator({"name": "one", "events": [{"id": "E1", "type": "Reboot", "notice": 900}]})
    client = ImdsClient(sim.url)
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            client.get_scheduled_events()

    poller = threading.Thread(target=poll)
    poller.start()
    # polling as fast as the budget allows: wait until it has used more than one second's budget
    wait_until(lambda: sum(sim.sim.requests.values()) >= 6, timeout=10, message="the budget in use")
    started = time.monotonic()
    client.start_events(["E1"])
    waited = time.monotonic() - started
    stop.set()
    poller.join()
    assert waited < 0.1
    assert sim.sim.rate_violations == 0 and sim.sim.max_rate("forewarn/") <= 5


def test_backoff_is_capped_and_jittered() -> None:
    backoff = Backoff(base=1.0, cap=8.0)
    delays = [backoff.delay(n) for n in range(10)]
    assert all(0.5 <= d <= 8.0 for d in delays)
    assert max(delays[5:]) > 4.0
    assert len({round(d, 6) for d in delays[5:]}) > 1
