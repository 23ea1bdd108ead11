"""Signals and stopping: SIGHUP reloads the policy, SIGTERM/SIGQUIT stop cleanly within the drain bound.

Subprocess tests run the real `forewarn run`; the parallel drain is also checked in-process with sinks
that take their time (a sink is the extension point, so a test sink is one more implementation of it).
"""

from __future__ import annotations

import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from forewarn.imds.document import parse_document
from forewarn.imds.instance import VmInfo
from forewarn.outbox.delivery import DeliveryWorker, stop_workers
from forewarn.outbox.outbox import Outbox
from forewarn.records import Record, to_record
from forewarn.tracker import diff_documents

from conftest import CollectorProcess, SimulatorHandle, sample, wait_for_polls, wait_until

RELOAD_OK = "azure_scheduled_events_policy_last_reload_successful"
RELOAD_AT = "azure_scheduled_events_policy_last_reload_success_timestamp_seconds"
HOLD_ALL = "version: 1\nrules:\n  - name: hold-all\n    action: hold\n"
APPROVE_USER = ("version: 1\nrules:\n  - name: user-initiated\n    match:\n      source: [User]\n"
                "    action: approve\n  - name: hold-rest\n    action: hold\n")


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def signal_and_wait(proc: CollectorProcess, signum: int, timeout: float = 15) -> tuple[int, float]:
    """Send `signum`; the exit code and the seconds until the process ended."""
    assert proc.proc is not None
    started = time.monotonic()
    proc.proc.send_signal(signum)
    code = proc.proc.wait(timeout)
    elapsed = time.monotonic() - started
    proc.stop()  # already ended: this only closes its log
    return code, elapsed


# --- SIGHUP: reload the policy -----------------------------------------------------------------------

@pytest.mark.slow
def test_sighup_without_a_policy_logs_that_and_keeps_running(collector: Callable[..., CollectorProcess]) -> None:
    proc = collector("http://127.0.0.1:9", "--simulate", "quiet")
    assert proc.proc is not None
    proc.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "no --policy to reload" in proc.log(), message="the SIGHUP log line")
    wait_for_polls(proc, 2)
    assert proc.alive()
    assert sample(proc.metrics(), RELOAD_OK) is None          # no policy: nothing to reload, no reload gauges


@pytest.mark.slow
def test_sighup_applies_a_changed_policy_to_future_decisions(
        tmp_path: Path, simulator: Callable[..., SimulatorHandle],
        collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator("user-reboot")  # a user-initiated Reboot, NotBefore 15 minutes ahead
    policy = tmp_path / "policy.yaml"
    proc = collector(sim.url, "--policy", write(policy, HOLD_ALL))
    wait_until(lambda: "rule hold-all holds it" in proc.log(), message="the hold under the first policy")
    loaded_at = sample(proc.metrics(), RELOAD_AT)
    assert sample(proc.metrics(), RELOAD_OK) == 1 and loaded_at, "the load at start counts as a success"
    wait_for_polls(proc, 2)
    assert sim.sim.approval_posts == []
    write(policy, APPROVE_USER)
    assert proc.proc is not None
    proc.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: sim.sim.approval_posts, timeout=10, message="the approval under the new policy")
    samples = proc.metrics()
    assert sample(samples, RELOAD_OK) == 1 and (sample(samples, RELOAD_AT) or 0) > loaded_at
    assert f"reloaded policy {policy}: 2 rule(s)" in proc.log()


@pytest.mark.slow
def test_sighup_with_a_broken_policy_keeps_the_old_one_and_says_where(
        tmp_path: Path, simulator: Callable[..., SimulatorHandle],
        collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator("user-reboot")
    policy = tmp_path / "policy.yaml"
    proc = collector(sim.url, "--policy", write(policy, HOLD_ALL))
    loaded_at = sample(proc.metrics(), RELOAD_AT)
    write(policy, "version: 1\nrules:\n  - name: approve-all\n    action: aprove\n")
    assert proc.proc is not None
    proc.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: sample(proc.metrics(), RELOAD_OK) == 0, message="the failed reload in the metrics")
    assert sample(proc.metrics(), RELOAD_AT) == loaded_at
    assert f"{policy}:4: rules[0].action" in proc.log() and "keeping the previous policy" in proc.log()
    wait_for_polls(proc, 3)
    assert proc.alive() and sim.sim.approval_posts == [], "the old policy still holds"
    write(policy, APPROVE_USER)  # fixed: the next SIGHUP takes it
    proc.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: sim.sim.approval_posts, timeout=10, message="the approval under the fixed policy")
    assert sample(proc.metrics(), RELOAD_OK) == 1
    assert "Traceback" not in proc.log()


# --- stopping: a hung sink may take at most --drain-timeout ---------------------------------------------

class SilentServer:
    """Accepts TCP connections on loopback and never reads or answers: a sink endpoint that hangs."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def stop(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def silent() -> Iterator[SilentServer]:
    server = SilentServer()
    yield server
    server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGQUIT], ids=["SIGTERM", "SIGQUIT"])
def test_stop_with_a_hung_sink_ends_within_the_drain_timeout_and_keeps_the_outbox(
        simulator: Callable[..., SimulatorHandle], collector: Callable[..., CollectorProcess],
        silent: SilentServer, signum: int) -> None:
    sim = simulator("user-reboot")
    proc = collector(sim.url, "--sink", "otlp", "--otlp-protocol", "http/protobuf",
                     "--otlp-endpoint", f"http://127.0.0.1:{silent.port}/v1/logs", "--drain-timeout", "2",
                     env={"OTEL_EXPORTER_OTLP_TIMEOUT": "120"})
    file_sink = f"file:{proc.records_path}"
    wait_until(lambda: sample(proc.metrics(), "azure_scheduled_events_outbox_records", sink=file_sink) == 0
               and proc.records(), message="the record, delivered to the file sink")
    wait_until(lambda: silent.accepted, message="the OTLP export, hung on the silent endpoint")
    code, elapsed = signal_and_wait(proc, signum)
    assert code == 0, proc.log()
    assert elapsed < 2 + 2 + 0.5, elapsed
    log = proc.log()
    assert f"received {signal.Signals(signum).name}, stopping" in log and log.rstrip().endswith("stopped"), log
    assert "still delivering to otlp" in log
    assert re.search(r"records left in the outbox at stop: .*\botlp [1-9].*; delivered after the next start", log)
    assert f"{file_sink} 0" in log
    outbox = Outbox(proc.state_dir, ["otlp", file_sink])
    try:
        assert outbox.backlog("otlp").records >= 1, "what the hung sink did not take stays in the outbox"
        assert outbox.backlog(file_sink).records == 0
    finally:
        outbox.close()


# --- in-process: sinks drain in parallel ------------------------------------------------------------------

class SlowSink:
    """Takes `seconds` to accept each batch, or hangs until released when `seconds` is None."""

    def __init__(self, name: str, seconds: float | None) -> None:
        self.name = name
        self.seconds = seconds
        self.sending = threading.Event()
        self.release = threading.Event()
        self.received: list[Record] = []

    def send(self, records: Sequence[Record]) -> None:
        self.sending.set()
        if self.seconds is None:
            self.release.wait(30)
            raise ConnectionError("released")
        time.sleep(self.seconds)  # the sink's own latency, which the drain must overlap
        self.received.extend(records)

    def close(self) -> None:
        return None


def one_record() -> list[Record]:
    document = parse_document({"DocumentIncarnation": 1, "Events": [
        {"EventId": "E1", "EventType": "Reboot", "Resources": ["vm-0"], "EventStatus": "Scheduled",
         "NotBefore": ""}]})
    return [to_record(change, VmInfo(name="vm-0"), datetime.now(timezone.utc))
            for change in diff_documents(None, document)]


def drain(tmp_path: Path, sinks: Sequence[Any], timeout: float) -> tuple[float, Outbox, list[str]]:
    outbox = Outbox(tmp_path, [sink.name for sink in sinks])
    workers = [DeliveryWorker(sink, outbox) for sink in sinks]
    for worker in workers:
        worker.start()
    outbox.append(one_record())
    for sink in sinks:
        assert sink.sending.wait(5)
    started = time.monotonic()
    late = stop_workers(workers, timeout)
    return time.monotonic() - started, outbox, late


def test_sinks_drain_in_parallel(tmp_path: Path) -> None:
    sinks = [SlowSink(f"slow{i}", 0.6) for i in range(3)]
    elapsed, outbox, late = drain(tmp_path, sinks, timeout=5)
    try:
        assert elapsed < 1.2, f"three 0.6 s sends took {elapsed:.2f} s: not in parallel"
        assert late == [] and all(len(sink.received) == 1 for sink in sinks)
        assert all(outbox.backlog(sink.name).records == 0 for sink in sinks)
    finally:
        outbox.close()


def test_hung_sinks_are_bounded_together_by_the_drain_timeout(tmp_path: Path) -> None:
    sinks = [SlowSink(f"hung{i}", None) for i in range(3)]
    elapsed, outbox, late = drain(tmp_path, sinks, timeout=0.5)
    try:
        assert elapsed < 0.5 + 0.5, elapsed
        assert sorted(late) == ["hung0", "hung1", "hung2"]
        assert all(outbox.backlog(sink.name).records == 1 for sink in sinks), "undelivered records stay"
    finally:
        for sink in sinks:
            sink.release.set()
        outbox.close()


# --- a sink that is down: the stop tries once, at once, and says what is left ------------------------------

class DownSink:
    """Refuses every batch at once, as a sink whose peer refuses connections does."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.attempts = 0

    def send(self, records: Sequence[Record]) -> None:
        self.attempts += 1
        raise ConnectionError("connection refused")

    def close(self) -> None:
        return None


def test_a_stop_does_not_sleep_out_the_backoff_of_a_sink_that_is_down(tmp_path: Path) -> None:
    from forewarn.retry import Backoff

    sink = DownSink("down")
    outbox = Outbox(tmp_path, [sink.name])
    worker = DeliveryWorker(sink, outbox, backoff=Backoff(base=30, cap=30))
    worker.start()
    try:
        outbox.append(one_record())
        wait_until(lambda: sink.attempts == 1, message="the first, failed send")
        started = time.monotonic()
        late = stop_workers([worker], 5)
        elapsed = time.monotonic() - started
        assert elapsed < 1, f"the stop waited {elapsed:.2f} s: it slept out the worker's backoff"
        assert late == [] and sink.attempts == 2, "the drain tries the sink once more, then gives up"
        assert outbox.backlog(sink.name).records == 1
    finally:
        outbox.close()


def test_the_stop_logs_what_each_sink_leaves_in_the_outbox(tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    from forewarn.outbox.delivery import finish_delivery

    down, slow = DownSink("down"), SlowSink("file:/x.jsonl", 0)
    outbox = Outbox(tmp_path, [down.name, slow.name])
    workers = [DeliveryWorker(sink, outbox) for sink in (down, slow)]
    for worker in workers:
        worker.start()
    try:
        outbox.append(one_record() * 3)
        wait_until(lambda: down.attempts >= 1 and len(slow.received) == 3, message="the first sends")
        with caplog.at_level("INFO", logger="forewarn.outbox.delivery"):
            finish_delivery(workers, [down, slow], 5)
        lines = [r for r in caplog.records if r.getMessage().startswith("records left in the outbox at stop")]
        assert [r.getMessage() for r in lines] == [
            "records left in the outbox at stop: down 3, file:/x.jsonl 0; delivered after the next start"]
        assert lines[0].levelname == "WARNING"
    finally:
        outbox.close()
    memory = Outbox(None, [slow.name])
    workers = [DeliveryWorker(SlowSink(slow.name, 0), memory)]
    workers[0].start()
    try:
        caplog.clear()
        with caplog.at_level("INFO", logger="forewarn.outbox.delivery"):
            finish_delivery(workers, [], 1)
        assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
            ("INFO", "records left in the outbox at stop: file:/x.jsonl 0")]
    finally:
        memory.close()
