"""A real Prometheus scrapes `forewarn run --simulate` and evaluates the shipped alert rules."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from conftest import SimulatorHandle, free_port, require_tool, wait_until

ROOT = Path(__file__).parent.parent
RULES = ROOT / "deploy" / "prometheus" / "forewarn-alerts.yaml"
pytestmark = pytest.mark.slow


class Stack:
    """forewarn against its simulator, and Prometheus scraping it every second."""

    def __init__(self, tmp: Path, scenario: str = "", speed: float = 1.0, endpoint: str = "") -> None:
        """forewarn's own simulator playing `scenario`, or the IMDS at `endpoint` (a simulator the test holds)."""
        self.forewarn_port, self.prom_port = free_port(), free_port()
        imds = ["--imds-endpoint", endpoint] if endpoint else ["--simulate", scenario, "--speed", str(speed)]
        self.forewarn = subprocess.Popen(
            [sys.executable, "-m", "forewarn", "run", *imds,
             "--poll-interval", "0.5", "--listen-address", f"127.0.0.1:{self.forewarn_port}",
             "--state-dir", str(tmp / "state")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "forewarn",
                                "static_configs": [{"targets": [f"127.0.0.1:{self.forewarn_port}"]}]}],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.prometheus = subprocess.Popen(
            [require_tool("prometheus", "Debian package prometheus"), f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.prom_port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.api = f"http://127.0.0.1:{self.prom_port}/api/v1"
        wait_until(self._ready, timeout=60, interval=0.5, message="prometheus ready")

    def _ready(self) -> bool:
        try:
            return requests.get(f"http://127.0.0.1:{self.prom_port}/-/ready", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        response = requests.get(f"{self.api}/query", params={"query": expr}, timeout=5)
        body = response.json()
        assert body["status"] == "success", (expr, body)
        return list(body["data"]["result"])

    def firing(self) -> set[str]:
        alerts = requests.get(f"{self.api}/alerts", timeout=5).json()["data"]["alerts"]
        return {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}

    def stop(self) -> None:
        for proc in (self.prometheus, self.forewarn):
            proc.terminate()
            proc.wait(20)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    running = Stack(tmp_path, "spot-preempt", speed=1)
    yield running
    running.stop()


def test_prometheus_scrapes_forewarn_and_the_imminent_and_started_alerts_fire(stack: Stack) -> None:
    wait_until(lambda: stack.query('up{job="forewarn"} == 1'), timeout=30, message="scraped")
    info = wait_until(lambda: stack.query("azure_scheduled_event_info"), timeout=30, message="event scraped")
    assert info[0]["metric"]["event_type"] == "Preempt"
    # The Spot eviction gives 30 s of notice: imminent at once, then Started.
    wait_until(lambda: "AzureVMMaintenanceImminent" in stack.firing(), timeout=30, message="imminent alert")
    wait_until(lambda: "AzureScheduledEventStarted" in stack.firing(), timeout=60, message="started alert")
    assert "ForewarnIMDSFailing" not in stack.firing() and "ForewarnDown" not in stack.firing()


def dashboard_queries() -> list[tuple[str, str, int, str]]:
    """(board, panel title, target index, expression) for every query of the shipped dashboards."""
    out = []
    for path in sorted((ROOT / "dashboards").glob("*.json")):
        if path.name == "fleet-central.json":
            continue   # forewarn fleet's own board: tests/test_fleet_dashboard.py
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for index, target in enumerate(panel.get("targets", [])):
                out.append((path.name, panel["title"], index, target["expr"]))
    return out


DASHBOARD_SCENARIO = {
    "vm_name": "vm-0", "vms": ["vm-0", "vm-1"],
    "events": [
        {"at": 0, "type": "Reboot", "notice": 3600, "resources": ["vm-0"], "description": "Host maintenance."},
        {"at": 0, "type": "Reboot", "notice": None, "run_for": 3600, "resources": ["vm-0", "vm-1"],
         "description": "Host failure."},
        {"at": 0, "type": "Freeze", "notice": 900, "resources": ["vm-1"], "description": "Another VM's freeze."},
    ],
}

#: A query's result as {labels (without job, instance and __name__): value}.
Result = dict[frozenset[tuple[str, str]], float]
#: A series expected to be within this many seconds of the value computed from the served document
#: (values that count down with time() were computed at another moment than the query ran).
CLOCK_SLACK = 5.0


class Served:
    """What the simulator served, and the dashboard results it implies."""

    def __init__(self, handle: SimulatorHandle) -> None:
        self.incarnation, events = handle.sim.current()
        self.events = {event["EventId"]: event for event in events}
        compute = handle.sim.compute()
        self.vm = {"vm_name": compute["name"], "vm_id": compute["vmId"], "vm_scale_set": compute["vmScaleSetName"],
                   "resource_group": compute["resourceGroupName"], "subscription_id": compute["subscriptionId"],
                   "location": compute["location"], "zone": compute["zone"]}

    def ours(self, event: dict[str, Any]) -> bool:
        return self.vm["vm_name"] in event["Resources"]

    def to_not_before(self) -> dict[str, float]:
        now = time.time()
        return {event_id: parsedate_to_datetime(event["NotBefore"]).timestamp() - now
                for event_id, event in self.events.items() if event["NotBefore"]}

    def expected(self, title: str, index: int) -> Result | None:
        """The result a dashboard target must show for this document; None: checked by `check_other`."""
        events = self.events.values()
        scheduled = [e for e in events if e["EventStatus"] == "Scheduled"]
        impactful = {"Reboot", "Redeploy", "Terminate", "Preempt"}
        vm = self.vm["vm_name"]

        def one(value: float, **labels: str) -> Result:
            return {frozenset(labels.items()): value}

        def each(key: Any, values: Any) -> Result:
            return {frozenset(key(e).items()): v for e, v in values}

        table = [  # the same panels appear on both boards under different titles
            each(lambda e: {"event_id": e["EventId"], "event_type": e["EventType"], "event_status": e["EventStatus"],
                            "event_source": e["EventSource"], "description": e["Description"]},
                 [(e, 1) for e in events]),
            {frozenset({("event_id", event_id)}): seconds for event_id, seconds in self.to_not_before().items()},
            each(lambda e: {"event_id": e["EventId"]}, [(e, 1) for e in events if self.ours(e)]),
        ]
        status = each(lambda e: {"event_id": e["EventId"], "event_type": e["EventType"],
                                 "event_status": e["EventStatus"]}, [(e, 1) for e in events])
        by_type: Counter[tuple[str, str]] = Counter((e["EventType"], e["EventSource"]) for e in scheduled)
        expected: dict[tuple[str, int], Result] = {
            ("VMs with impactful events scheduled", 0):
                one(float(any(self.ours(e) and e["EventType"] in impactful for e in scheduled))),
            ("Events under way", 0): one(sum(e["EventStatus"] == "Started" for e in events)),
            ("Soonest NotBefore", 0): one(min(self.to_not_before().values())),
            ("Collectors reporting", 0): one(1),
            ("Upcoming events by type and source", 0):
                {frozenset({("event_type", t), ("event_source", s)}): n for (t, s), n in by_type.items()},
            ("Event timeline", 0): status,
            ("Event status", 0): status,
            **{("Scheduled events", i): result for i, result in enumerate(table)},
            **{("Events in this VM's document", i): result for i, result in enumerate(table)},
            ("IMDS up (share of collectors)", 0): one(1),
            ("IMDS errors by code", 0): one(0),
            ("Outbox backlog by sink", 0): one(0, sink="stdout"),
            ("Records delivered and failed", 0): one(0, sink="stdout"),  # delivered at the start, none since
            ("Records delivered and failed", 1): one(0, sink="stdout"),
            ("This VM", 0): one(1, **{k: v for k, v in self.vm.items() if v}),
            # targets without aggregation keep the vm_name that group_left brings in
            ("Time to NotBefore", 0): {frozenset({("event_id", event_id), ("event_type", self.events[event_id]
                                                  ["EventType"]), ("vm_name", vm)}): seconds
                                       for event_id, seconds in self.to_not_before().items()},
            ("IMDS up and document incarnation", 0): one(1, vm_name=vm),
            ("IMDS up and document incarnation", 1): one(self.incarnation, vm_name=vm),
            ("Outbox and delivery", 0): one(0, sink="stdout", vm_name=vm),
            ("Outbox and delivery", 1): one(0, sink="stdout", vm_name=vm),
            # no node actions configured: the node families are not exported
            ("Kubernetes node actions and drains in progress", 1): {},
            ("Drains blocked by a PodDisruptionBudget", 0): {},
        }
        return expected.get((title, index))


def as_result(series: list[dict[str, Any]]) -> Result:
    hidden = {"__name__", "job", "instance"}
    return {frozenset((k, v) for k, v in item["metric"].items() if k not in hidden): float(item["value"][1])
            for item in series}


def matches(got: Result, want: Result) -> bool:
    return got.keys() == want.keys() and all(abs(got[key] - want[key]) <= CLOCK_SLACK for key in want)


def check_other(title: str, index: int, got: Result) -> bool:
    """Targets whose values are not in the document: measured latencies and counters that stay at zero."""
    if title == "IMDS request latency":  # p99 and p50 of loopback requests: one series, a few ms
        return len(got) == 1 and all(0 < value < 1 for value in got.values())
    # no policy and no node actions: their families are not exported, so the panels have no series
    if title in ("Approvals", "Hooks and approvals", "Drain steps and pods removed") or (title, index) == (
            "Kubernetes node actions and drains in progress", 0):
        return not got
    raise AssertionError(f"no expectation for dashboard panel {title!r} target {index}: add one")


def test_every_dashboard_query_shows_what_the_simulator_served(
        simulator: Callable[..., SimulatorHandle], tmp_path: Path) -> None:
    """Template variables at their 'All' values; $__rate_interval as Grafana would set it for 1 s scrapes."""
    handle = simulator(DASHBOARD_SCENARIO)
    running = Stack(tmp_path, endpoint=handle.url)
    try:
        served = Served(handle)
        assert {e["EventStatus"] for e in served.events.values()} == {"Scheduled", "Started"}
        assert not all(served.ours(e) for e in served.events.values()), "one event is another VM's"
        wait_until(lambda: len(running.query("azure_scheduled_event_info")) == len(served.events), timeout=30)
        for board, title, index, expr in dashboard_queries():
            concrete = (expr.replace("$vm_scale_set", ".*").replace("$location", ".*").replace("$vm", ".*")
                        .replace("$__rate_interval", "5s"))
            last: list[Result] = []

            def shown() -> bool:
                last[:] = [as_result(running.query(concrete))]  # noqa: B023 (called at once)
                want = served.expected(title, index)  # noqa: B023
                return matches(last[0], want) if want is not None else check_other(title, index, last[0])  # noqa: B023

            # rates need two scrapes inside their range, and settle once the start's records are delivered
            try:
                wait_until(shown, timeout=20)
            except AssertionError:
                pytest.fail(f"{board} / {title} [{index}]: {concrete}\n  got  {last}\n"
                            f"  want {served.expected(title, index)}")
    finally:
        running.stop()


def test_every_alert_expression_evaluates_against_real_data(stack: Stack) -> None:
    wait_until(lambda: stack.query("azure_scheduled_event_info"), timeout=30)
    groups = requests.get(f"{stack.api}/rules", timeout=5).json()["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) == len([r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]])
    for rule in rules:
        assert rule["health"] in ("ok", "unknown"), rule
        stack.query(rule["query"])  # parses and evaluates without error

    def all_evaluated() -> bool:
        groups = requests.get(f"{stack.api}/rules", timeout=5).json()["data"]["groups"]
        return all(rule["health"] == "ok" for group in groups for rule in group["rules"])

    wait_until(all_evaluated, timeout=15, message="every rule evaluated with health ok")
