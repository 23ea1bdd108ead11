"""The built-in scenarios for behaviours beyond the plain Scheduled -> Started -> gone life of one event:
events that appear already Started, a Reboot that becomes a Freeze, Terminate, a Spot eviction with a few
seconds' notice, and one document for several hosts of a scale set.

The simulator-level tests step an injected clock through every scenario; the others run the real
collector (`forewarn run` as a subprocess) against the simulator over loopback and check what a user
sees: the records in order and the metrics.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import requests

from forewarn.imds.document import API_VERSIONS, parse_document, parse_not_before
from forewarn.simulator import SCENARIOS, Scenario, Simulator, load_scenario

from conftest import CollectorProcess, SimulatorHandle, free_port, sample, series, wait_until

H = {"Metadata": "true"}
SE = "/metadata/scheduledevents?api-version=2020-07-01"
NEW = ["hardware-redeploy", "policy-auto-approved", "reboot-becomes-freeze", "terminate-long-notice",
       "spot-short-notice", "scale-set-hosts"]

Change = tuple[str, str, str, str | None]   # (EventId, change, EventStatus, outcome)


# --- helpers ---------------------------------------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def boundaries(scenario: Scenario) -> list[float]:
    """Every scenario time at which the document can change, and a moment just after each: the timeline is
    constant in between, so looking there sees every incarnation it serves (two rounds of a looping one)."""
    times = {0.0}
    for k in range(2 if scenario.loop else 1):
        offset = k * (scenario.loop or 0.0)
        for spec in scenario.events:
            start = spec.at + (spec.notice or 0.0)
            for t in (spec.at, start, start + spec.run_for,
                      spec.at + spec.cancel_after if spec.cancel_after is not None else spec.at):
                times.update((offset + t, offset + t + 0.5))
    return sorted(times)


def served(name: str) -> list[tuple[float, dict[str, Any]]]:
    """(scenario time, newest-format document) for every incarnation the scenario serves, unapproved."""
    clock = FakeClock()
    sim = Simulator(SCENARIOS[name], clock=clock)
    documents: list[tuple[float, dict[str, Any]]] = []
    for t in boundaries(SCENARIOS[name]):
        clock.now = t
        document = sim.document("2020-07-01")
        if not documents or documents[-1][1]["DocumentIncarnation"] != document["DocumentIncarnation"]:
            documents.append((t, document))
    return documents


def changes(proc: CollectorProcess) -> list[Change]:
    return [(r["subject"], r["data"]["change"], r["data"]["event"]["EventStatus"], r["data"].get("outcome"))
            for r in proc.records()]


def lifecycle(event_id: str, first_status: str = "Scheduled") -> list[Change]:
    if first_status == "Started":
        return [(event_id, "added", "Started", None), (event_id, "removed", "Started", "completed")]
    return [(event_id, "added", "Scheduled", None), (event_id, "updated", "Started", None),
            (event_id, "removed", "Started", "completed")]


def wait_for_changes(proc: CollectorProcess, expected: list[Change], timeout: float = 15) -> None:
    """Wait for as many records as expected, then check them and that no stray record follows."""
    wait_until(lambda: len(proc.records()) >= len(expected), timeout=timeout, message=f"records {expected}")
    assert changes(proc) == expected, proc.log()
    assert len({r["id"] for r in proc.records()}) == len(expected)


def info_by_id(proc: CollectorProcess) -> dict[str, dict[str, str]]:
    return {labels["event_id"]: labels for labels in series(proc.metrics(), "azure_scheduled_event_info")}


def approve(sim: SimulatorHandle, event_id: str) -> None:
    """Approve as another process on the VM would; it shares the 5/s budget, so a 429 is retried."""
    for _ in range(5):
        response = requests.post(sim.url + SE, headers=H, json={"StartRequests": [{"EventId": event_id}]},
                                 timeout=5)
        if response.status_code != 429:
            break
        time.sleep(1)
    assert response.status_code == 200


def event_ids(name: str) -> list[str]:
    return [spec.event_id for spec in SCENARIOS[name].events]


def timestamp(record: dict[str, Any]) -> float:
    return datetime.fromisoformat(record["time"].replace("Z", "+00:00")).timestamp()


# --- the scenarios as documents (no processes) -----------------------------------------------------

@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_incarnation_served_is_a_valid_document_in_every_api_version(name: str) -> None:
    clock = FakeClock()
    sim = Simulator(SCENARIOS[name], clock=clock)
    incarnations = set()
    for t in boundaries(SCENARIOS[name]):
        clock.now = t
        for version in API_VERSIONS:
            body = json.dumps(sim.document(version)).encode()
            document = parse_document(body)
            assert document.warnings == (), (name, version, t, document.warnings)
            incarnations.add(document.incarnation)
    # the walk saw the scenario play: the empty start, and each change of the event list after it
    assert len(incarnations) >= (3 if SCENARIOS[name].events else 1)


def test_the_new_scenarios_are_built_in() -> None:
    assert set(NEW) <= set(SCENARIOS)
    for name in NEW:
        assert load_scenario(name) is SCENARIOS[name] and SCENARIOS[name].summary


@pytest.mark.parametrize("name", ["hardware-redeploy", "policy-auto-approved"])
def test_events_appear_already_started(name: str) -> None:
    first_seen: dict[str, dict[str, Any]] = {}
    for _, document in served(name):
        for event in document["Events"]:
            first_seen.setdefault(event["EventId"], event)
    assert list(first_seen) == event_ids(name)
    for event in first_seen.values():
        assert event["EventStatus"] == "Started" and event["NotBefore"] == ""
    expected_source = "Platform" if name == "hardware-redeploy" else "User"
    assert {e["EventSource"] for e in first_seen.values()} == {expected_source}


def test_reboot_is_withdrawn_in_the_incarnation_where_the_freeze_appears() -> None:
    reboot, freeze = event_ids("reboot-becomes-freeze")
    documents = [d for _, d in served("reboot-becomes-freeze")]
    shown = [[(e["EventId"], e["EventType"], e["EventStatus"]) for e in d["Events"]] for d in documents]
    assert shown == [[], [(reboot, "Reboot", "Scheduled")], [(freeze, "Freeze", "Scheduled")],
                     [(freeze, "Freeze", "Started")], []]
    (reboot_event,), (freeze_event,) = documents[1]["Events"], documents[2]["Events"]
    assert freeze_event["NotBefore"] == reboot_event["NotBefore"] and freeze_event["DurationInSeconds"] == 5


@pytest.mark.parametrize(("name", "notice"), [("terminate", 300), ("terminate-long-notice", 900),
                                              ("spot-short-notice", 6)])
def test_notice_from_appearance_to_not_before(name: str, notice: float) -> None:
    # the injected clock starts at 0 and runs at 1x, so wall time equals scenario time
    (appeared, document), *_ = [(t, d) for t, d in served(name) if d["Events"]]
    (event,) = document["Events"]
    assert appeared == SCENARIOS[name].events[0].at
    assert parse_not_before(event["NotBefore"]).timestamp() - appeared == notice
    if name == "spot-short-notice":
        assert notice < 10 and "DurationInSeconds" not in event


def test_scale_set_document_holds_events_for_several_hosts() -> None:
    scenario = SCENARIOS["scale-set-hosts"]
    (_, first), *_ = [(t, d) for t, d in served("scale-set-hosts") if d["Events"]]
    resources = [tuple(e["Resources"]) for e in first["Events"]]
    assert len(resources) == 4 and len(set(resources)) == 4
    assert max(len(r) for r in resources) >= 2
    assert [scenario.vm_name in r for r in resources] == [True, False, False, True]
    # hosts are maintained one after another: never two events Started at once
    for _, document in served("scale-set-hosts"):
        assert sum(e["EventStatus"] == "Started" for e in document["Events"]) <= 1


# --- the collector against each scenario ------------------------------------------------------------

@pytest.mark.slow
def test_hardware_redeploy_is_added_started_then_completed(simulator: Callable[..., SimulatorHandle],
                                                           collector: Callable[..., CollectorProcess]) -> None:
    # Started lasts 600 scenario s = 6 real s at 100x
    sim = simulator("hardware-redeploy", speed=100)
    proc = collector(sim.url)
    (event_id,) = event_ids("hardware-redeploy")
    first = wait_until(proc.records, timeout=10, message="first record")[0]
    assert first["data"]["not_before"] is None
    info = info_by_id(proc)[event_id]
    assert (info["event_type"], info["event_status"], info["event_source"], info["affects_this_vm"]) == \
        ("Redeploy", "Started", "Platform", "true")
    assert series(proc.metrics(), "azure_scheduled_event_not_before_timestamp_seconds") == []
    wait_for_changes(proc, lifecycle(event_id, "Started"))
    assert info_by_id(proc) == {}
    assert sample(proc.metrics(), "azure_scheduled_events_ended_total", event_type="Redeploy",
                  outcome="completed") == 1
    assert proc.stop() == 0


@pytest.mark.slow
def test_policy_auto_approved_events_are_added_started(simulator: Callable[..., SimulatorHandle],
                                                       collector: Callable[..., CollectorProcess]) -> None:
    # Reboot Started 0.02-3.02 s, Redeploy Started 3.6-6.6 s at 100x
    sim = simulator("policy-auto-approved", speed=100)
    proc = collector(sim.url)
    reboot, redeploy = event_ids("policy-auto-approved")
    wait_until(proc.records, timeout=10, message="first record")
    info = info_by_id(proc)[reboot]
    assert (info["event_type"], info["event_status"], info["event_source"]) == ("Reboot", "Started", "User")
    wait_until(lambda: redeploy in info_by_id(proc), timeout=10, message="the redeploy in the metrics")
    info = info_by_id(proc)[redeploy]
    assert (info["event_type"], info["event_status"], info["event_source"]) == ("Redeploy", "Started", "User")
    wait_for_changes(proc, lifecycle(reboot, "Started") + lifecycle(redeploy, "Started"))
    assert proc.stop() == 0


@pytest.mark.slow
def test_reboot_becomes_freeze(simulator: Callable[..., SimulatorHandle],
                               collector: Callable[..., CollectorProcess]) -> None:
    # at 10x: the Reboot is Scheduled 0.2-4.2 s, then the Freeze waits 86 s unless approved
    sim = simulator("reboot-becomes-freeze", speed=10)
    proc = collector(sim.url)
    reboot, freeze = event_ids("reboot-becomes-freeze")
    wait_until(lambda: freeze in info_by_id(proc), timeout=10, message="the freeze in the metrics")
    info = info_by_id(proc)
    assert list(info) == [freeze] and info[freeze]["event_type"] == "Freeze"
    records = proc.records()
    assert changes(proc) == [(reboot, "added", "Scheduled", None), (reboot, "removed", "Scheduled", "cancelled"),
                             (freeze, "added", "Scheduled", None)]
    assert records[1]["data"]["incarnation"] == records[2]["data"]["incarnation"]
    assert records[2]["data"]["not_before"] == records[0]["data"]["not_before"]
    approve(sim, freeze)   # as a workload that is ready would; Started then lasts 15 s / 10
    wait_for_changes(proc, changes(proc)[:2] + lifecycle(freeze))
    assert sample(proc.metrics(), "azure_scheduled_events_ended_total", event_type="Reboot",
                  outcome="cancelled") == 1
    assert proc.stop() == 0


@pytest.mark.slow
@pytest.mark.parametrize(("name", "notice"), [("terminate", 300), ("terminate-long-notice", 900)])
def test_terminate_notice_then_approved_deletion(name: str, notice: float, simulator: Callable[..., SimulatorHandle],
                                                 collector: Callable[..., CollectorProcess]) -> None:
    speed = 100
    sim = simulator(name, speed=speed)
    proc = collector(sim.url)
    (event_id,) = event_ids(name)
    first = wait_until(proc.records, timeout=10, message="first record")[0]
    appeared = sim.sim.wall(SCENARIOS[name].events[0].at).timestamp()
    not_before = datetime.fromisoformat(first["data"]["not_before"].replace("Z", "+00:00")).timestamp()
    assert abs(not_before - appeared - notice / speed) < 1   # NotBefore has whole seconds
    info = info_by_id(proc)[event_id]
    assert (info["event_type"], info["event_status"], info["event_source"], info["affects_this_vm"]) == \
        ("Terminate", "Scheduled", "User", "true")
    (vm,) = series(proc.metrics(), "azure_scheduled_events_vm_info")
    assert vm["vm_scale_set"] == "vmss" and vm["vm_name"] == "vmss_3"
    approve(sim, event_id)   # a drained instance lets the deletion go ahead; Started lasts 1.2 s
    wait_for_changes(proc, lifecycle(event_id))
    assert proc.stop() == 0


@pytest.mark.slow
def test_spot_eviction_with_seconds_of_notice_is_reported_within_a_poll(
        simulator: Callable[..., SimulatorHandle], collector: Callable[..., CollectorProcess]) -> None:
    # at 3x: appears 3.3 s in, Started 2 s later, gone 5 s after that; the collector polls once a second
    sim = simulator("spot-short-notice", speed=3)
    proc = collector(sim.url, poll_interval=1.0)
    spec = SCENARIOS["spot-short-notice"].events[0]
    assert sim.sim.now() < spec.at, "the collector started after the eviction appeared: nothing to measure"
    first = wait_until(proc.records, timeout=10, message="first record")[0]
    appeared = sim.sim.wall(spec.at).timestamp()
    assert 0 <= timestamp(first) - appeared <= 1.5
    info = info_by_id(proc)[spec.event_id]
    assert (info["event_type"], info["event_status"], info["affects_this_vm"]) == ("Preempt", "Scheduled", "true")
    assert series(proc.metrics(), "azure_scheduled_event_duration_seconds") == []
    wait_for_changes(proc, lifecycle(spec.event_id), timeout=12)
    assert proc.stop() == 0


@pytest.mark.slow
def test_scale_set_hosts_affects_this_vm_per_event(simulator: Callable[..., SimulatorHandle],
                                                   collector: Callable[..., CollectorProcess]) -> None:
    # at 250x: all four Scheduled until 3.6 s, then each Started for 1.2 s in turn, the last gone at 8.4 s
    sim = simulator("scale-set-hosts", speed=250)
    proc = collector(sim.url)
    host_a, host_b, host_c, user = event_ids("scale-set-hosts")
    wait_until(lambda: len(proc.records()) >= 4, timeout=10, message="four records")
    records = proc.records()[:4]
    assert [(r["subject"], r["data"]["change"]) for r in records] == \
        [(host_a, "added"), (host_b, "added"), (host_c, "added"), (user, "added")]
    assert len({r["data"]["incarnation"] for r in records}) == 1
    assert [r["data"]["affects_this_vm"] for r in records] == [True, False, False, True]
    assert records[0]["data"]["event"]["Resources"] == ["web_0", "web_1", "web_2"]
    info = info_by_id(proc)
    assert {event_id: labels["affects_this_vm"] for event_id, labels in info.items()} == \
        {host_a: "true", host_b: "false", host_c: "false", user: "true"}
    assert {event_id: labels["event_type"] for event_id, labels in info.items()} == \
        {host_a: "Freeze", host_b: "Reboot", host_c: "Redeploy", user: "Reboot"}
    # removal of one host's event and the start of the next arrive in one document: removals come first
    a, b, c, d = (lifecycle(e) for e in (host_a, host_b, host_c, user))
    wait_for_changes(proc, [a[0], b[0], c[0], d[0], a[1], a[2], b[1], b[2], c[1], c[2], d[1], d[2]])
    assert proc.stop() == 0


# --- usable by name ---------------------------------------------------------------------------------

def test_simulate_list_names_the_new_scenarios() -> None:
    result = subprocess.run([sys.executable, "-m", "forewarn", "simulate", "--list"], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0
    listed = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    for name in NEW:
        assert SCENARIOS[name].summary in listed[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", NEW)
def test_simulate_serves_the_scenario_by_name(name: str) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "forewarn", "simulate", name, "--speed", "50",
                             "--listen-address", f"127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def events() -> list[str]:
        try:
            response = requests.get(f"http://127.0.0.1:{port}{SE}", headers=H, timeout=1)
        except requests.RequestException:
            return []
        return [e["EventId"] for e in response.json()["Events"]] if response.status_code == 200 else []

    try:
        assert wait_until(events, timeout=15, message=f"{name} events")[0] in event_ids(name)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err


@pytest.mark.slow
@pytest.mark.parametrize("name", NEW)
def test_run_simulate_by_name_reports_the_scenario(name: str, tmp_path: Path) -> None:
    proc = CollectorProcess("http://127.0.0.1:9", tmp_path / "state", "--simulate", name, "--speed", "50")
    try:
        proc.start()
        first = wait_until(proc.records, timeout=10, message="first record")[0]
        assert first["subject"] == event_ids(name)[0]
        assert first["data"]["vm"]["name"] == SCENARIOS[name].vm_name
    finally:
        assert proc.stop() == 0
