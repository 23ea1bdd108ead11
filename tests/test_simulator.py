"""The simulator behaves like IMDS, over real HTTP."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import requests

from forewarn.simulator import SCENARIOS, ScenarioError, Simulator, load_scenario
from forewarn.simulator.timeline import Faults, parse_fault

from conftest import SimulatorHandle, wait_until

H = {"Metadata": "true"}
SE = "/metadata/scheduledevents?api-version=2020-07-01"


def get(sim: SimulatorHandle, version: str = "2020-07-01") -> requests.Response:
    return requests.get(f"{sim.url}/metadata/scheduledevents", params={"api-version": version}, headers=H, timeout=5)


def test_missing_metadata_header_is_400(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator()
    response = requests.get(sim.url + SE, timeout=5)
    assert response.status_code == 400 and "metadata header" in response.json()["error"]


def test_forwarded_for_header_is_rejected(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator()
    assert requests.get(sim.url + SE, headers={**H, "X-Forwarded-For": "1.2.3.4"}, timeout=5).status_code == 400


@pytest.mark.parametrize("version", ["", "latest", "2018-01-01", "2099-01-01"])
def test_unknown_api_version_is_400(simulator: Callable[..., SimulatorHandle], version: str) -> None:
    assert get(simulator(), version).status_code == 400


def test_other_methods_are_405(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator()
    assert requests.put(sim.url + SE, headers=H, timeout=5).status_code == 405
    assert requests.delete(sim.url + SE, headers=H, timeout=5).status_code == 405


def test_incarnation_rises_on_every_change_and_not_otherwise(simulator: Callable[..., SimulatorHandle]) -> None:
    # appears at 0.3 s, NotBefore (Started) at 1.3 s, gone at 2.8 s: every state lasts many polls
    sim = simulator({"events": [{"at": 0.3, "type": "Freeze", "notice": 1, "run_for": 1.5}]}, rate_limit=None)
    seen: list[tuple[int, tuple[str, ...]]] = []

    def observe() -> bool:
        doc = get(sim).json()
        state = (doc["DocumentIncarnation"], tuple(e["EventStatus"] for e in doc["Events"]))
        if not seen or seen[-1] != state:
            seen.append(state)
        return len(seen) >= 3 and seen[-1][1] == ()

    wait_until(observe, timeout=10, interval=0.1)
    incarnations = [i for i, _ in seen]
    assert incarnations == sorted(set(incarnations))
    assert [s for _, s in seen][-3:] == [("Scheduled",), ("Started",), ()]


def test_started_event_has_empty_not_before(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator("hardware-failure", speed=100, rate_limit=None)
    doc = wait_until(lambda: get(sim).json()["Events"] and get(sim).json(), timeout=5)
    (event,) = doc["Events"]
    assert event["EventStatus"] == "Started" and event["NotBefore"] == ""


def test_approval_starts_a_scheduled_event_early_and_it_later_completes(
        simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator("platform-reboot", speed=60, rate_limit=None)  # NotBefore 15 s away in real time
    event = wait_until(lambda: get(sim).json()["Events"], timeout=5)[0]
    assert event["EventStatus"] == "Scheduled"
    response = requests.post(sim.url + SE, headers=H, json={"StartRequests": [{"EventId": event["EventId"]}]},
                             timeout=5)
    assert response.status_code == 200
    wait_until(lambda: get(sim).json()["Events"][0]["EventStatus"] == "Started", timeout=3)
    assert sim.sim.approval_posts[0]["event_ids"] == [event["EventId"]]
    wait_until(lambda: get(sim).json()["Events"] == [], timeout=15, interval=0.5)


@pytest.mark.parametrize("body", ["not json", {}, {"StartRequests": {}}, {"StartRequests": [{"Id": "x"}]},
                                  {"StartRequests": [{"EventId": 5}]}])
def test_malformed_start_requests_are_400(simulator: Callable[..., SimulatorHandle], body: object) -> None:
    sim = simulator()
    data = body if isinstance(body, str) else json.dumps(body)
    response = requests.post(sim.url + SE, headers={**H, "Content-Type": "application/json"}, data=data, timeout=5)
    assert response.status_code == 400
    assert sim.sim.approval_posts == []


def test_several_events_at_once_and_other_vm_events(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator("tour", speed=50, rate_limit=None)
    events = wait_until(lambda: len(get(sim).json()["Events"]) >= 3 and get(sim).json()["Events"], timeout=10)
    assert len({e["EventId"] for e in events}) == len(events)
    assert any(e["Resources"] == ["vm-1"] for e in events)


def test_older_versions_omit_newer_fields_and_types(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator(rate_limit=None, scenario={"vm_name": "vm-0", "events": [
        {"at": 0, "type": "Terminate", "notice": 300}, {"at": 0, "type": "Preempt", "notice": 30, "duration": None},
        {"at": 0, "type": "Reboot", "notice": 900, "description": "d"}]})
    wait_until(lambda: len(get(sim).json()["Events"]) == 3, timeout=5, message="the three events")
    assert [e["EventType"] for e in get(sim, "2017-08-01").json()["Events"]] == ["Reboot"]
    assert [e["EventType"] for e in get(sim, "2017-11-01").json()["Events"]] == ["Preempt", "Reboot"]
    newest = get(sim, "2020-07-01").json()["Events"]
    assert "DurationInSeconds" not in newest[1] and newest[2]["DurationInSeconds"] == -1
    old = get(sim, "2019-01-01").json()["Events"][2]
    assert not {"Description", "EventSource", "DurationInSeconds"} & set(old)
    assert get(sim, "2017-03-01").json()["Events"][0]["Resources"] == ["_vm-0"]


def test_rate_limit_answers_429_beyond_five_per_second(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator()
    codes = [get(sim).status_code for _ in range(8)]
    assert codes[:5] == [200] * 5 and 429 in codes[5:]
    assert sim.sim.rate_violations >= 1


def test_compute_endpoint(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator("terminate")
    url = sim.url + "/metadata/instance/compute?api-version=2021-02-01"
    assert requests.get(url, timeout=5).status_code == 400
    compute = requests.get(url, headers=H, timeout=5).json()
    assert compute["name"] == "vmss_3" and compute["vmScaleSetName"] == "vmss"


def test_admin_injects_and_removes_events(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator()
    created = requests.post(sim.url + "/admin/events", json={"type": "Redeploy", "notice": 600, "id": "X-1"},
                            timeout=5)
    assert created.status_code == 201 and created.json()["EventId"] == "X-1"
    assert [e["EventId"] for e in get(sim).json()["Events"]] == ["X-1"]
    assert requests.delete(sim.url + "/admin/events/X-1", timeout=5).json()["removed"] is True
    assert get(sim).json()["Events"] == []
    bad = requests.post(sim.url + "/admin/events", json={"notice": 5}, timeout=5)
    assert bad.status_code == 400 and "type" in bad.json()["error"]


def test_admin_fault_queue(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator()
    assert requests.post(sim.url + "/admin/faults", json={"next": ["429", "500"]}, timeout=5).status_code == 200
    assert [get(sim).status_code for _ in range(3)] == [429, 500, 200]
    assert requests.post(sim.url + "/admin/faults", json={"next": ["boom"]}, timeout=5).status_code == 400


def test_transitions_are_recorded_with_scenario_time() -> None:
    now = [0.0]
    sim = Simulator(load_scenario("cancelled-maintenance"), clock=lambda: now[0])
    for t in (0, 1, 3, 50, 121, 123):
        now[0] = t
        sim.current()
    assert [(t.status, t.at) for t in sim.transitions] == [("Scheduled", 3.0), ("", 123.0)]


def test_speed_compresses_not_before_in_real_time() -> None:
    now = [1_000.0]
    sim = Simulator(load_scenario("platform-reboot"), speed=60, clock=lambda: now[0])
    now[0] += 1
    (event,) = sim.current()[1]
    # appears at scenario 2 s, NotBefore at scenario 902 s = 15.03 real seconds after the start (1000 s)
    assert event["NotBefore"] == "Thu, 01 Jan 1970 00:16:55 GMT"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_every_builtin_scenario_produces_its_events() -> None:
    for name, scenario in SCENARIOS.items():
        clock = FakeClock()
        sim = Simulator(scenario, clock=clock)
        for t in range(0, 3500, 5):
            clock.now = float(t)
            sim.current()
        assert len({t.event_id for t in sim.transitions}) == len(scenario.events), name


def test_scenario_file_yaml(tmp_path: Path) -> None:
    path = tmp_path / "drill.yaml"
    path.write_text("vm_name: web-0\nvms: [web-0, web-1]\nevents:\n  - {at: 1, type: Reboot, notice: 60}\n")
    scenario = load_scenario(str(path))
    assert scenario.name == "drill" and scenario.events[0].resources == ("web-0", "web-1")


@pytest.mark.parametrize(("text", "message"), [
    ("events: [{at: 1}]", "type is required"),
    ("events: [{type: Reboot, at: soon}]", "at must be a number"),
    ("events: [{type: Reboot, colour: red}]", "unknown field 'colour'"),
    ("events: [{type: Reboot, source: Martians}]", "source must be Platform or User"),
    ("events: {}", "events must be a list"),
    ("loop: 10\nevents: [{type: Reboot, notice: 900}]", "loop"),
    ("[1, 2", "drill.yaml"),
])
def test_bad_scenario_files_name_the_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "drill.yaml"
    path.write_text(text)
    with pytest.raises(ScenarioError, match=message):
        load_scenario(str(path))


def test_unknown_scenario_lists_the_builtin_ones() -> None:
    with pytest.raises(ScenarioError, match="live-migration"):
        load_scenario("nope")


def test_fault_specs() -> None:
    faults = Faults()
    for spec in ("500:0.5", "latency:0.2", "slow-first:3", "reset:0.1"):
        parse_fault(spec, faults)
    assert faults.rates == {"500": 0.5, "reset": 0.1} and faults.latency == 0.2 and faults.slow_first == 3
    for bad in ("500", "boom:0.1", "500:2"):
        with pytest.raises(ValueError, match="--fault"):
            parse_fault(bad, faults)
