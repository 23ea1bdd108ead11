"""`forewarn fleet --simulate`: fleet mode against its built-in simulated fleet, as a real process.

The process runs with the Azure SDK and lightkube made unimportable (a sitecustomize on PYTHONPATH), so these
runs also show that the simulator needs only the core install. The stand-in's strictness (token, api-versions,
the acknowledge forms) is tested in-process against its HTTP routes, and docs/fleet.md's sample Event Grid
message and Resource Graph row are compared with what the simulator sends.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from forewarn.cli import main
from forewarn.fleet.arm import arm_base
from forewarn.fleet.feed import parse_event_grid, parse_resource_graph_row
from forewarn.simulator.fleet import FLEET_SCENARIOS, FleetSimulation, sample_messages

ROOT = Path(__file__).resolve().parent.parent
TOUR = FLEET_SCENARIOS["tour"]
REBOOT, REDEPLOY, PREEMPT, FREEZE = TOUR.events
#: Made unimportable in the process: the simulated fleet must run on the core install.
BLOCKER = """\
import sys

class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("azure", "lightkube"):
            raise ImportError(f"{name} is blocked: the fleet simulator must run on the core install")
        return None

sys.meta_path.insert(0, _Block())
"""


def wait_until(check: Callable[[], Any], timeout: float, message: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {message}")


class SimulatedFleet:
    """`forewarn fleet --simulate tour` as a process, with records in a file and /metrics on a free port."""

    def __init__(self, tmp_path: Path, *extra: str) -> None:
        (tmp_path / "blocker").mkdir()
        (tmp_path / "blocker" / "sitecustomize.py").write_text(BLOCKER)
        self.records_file = tmp_path / "records.jsonl"
        self.log = tmp_path / "fleet.log"
        argv = [str(Path(sys.executable).parent / "forewarn"), "fleet", "--simulate", "tour",
                "--listen-address", "127.0.0.1:0", "--sink", f"file:{self.records_file}",
                "--reconcile-interval", "1", *extra]
        env = {key: value for key, value in os.environ.items() if not key.startswith("FOREWARN_")}
        env["PYTHONPATH"] = str(tmp_path / "blocker")
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log)
        self.metrics_url = wait_until(lambda: self._found(r"metrics on (http://\S+/metrics)"), 20, "/metrics")
        self.stand_in = wait_until(lambda: self._found(r"Resource Graph and ARM on (http://\S+) "), 5, "the stand-in")
        self.state_dir = Path(wait_until(lambda: self._found(r'"state_dir": "([^"]+)"'), 5, "the state dir"))

    def _found(self, pattern: str) -> str | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"forewarn fleet exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
        match = re.search(pattern, self.log.read_text())
        return match.group(1) if match else None

    def records(self) -> list[dict[str, Any]]:
        if not self.records_file.exists():
            return []
        return [json.loads(line) for line in self.records_file.read_text().splitlines() if line.strip()]

    def until_the_tour_ends(self) -> tuple[list[dict[str, Any]], str, dict[str, Any]]:
        """Once every event of the tour has ended: the records, /metrics and the stand-in's state; then stop."""
        try:
            records = wait_until(lambda: all_ended(self), 20, "every event of the tour to end")
            text = requests.get(self.metrics_url, timeout=5).text
            state = requests.get(f"{self.stand_in}/admin/state", timeout=5).json()
        finally:
            assert self.stop() == 0, self.log.read_text()[-3000:]
        return records, text, state

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(15)


def sequences(records: list[dict[str, Any]]) -> dict[tuple[str, str], list[str]]:
    """(VM, EventId) -> the changes recorded for it, in order."""
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    for record in records:
        found[(record["data"]["vm"]["name"], record["subject"])].append(record["data"]["change"])
    return dict(found)


def all_ended(fleet: SimulatedFleet) -> list[dict[str, Any]] | None:
    """The records once every VM of every event of the tour has its end recorded."""
    records = fleet.records()
    ended = {(r["data"]["vm"]["name"], r["subject"]) for r in records if r["data"]["change"] == "removed"}
    wanted = {(vm, spec.event_id) for spec in TOUR.events for vm in spec.resources}
    return records if wanted <= ended else None


def metric(text: str, name: str, **labels: str) -> float:
    shown = ",".join(f'{key}="{value}"' for key, value in labels.items())
    match = re.search(rf"^{re.escape(name)}{re.escape('{' + shown + '}') if labels else ''} (\S+)$", text, re.M)
    assert match is not None, f"{name}{{{shown}}} not in /metrics"
    return float(match.group(1))


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    """The policy docs/fleet.md gives to try with the simulator."""
    path = tmp_path / "policy.yaml"
    path.write_text(_doc_block("A policy to try with it", "yaml"))
    return path


@pytest.mark.slow
def test_the_tour_with_a_policy_approves_the_scale_set_reboot_through_the_stand_in(tmp_path: Path,
                                                                                   policy: Path) -> None:
    fleet = SimulatedFleet(tmp_path, "--speed", "300", "--policy", str(policy))
    records, text, state = fleet.until_the_tour_ends()

    got = sequences(records)
    # The scale-set Reboot: approved by the rule, then started and completed, for each of its two VMs.
    for vm in REBOOT.resources:
        assert got[(vm, REBOOT.event_id)] == ["added", "approved", "updated", "removed"], got
    # The Redeploy is held, then Azure cancels it; the eviction (each status pushed twice) and the freeze run
    # their course, one record per change.
    assert got[("db-0", REDEPLOY.event_id)] == ["added", "removed"], got
    assert got[("spot_3", PREEMPT.event_id)] == ["added", "updated", "removed"], got
    assert got[("build-0", FREEZE.event_id)] == ["added", "updated", "removed"], got
    assert len(got) == 5, got
    by_change = {(r["data"]["vm"]["name"], r["subject"], r["data"]["change"]): r for r in records}
    approved = by_change[("web_0", REBOOT.event_id, "approved")]
    assert approved["data"]["policy_rule"] == "web-reboots"
    assert approved["data"]["vm"]["vm_scale_set"] == "web"
    cancelled = by_change[("db-0", REDEPLOY.event_id, "removed")]["data"]
    assert (cancelled["outcome"], cancelled["event"]["EventStatus"]) == ("cancelled", "Canceled")
    evicted = by_change[("spot_3", PREEMPT.event_id, "removed")]["data"]
    assert (evicted["outcome"], evicted["event"]["EventType"]) == ("completed", "Preempt")
    assert evicted["vm"]["subscription_id"] != approved["data"]["vm"]["subscription_id"]
    # The stand-in refused nothing fleet mode sent; its acknowledgement started the event well before NotBefore.
    assert state["refusals"] == [] and state["queries"] >= 2, state
    assert [(a["target"], a["event_ids"]) for a in state["acknowledgements"]] == \
        [(REBOOT.target.arm_id, [REBOOT.event_id])]
    reboot = next(e for e in state["events"] if e["EventId"] == REBOOT.event_id)
    started = next(m["at"] for m in reboot["milestones"] if m["status"] == "Started")
    assert started < REBOOT.at + (REBOOT.notice or 0) - 600
    # /metrics: one approval, every status delivered once by push after the handshake, both sources up.
    assert metric(text, "azure_scheduled_events_approvals_total", event_type="Reboot", result="approved") == 1
    assert metric(text, "azure_scheduled_events_approvals_total", event_type="Redeploy", result="approved") == 0
    # 11 statuses, the eviction's 3 delivered twice (Event Grid's repeats): each repeat changes nothing
    assert metric(text, "azure_scheduled_events_eventgrid_push_requests_total", result="accepted") == 14
    assert metric(text, "azure_scheduled_events_duplicates_total") >= 3
    assert metric(text, "azure_scheduled_events_eventgrid_push_requests_total", result="validated") == 1
    assert metric(text, "azure_scheduled_events_source_up", source="resourcegraph") == 1
    assert metric(text, "azure_scheduled_events_ended_total", event_type="Redeploy", outcome="cancelled") == 1
    assert metric(text, "azure_scheduled_events_ended_total", event_type="Preempt", outcome="completed") == 1
    assert not fleet.state_dir.exists(), "the temporary state dir is removed at stop"


@pytest.mark.slow
def test_the_tour_without_a_policy_acknowledges_nothing_and_the_reboot_starts_at_not_before(tmp_path: Path) -> None:
    fleet = SimulatedFleet(tmp_path, "--speed", "400", "--state-dir", str(tmp_path / "state"))
    records, text, state = fleet.until_the_tour_ends()
    got = sequences(records)
    for vm in REBOOT.resources:
        assert got[(vm, REBOOT.event_id)] == ["added", "updated", "removed"], got
    assert got[("db-0", REDEPLOY.event_id)] == ["added", "removed"], got
    assert state["acknowledgements"] == []
    reboot = next(e for e in state["events"] if e["EventId"] == REBOOT.event_id)
    assert [(m["at"], m["status"]) for m in reboot["milestones"]][1] == (REBOOT.at + (REBOOT.notice or 0), "Started")
    assert "azure_scheduled_events_approvals_total" not in text, "no approval families without a policy"
    assert fleet.state_dir == tmp_path / "state" and (tmp_path / "state").is_dir(), "a given state dir is kept"


@pytest.mark.parametrize(("argv", "message"), [
    (["--subscription", "0b6a1c2d-3e4f-4a5b-8c7d-9e0f1a2b3c4d"], "--subscription cannot go with it"),
    (["--arm-endpoint", "https://management.azure.com", "--lease-name", "x"],
     "--arm-endpoint, --lease-name cannot go with it"),
])
def test_options_that_point_at_azure_are_refused_with_simulate(argv: list[str], message: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "--simulate", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_variable_that_points_at_azure_is_named_as_given(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FOREWARN_QUEUE_URL", "https://account.queue.core.windows.net/events")
    assert main(["fleet", "--simulate"]) == 2
    assert "FOREWARN_QUEUE_URL cannot go with it" in capsys.readouterr().err


def test_a_policy_with_node_actions_is_refused_with_simulate(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "nodes.yaml"
    policy.write_text("version: 1\nrules:\n  - name: cordon\n    node: [cordon]\n    action: approve\n")
    assert main(["fleet", "--simulate", "--policy", str(policy), "--listen-address", "127.0.0.1:0"]) == 2
    assert "node actions need a Kubernetes cluster, which --simulate does not play" in capsys.readouterr().err


def test_an_unknown_scenario_names_the_built_in_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "--simulate", "nope", "--listen-address", "127.0.0.1:0"]) == 2
    assert "no such fleet scenario; built-in: tour, spot-eviction" in capsys.readouterr().err


def test_list_shows_the_scenarios(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "--list"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()] == list(FLEET_SCENARIOS)


@pytest.fixture
def simulation() -> Iterator[FleetSimulation]:
    running = FleetSimulation(TOUR, speed=1.0)
    yield running
    running.stop()


def bearer(simulation: FleetSimulation) -> dict[str, str]:
    return {"Authorization": f"Bearer {simulation.credential.get_token(simulation.credential.scope).token}"}


def test_the_stand_in_lists_open_events_of_the_subscriptions_asked_for(simulation: FleetSimulation) -> None:
    simulation.timeline.started_wall -= 90  # 90 s in: Resource Graph lists the tour as it was at 30 s
    query = {"subscriptions": [REBOOT.target.subscription], "query": "maintenanceresources\n| where tostring("
             'properties.EventStatus) in~ ("Scheduled", "Started")', "options": {"$top": 1}}
    url = f"{simulation.url}/providers/Microsoft.ResourceGraph/resources?api-version=2024-04-01"
    first = requests.post(url, json=query, headers=bearer(simulation), timeout=5).json()
    assert (first["totalRecords"], first["count"], first["resultTruncated"]) == (2, 1, "true")
    second = requests.post(url, json={**query, "options": {"$top": 1, "$skipToken": first["$skipToken"]}},
                           headers=bearer(simulation), timeout=5).json()
    events = [parse_resource_graph_row(row) for row in first["data"] + second["data"]]
    assert sorted(e.event_id for e in events) == sorted([REBOOT.event_id, REDEPLOY.event_id])
    assert "$skipToken" not in second


QUERY = {"subscriptions": [REBOOT.target.subscription], "query": "maintenanceresources"}


@pytest.mark.parametrize(("path", "body", "headers", "status"), [
    ("/providers/Microsoft.ResourceGraph/resources?api-version=2024-04-01", QUERY, {"Authorization": "Bearer x"}, 401),
    ("/providers/Microsoft.ResourceGraph/resources?api-version=2099-01-01", QUERY, None, 400),
    ("/providers/Microsoft.ResourceGraph/resources?api-version=2024-04-01", {**QUERY, "query": "resources"}, None, 400),
    (f"{REBOOT.target.arm_id}/providers/Microsoft.Maintenance/scheduledevents/{REDEPLOY.event_id}/acknowledge"
     "?api-version=2025-10-01-preview", None, None, 404),   # an event of another target
    (f"{REBOOT.target.arm_id}/providers/Microsoft.Maintenance/scheduledevents?api-version=2023-10-01-preview",
     {"value": [REBOOT.event_id]}, None, 400),              # the list form on a version without it
])
def test_the_stand_in_refuses_what_arm_would(simulation: FleetSimulation, path: str, body: Any,
                                             headers: dict[str, str] | None, status: int) -> None:
    simulation.timeline.started_wall -= 30
    answer = requests.post(f"{simulation.url}{path}", json=body, headers=headers or bearer(simulation), timeout=5)
    assert answer.status_code == status, answer.text
    assert "error" in answer.json() and simulation.timeline.acknowledgements == []
    assert len(simulation.stand_in.state()["refusals"]) == 1


def test_the_stand_in_starts_an_acknowledged_event_soon_after(simulation: FleetSimulation) -> None:
    simulation.timeline.started_wall -= 30
    path = f"{REBOOT.target.arm_id}/providers/Microsoft.Maintenance/scheduledevents?api-version=2025-10-01-preview"
    answer = requests.post(f"{simulation.url}{path}", json={"value": [REBOOT.event_id]}, headers=bearer(simulation),
                           timeout=5)
    assert answer.json() == {"value": "Successfully Approved"}
    started = simulation.timeline.milestones(REBOOT)[1]
    assert started.status == "Started" and 30 < started.at < 35


@pytest.mark.parametrize(("endpoint", "loopback_http", "expected"), [
    ("http://127.0.0.1:8080", True, ("http://127.0.0.1:8080", "127.0.0.1", 8080)),
    ("http://[::1]:8080", True, ("http://[::1]:8080", "::1", 8080)),
    ("https://management.azure.com", True, ("https://management.azure.com", "management.azure.com", 443)),
    ("http://127.0.0.1:8080", False, None),        # only the simulator asks for plain HTTP
    ("http://localhost:8080", True, None),         # a name could resolve anywhere
    ("http://10.1.2.3:8080", True, None),
    ("http://127.0.0.1:8080/path", True, None),
])
def test_plain_http_to_arm_only_for_a_loopback_address_and_only_when_asked(
        endpoint: str, loopback_http: bool, expected: tuple[str, str, int] | None) -> None:
    if expected is None:
        with pytest.raises(ValueError, match="must be an https base URL"):
            arm_base(endpoint, loopback_http)
    else:
        assert arm_base(endpoint, loopback_http) == expected


def _doc_block(heading: str, language: str) -> str:
    """The first fenced block of `language` after `heading` in docs/fleet.md."""
    after = (ROOT / "docs" / "fleet.md").read_text().split(heading, 1)[1]
    return after.split(f"```{language}\n", 1)[1].split("```", 1)[0]


def _doc_sample(heading: str) -> Any:
    return json.loads(_doc_block(heading, "json"))


def test_the_samples_in_docs_fleet_md_are_what_the_simulator_sends() -> None:
    message, row = sample_messages()
    assert _doc_sample("A sample Event Grid delivery") == [message]
    assert _doc_sample("A sample Resource Graph row") == row
    # and both read as the same event through fleet mode's own parsers
    pushed = parse_event_grid([message]).events[0]
    listed = parse_resource_graph_row(row)
    assert (pushed.resource_id, pushed.event) == (listed.resource_id, listed.event)
