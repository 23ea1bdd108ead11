"""A real Prometheus scrapes `forewarn run --simulate` and evaluates the shipped alert rules."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from conftest import free_port, require_tool, wait_until

ROOT = Path(__file__).parent.parent
RULES = ROOT / "deploy" / "prometheus" / "forewarn-alerts.yaml"
pytestmark = pytest.mark.slow


class Stack:
    """forewarn against its simulator, and Prometheus scraping it every second."""

    def __init__(self, tmp: Path, scenario: str, speed: float) -> None:
        self.forewarn_port, self.prom_port = free_port(), free_port()
        self.forewarn = subprocess.Popen(
            [sys.executable, "-m", "forewarn", "run", "--simulate", scenario, "--speed", str(speed),
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


def dashboard_queries() -> list[tuple[str, str, str]]:
    import json

    out = []
    for path in sorted((ROOT / "dashboards").glob("*.json")):
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                out.append((path.name, panel["title"], target["expr"]))
    return out


DASHBOARD_SCENARIO = {
    "vm_name": "vm-0", "vms": ["vm-0", "vm-1"],
    "events": [
        {"at": 0, "type": "Reboot", "notice": 3600, "resources": ["vm-0"], "description": "Host maintenance."},
        {"at": 0, "type": "Reboot", "notice": None, "run_for": 3600, "resources": ["vm-0", "vm-1"],
         "description": "Host failure."},
    ],
}


def test_every_dashboard_query_returns_data_during_a_scenario(tmp_path: Path) -> None:
    """Template variables at their 'All' values; $__rate_interval as Grafana would set it for 1 s scrapes."""
    scenario = tmp_path / "dashboards.yaml"
    scenario.write_text(yaml.safe_dump(DASHBOARD_SCENARIO))
    running = Stack(tmp_path, str(scenario), speed=1)
    try:
        wait_until(lambda: len(running.query("azure_scheduled_event_info")) == 2, timeout=30)
        for board, title, expr in dashboard_queries():
            concrete = (expr.replace("$vm_scale_set", ".*").replace("$location", ".*").replace("$vm", ".*")
                        .replace("$__rate_interval", "5s"))
            # rates need two scrapes inside their range: wait for them rather than for a fixed time
            wait_until(lambda: running.query(concrete), timeout=15,  # noqa: B023 (called at once)
                       message=f"{board} / {title}: data for {concrete}")
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
