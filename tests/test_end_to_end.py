"""`forewarn run` as a real process against the simulator over loopback HTTP."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from conftest import (
    CollectorProcess,
    SimulatorHandle,
    parse_metrics,
    require_promtool,
    sample,
    series,
    wait_settled,
    wait_until,
)

pytestmark = pytest.mark.slow

H = {"Metadata": "true"}


def changes(proc: CollectorProcess) -> list[tuple[str, str, str | None]]:
    """(change, status, outcome) for every record, in order."""
    return [(r["data"]["change"], r["data"]["event"]["EventStatus"], r["data"].get("outcome")) for r in proc.records()]


def approve(sim: SimulatorHandle, event_id: str) -> None:
    """Approve as another caller on the VM would; it shares the 5/s budget, so a 429 is retried."""
    for _ in range(5):
        response = requests.post(sim.url + "/metadata/scheduledevents?api-version=2020-07-01", headers=H,
                                 json={"StartRequests": [{"EventId": event_id}]}, timeout=5)
        if response.status_code != 429:
            break
        time.sleep(1)  # pacing, not waiting for a state: the budget is per second
    assert response.status_code == 200


@dataclass(frozen=True)
class Case:
    scenario: str
    speed: float
    expected: list[tuple[str, str, str | None]]
    approve: bool = False
    affects: bool = True


LIFECYCLE = [("added", "Scheduled", None), ("updated", "Started", None), ("removed", "Started", "completed")]
CASES = [
    Case("live-migration", 10, LIFECYCLE, approve=True),  # Started lasts 15 s / 10: several polls
    Case("user-reboot", 100, LIFECYCLE, approve=True),
    Case("user-redeploy", 200, LIFECYCLE, approve=True),
    Case("platform-reboot", 200, LIFECYCLE, approve=True),
    Case("spot-preempt", 30, LIFECYCLE),
    Case("terminate", 100, LIFECYCLE),
    Case("hardware-failure", 200, [("added", "Started", None), ("removed", "Started", "completed")]),
    Case("cancelled-maintenance", 60, [("added", "Scheduled", None), ("removed", "Scheduled", "cancelled")]),
    Case("other-vm", 1, [("added", "Scheduled", None)], affects=False),
    Case("degraded-hardware", 1, [("added", "Scheduled", None)]),
]


@pytest.mark.parametrize("case", CASES, ids=[c.scenario for c in CASES])
def test_scenario_is_reported_in_records_and_metrics(case: Case, simulator: Callable[..., SimulatorHandle],
                                                     collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator(case.scenario, speed=case.speed)
    proc = collector(sim.url)
    first = wait_until(lambda: proc.records(), timeout=15, message="first record")[0]
    event_id = first["subject"]
    samples = proc.metrics()
    (info,) = series(samples, "azure_scheduled_event_info")
    assert info["event_id"] == event_id
    assert info["affects_this_vm"] == ("true" if case.affects else "false")
    assert sample(samples, "azure_scheduled_events_observed_total", event_type=info["event_type"],
                  event_source=info["event_source"]) == 1
    if case.approve:
        approve(sim, event_id)
    wait_until(lambda: len(changes(proc)) >= len(case.expected), timeout=20, message=str(case.expected))
    wait_settled(proc)  # time for a change too many to show up
    assert changes(proc) == case.expected
    assert all(r["subject"] == event_id for r in proc.records())
    assert len({r["id"] for r in proc.records()}) == len(case.expected)
    samples = proc.metrics()
    if case.expected[-1][0] == "removed":
        assert series(samples, "azure_scheduled_event_info") == []
        assert sample(samples, "azure_scheduled_events_ended_total", event_type=info["event_type"],
                      outcome=case.expected[-1][2]) == 1
    assert sim.sim.max_rate("forewarn/") <= 5
    assert proc.stop() == 0


def test_degraded_hardware_countdown_is_days(simulator: Callable[..., SimulatorHandle],
                                             collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator("degraded-hardware")
    proc = collector(sim.url)
    wait_until(lambda: proc.records(), timeout=10)
    name = "azure_scheduled_event_seconds_to_not_before"
    (countdown,) = [value for (metric, _), value in proc.metrics().items() if metric == name]
    assert 7 * 86400 - 30 < countdown <= 7 * 86400


def test_tour_several_events_at_once_and_promtool_accepts_real_output(
        simulator: Callable[..., SimulatorHandle], collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator("tour", speed=50)
    proc = collector(sim.url)
    wait_until(lambda: len(series(proc.metrics(), "azure_scheduled_event_info")) >= 3, timeout=15)
    result = subprocess.run([require_promtool(), "check", "metrics"], input=proc.metrics_text().encode(),
                            capture_output=True, timeout=30)
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), result
    assert proc.stop() == 0


def test_old_api_version(simulator: Callable[..., SimulatorHandle],
                         collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator("platform-reboot")
    proc = collector(sim.url, "--api-version", "2017-08-01")
    record = wait_until(lambda: proc.records(), timeout=10)[0]
    assert "EventSource" not in record["data"]["event"] and "DurationInSeconds" not in record["data"]["event"]
    samples = proc.metrics()
    assert series(samples, "azure_scheduled_event_duration_seconds") == []
    assert series(samples, "azure_scheduled_event_info")[0]["event_source"] == ""


FAULTS = ["500", "503", "429", "410", "404", "reset", "malformed", "timeout"]


@pytest.mark.parametrize("fault", FAULTS)
def test_faults_keep_the_collector_running_and_lose_nothing(fault: str, simulator: Callable[..., SimulatorHandle],
                                                            collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator("quiet")
    sim.server.timeout_fault_seconds = 3.0
    proc = collector(sim.url, "--imds-timeout", "1", "--imds-max-backoff", "1")
    requests.post(sim.url + "/admin/events", json={"type": "Reboot", "notice": 900, "id": "EV-1"}, timeout=5)
    wait_until(lambda: proc.records(), timeout=10, message="added before the outage")
    sim.sim.faults.queue.extend([fault] * 4)
    wait_until(lambda: proc.metrics()[("azure_scheduled_events_imds_up", ())] == 0, timeout=10, message="imds_up 0")
    # the last known event is kept while IMDS fails
    assert [r["event_id"] for r in series(proc.metrics(), "azure_scheduled_event_info")] == ["EV-1"]
    requests.delete(sim.url + "/admin/events/EV-1", timeout=5)
    wait_until(lambda: len(proc.records()) == 2, timeout=20, message="removal after the outage")
    samples = proc.metrics()
    assert samples[("azure_scheduled_events_imds_up", ())] == 1
    assert changes(proc) == [("added", "Scheduled", None), ("removed", "Scheduled", "cancelled")]
    if fault == "malformed":
        assert samples[("azure_scheduled_events_document_errors_total", ())] >= 4
    elif fault in ("reset", "timeout"):
        assert sample(samples, "azure_scheduled_events_imds_requests_total", method="GET", code="error") >= 4
    else:
        assert sample(samples, "azure_scheduled_events_imds_requests_total", method="GET", code=fault) >= 4
    assert sim.sim.max_rate("forewarn/") <= 5
    log = proc.log()
    assert log.count("ERROR   forewarn.poller") + log.count("ERROR") <= 2, log  # once per state change
    assert "recovered" in log
    assert proc.stop() == 0


def test_slow_first_call_is_not_a_failure(simulator: Callable[..., SimulatorHandle],
                                          collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator("platform-reboot")
    sim.sim.faults.slow_first = 4.0
    proc = collector(sim.url, "--imds-timeout", "1", wait_ready=False)
    assert requests.get(proc.url + "/readyz", timeout=2).status_code == 503
    wait_until(proc.ready, timeout=15, message="ready after the slow first answer")
    wait_until(lambda: proc.records(), timeout=5)
    assert "ERROR" not in proc.log()
    assert sum(sim.sim.requests.values()) <= 3


def test_latency_does_not_lose_changes(simulator: Callable[..., SimulatorHandle],
                                       collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator("cancelled-maintenance", speed=30)
    sim.sim.faults.latency = 0.3
    proc = collector(sim.url)
    wait_until(lambda: len(proc.records()) == 2, timeout=20)
    assert changes(proc) == [("added", "Scheduled", None), ("removed", "Scheduled", "cancelled")]


def test_readyz_fails_when_polls_keep_failing(simulator: Callable[..., SimulatorHandle],
                                              collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator("quiet")
    proc = collector(sim.url, "--ready-window", "1", "--imds-max-backoff", "0.5")
    sim.sim.faults.rates = {"500": 1.0}
    wait_until(lambda: requests.get(proc.url + "/readyz", timeout=2).status_code == 503, timeout=10)
    assert requests.get(proc.url + "/healthz", timeout=2).status_code == 200
    sim.sim.faults.rates = {}
    wait_until(proc.ready, timeout=10, message="ready again")


def test_restart_after_sigkill_reports_nothing_twice_and_what_vanished_meanwhile(
        simulator: Callable[..., SimulatorHandle], collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator("quiet")
    for event_id in ("KEEP", "GONE"):
        requests.post(sim.url + "/admin/events", json={"type": "Reboot", "notice": 900, "id": event_id}, timeout=5)
    proc = collector(sim.url)
    wait_until(lambda: len(proc.records()) == 2, timeout=10)
    proc.kill()
    requests.delete(sim.url + "/admin/events/GONE", timeout=5)
    again = collector(sim.url)
    assert again.records_path == proc.records_path
    expected = [("KEEP", "added"), ("GONE", "added"), ("GONE", "removed")]

    def changes_seen() -> list[tuple[str, str]]:
        return list(dict.fromkeys((r["subject"], r["data"]["change"]) for r in again.records()))

    wait_until(lambda: sorted(changes_seen()) == sorted(expected), timeout=10, message="removal reported after restart")
    wait_settled(again)
    # Delivery is at least once: a record written just before the kill may be written again after the restart,
    # but only as the same record (same id). What must not happen is the same change under a second id.
    records = again.records()
    by_id: dict[str, dict[str, object]] = {}
    for record in records:
        assert by_id.setdefault(record["id"], record) == record, "a repeated id carries the same record"
    ids_per_change: dict[tuple[str, str], set[str]] = {}
    for record in records:
        ids_per_change.setdefault((record["subject"], record["data"]["change"]), set()).add(record["id"])
    assert ids_per_change.keys() == set(expected)
    assert all(len(ids) == 1 for ids in ids_per_change.values()), ids_per_change
    assert changes_seen() == expected, "first deliveries in the order the changes happened"
    removed = next(r for r in records if r["data"]["change"] == "removed")
    assert removed["subject"] == "GONE" and removed["data"]["outcome"] == "cancelled"
    samples = again.metrics()
    assert sample(samples, "azure_scheduled_events_observed_total", event_type="Reboot", event_source="Platform") == 0
    assert [r["event_id"] for r in series(samples, "azure_scheduled_event_info")] == ["KEEP"]
    assert again.stop() == 0


def test_unusable_state_dir_keeps_polling_and_delivering(tmp_path: Path, simulator: Callable[..., SimulatorHandle],
                                                          collector: Callable[..., CollectorProcess]) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the state dir's parent should be")
    sim = simulator("platform-reboot")
    proc = collector(sim.url, "--state-dir", str(blocker / "state"))
    wait_until(lambda: proc.records(), timeout=10)
    assert proc.metrics()[("azure_scheduled_events_state_writable", ())] == 0
    assert "unusable" in proc.log()
    assert proc.stop() == 0


def test_sigterm_and_sigint_stop_cleanly(simulator: Callable[..., SimulatorHandle],
                                         collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator("quiet")
    proc = collector(sim.url)
    assert proc.stop() == 0
    other = collector(sim.url, name="other")
    assert other.proc is not None
    other.proc.send_signal(2)
    time.sleep(0.05)  # signals sent together merge into one; a terminal and a supervisor may each send one
    other.proc.send_signal(2)
    assert other.proc.wait(10) == 0
    assert "Traceback" not in other.log()
    assert other.log().count("received SIGINT, stopping") == 1


def test_records_match_what_the_stdout_sink_prints(simulator: Callable[..., SimulatorHandle],
                                                   tmp_path: Path) -> None:
    import json
    import os
    import signal
    import sys

    from conftest import free_port

    sim = simulator("hardware-failure", speed=100)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "forewarn", "run", "--imds-endpoint", sim.url, "--listen-address",
                             f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "s"), "--poll-interval", "0.2",
                             "--log-format", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ})
    wait_until(lambda: len(sim.sim.transitions) >= 2, timeout=20)

    def printed() -> float | None:
        try:
            text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
        except requests.RequestException:
            return None  # not listening yet
        return sample(parse_metrics(text), "azure_scheduled_events_records_total", sink="stdout")

    wait_until(lambda: printed() == 2, timeout=15, message="both records printed")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0
    records = [json.loads(line) for line in out.decode().splitlines()]
    assert [r["data"]["change"] for r in records] == ["added", "removed"]
    logs = [json.loads(line) for line in err.decode().splitlines()]
    assert all({"time", "level", "logger", "message"} <= set(entry) for entry in logs)
    assert any("starting with" in entry["message"] for entry in logs)




def test_simulated_run_without_a_state_dir_removes_its_temporary_state_at_stop(tmp_path: Path) -> None:
    import os
    import signal
    import sys

    from forewarn.outbox.store import DB_FILE

    from conftest import free_port

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "forewarn", "run", "--simulate", "quiet", "--listen-address",
                             f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "TMPDIR": str(scratch)})
    try:
        (state,) = wait_until(lambda: list(scratch.glob("forewarn-sim-*")), timeout=10, message="the state dir")
        wait_until(lambda: (state / DB_FILE).exists(), timeout=10, message="the store in it")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err.decode(errors="replace")
    assert list(scratch.iterdir()) == [], "a simulated run keeps nothing once stopped"
