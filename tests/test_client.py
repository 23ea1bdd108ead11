"""The IMDS client against the simulator over real HTTP."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from forewarn import __version__
from forewarn.imds.client import Backoff, ImdsClient, ImdsError, RateLimiter, with_retries
from forewarn.imds.document import DocumentError

from conftest import SimulatorHandle


class Recorder(BaseHTTPRequestHandler):
    """A plain HTTP server that keeps the headers of every request."""

    seen: list[dict[str, str]] = []

    def do_GET(self) -> None:
        Recorder.seen.append({k.lower(): v for k, v in self.headers.items()})
        body = b'{"DocumentIncarnation": 1, "Events": []}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[str]:
    Recorder.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_requests_carry_metadata_header_and_user_agent_but_no_forwarded_for(recorder: str) -> None:
    ImdsClient(recorder).get_scheduled_events()
    (headers,) = Recorder.seen
    assert headers["metadata"] == "true"
    assert headers["user-agent"] == f"forewarn/{__version__}"
    assert "x-forwarded-for" not in headers


def test_proxy_settings_in_the_environment_are_bypassed(recorder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A proxy on a closed port: a client that honoured it would fail to connect.
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    assert ImdsClient(recorder).get_scheduled_events().incarnation == 1


def test_reads_documents_and_instance_metadata(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator("live-migration", speed=100)
    client = ImdsClient(sim.url)
    time.sleep(0.1)
    document = client.get_scheduled_events()
    assert document.events[0].event_type == "Freeze"
    vm = client.get_compute()
    assert vm.name == "WestNO_0" and vm.vm_scale_set == "WestNO" and vm.resource_id.startswith("/subscriptions/")


@pytest.mark.parametrize(("fault", "code", "retryable"), [
    ("500", 500, True), ("503", 503, True), ("429", 429, True), ("410", 410, True), ("404", 404, False),
])
def test_http_errors_are_classified(simulator: Callable[..., SimulatorHandle], fault: str, code: int,
                                    retryable: bool) -> None:
    sim = simulator()
    sim.sim.faults.queue.append(fault)
    with pytest.raises(ImdsError) as info:
        ImdsClient(sim.url).get_scheduled_events()
    assert info.value.code == code and info.value.retryable is retryable


def test_bad_api_version_is_a_400_that_is_not_retried(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator()
    with pytest.raises(ImdsError) as info:
        ImdsClient(sim.url, api_version="2099-01-01").get_scheduled_events()
    assert info.value.code == 400 and not info.value.retryable
    assert "api-version" in str(info.value)


def test_connection_reset_is_retryable(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator()
    sim.sim.faults.queue.append("reset")
    with pytest.raises(ImdsError) as info:
        ImdsClient(sim.url).get_scheduled_events()
    assert info.value.code is None and info.value.retryable


def test_malformed_document_is_a_document_error(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator()
    sim.sim.faults.queue.append("malformed")
    with pytest.raises(DocumentError):
        ImdsClient(sim.url).get_scheduled_events()


def test_first_call_may_take_long_but_later_calls_time_out(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator()
    sim.sim.faults.slow_first = 1.5
    client = ImdsClient(sim.url, timeout=0.5, first_timeout=10)
    assert client.get_scheduled_events().incarnation >= 1
    sim.sim.faults.latency = 1.5
    with pytest.raises(ImdsError, match=r"no answer within 0\.5 s") as info:
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


def test_client_stays_within_the_imds_budget_under_pressure(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator()
    client = ImdsClient(sim.url)
    threads = [threading.Thread(target=lambda: [client.get_scheduled_events() for _ in range(4)]) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sim.sim.rate_violations == 0 and sim.sim.max_rate("forewarn/") == 5
    assert sum(sim.sim.requests.values()) == 12


def test_backoff_is_capped_and_jittered() -> None:
    backoff = Backoff(base=1.0, cap=8.0)
    delays = [backoff.delay(n) for n in range(10)]
    assert all(0.5 <= d <= 8.0 for d in delays)
    assert max(delays[5:]) > 4.0
    assert len({round(d, 6) for d in delays[5:]}) > 1
