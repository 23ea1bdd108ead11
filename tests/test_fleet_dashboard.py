"""forewarn fleet's own dashboard (dashboards/fleet-central.json): one datasource variable, only the families
`forewarn fleet` exports, the job filter everywhere; and every query run by a real Prometheus scraping a
`forewarn fleet` that two Event Grid pushes filled (a VM's event and a scale set's of two VMs)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from fleet_samples import event_grid_event, properties, target_id
from forewarn.fleet.metrics import FleetMetrics
from test_fleet_state import news

from conftest import free_port, require_tool, wait_until

ROOT = Path(__file__).parent.parent
BOARD = ROOT / "dashboards" / "fleet-central.json"
SECRET = "0123456789abcdef0123456789abcdef"
SUB = "0b6a1c2d-3e4f-4a5b-8c7d-9e0f1a2b3c4d"


def board() -> dict[str, Any]:
    return dict(json.loads(BOARD.read_text()))


def targets() -> list[tuple[str, int, str]]:
    return [(panel["title"], index, target["expr"]) for panel in board()["panels"] if panel["type"] != "row"
            for index, target in enumerate(panel["targets"])]


def exported() -> set[str]:
    metrics = FleetMetrics(["resourcegraph", "queue", "eventgrid"])
    metrics.events_now([news("Scheduled", "E-1")])
    metrics.policy_loaded(hooks=True, node_actions=True)  # every family, those of the features that may be off too
    metrics.lease_in_use()
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)", metrics.render()[0].decode(), re.MULTILINE):
        names.add(name + "_total" if kind == "counter" and not name.endswith("_total") else name)
    return names


def test_the_board_uses_its_variables_and_only_what_forewarn_fleet_exports() -> None:
    variables = {v["name"]: v for v in board()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and board()["uid"] == "forewarn-fleet-central"
    assert set(variables) == {"datasource", "job", "subscription", "resource_group", "vm"}
    names = exported()
    for panel in (p for p in board()["panels"] if p["type"] != "row"):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
    for title, _, expr in targets():
        for name in re.findall(r"\b(azure_scheduled_events?_[a-z_]+)\b", expr):
            assert name in names, (title, name)
        assert 'job=~"$job"' in expr, (title, expr)


#: Stat panels that may read per-VM series, and why: no aggregate carries NotBefore.
PER_VM_STATS = {"Soonest NotBefore"}


def test_counts_come_from_the_aggregates_that_metrics_max_vms_never_cuts() -> None:
    """--metrics-max-vms cuts the per-VM families (azure_scheduled_event_*), never the aggregates: a panel that
    counts must read the aggregates, or it undercounts a large fleet. Per-VM series are for the per-VM table (and
    the soonest NotBefore, which no aggregate carries)."""
    per_vm = re.compile(r"\bazure_scheduled_event_[a-z_]+")
    for panel in (p for p in board()["panels"] if p["type"] == "stat" and p["title"] not in PER_VM_STATS):
        for target in panel["targets"]:
            assert not per_vm.search(target["expr"]), (panel["title"], target["expr"])
    titles = {panel["title"]: panel for panel in board()["panels"]}
    assert "azure_scheduled_events_vms{" in titles["VMs under open events"]["targets"][0]["expr"]
    assert "azure_scheduled_events_by_scope{" in titles["Events open"]["targets"][0]["expr"]
    assert 'per_vm_left_out{job=~"$job", unit="vms"}' in titles["VMs left out of the per-VM series"]["targets"][0][
        "expr"]
    for variable in board()["templating"]["list"]:   # a scope whose VMs are all left out is still offered
        if variable["name"] in ("subscription", "resource_group"):
            assert variable["query"]["query"].startswith("label_values(azure_scheduled_events_by_scope{")
    # fleet-overview.json is the per-VM agent's: it joins on azure_scheduled_events_vm_info, which fleet mode does
    # not export, so fleet mode's limit cannot make it undercount
    assert "azure_scheduled_events_vm_info" not in exported()


def concrete(expr: str) -> str:
    for variable in ("job", "vm", "subscription", "resource_group"):
        expr = expr.replace(f"${variable}", ".*")
    return expr.replace("$__rate_interval", "1m")


@pytest.mark.slow
def test_every_query_of_the_board_shows_the_fleet_a_real_prometheus_scraped(tmp_path: Path) -> None:
    port, prom_port = free_port(), free_port()
    fleet = subprocess.Popen([sys.executable, "-m", "forewarn", "fleet", "--eventgrid-path", "/eventgrid",
                              "--listen-address", f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "state"),
                              "--metrics-max-vms", "1"],   # the scale set's two VMs left out of the per-VM series
                             env={"FOREWARN_EVENTGRID_SECRET": SECRET, "PATH": "/usr/bin:/bin"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [{"job_name": "forewarn-fleet",
                                  "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    prometheus = subprocess.Popen([require_tool("prometheus", "Debian package prometheus"),
                                   f"--config.file={tmp_path / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{prom_port}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{prom_port}/api/v1"

    def query(expr: str) -> list[dict[str, Any]]:
        body = requests.get(f"{api}/query", params={"query": expr}, timeout=5).json()
        assert body["status"] == "success", (expr, body)
        return list(body["data"]["result"])

    try:
        wait_until(lambda: _up(f"http://127.0.0.1:{port}/metrics"), timeout=30, message="forewarn fleet")
        pushed = [event_grid_event(properties(event_id="E-vm", resources=("web-1",)),
                                   target_id("vm", "web-1", sub=SUB, rg="rg-web"), "d-1"),
                  event_grid_event(properties(event_id="E-pool", event_type="Freeze", resources=("pool_0", "pool_1")),
                                   target_id("vmss", "pool", sub=SUB, rg="rg-pool"), "d-2")]
        answer = requests.post(f"http://127.0.0.1:{port}/eventgrid", params={"code": SECRET}, json=pushed, timeout=10)
        assert answer.status_code == 200, answer.text
        wait_until(lambda: _up(f"http://127.0.0.1:{prom_port}/-/ready"), timeout=60, message="prometheus")
        wait_until(lambda: query('count(azure_scheduled_event_info{job="forewarn-fleet"})'), timeout=30,
                   message="the events scraped")
        time.sleep(2)
        results = {(title, index): query(concrete(expr)) for title, index, expr in targets()}
    finally:
        for proc in (prometheus, fleet):
            proc.terminate()
            proc.wait(20)

    def value(title: str, index: int = 0) -> float:
        (series,) = results[(title, index)]
        return float(series["value"][1])

    # the counts cover every VM and event; the per-VM table shows what --metrics-max-vms 1 kept, and says so
    assert value("VMs under open events") == 3 and value("Events open") == 2
    assert value("VMs left out of the per-VM series") == 2
    assert value("Soonest NotBefore") > 0 or value("Soonest NotBefore") < 0   # a number: NotBefore is set
    assert value("Active replicas") == 1
    rows = {(r["metric"]["vm"], r["metric"]["event_id"]) for r in results[("Open events by VM", 0)]}
    assert rows == {("web-1", "E-vm")}
    sources = {r["metric"]["source"]: float(r["value"][1]) for r in results[("Sources up", 0)]}
    assert sources == {"eventgrid": 1.0}
    for title, index, _ in targets():   # the rest: zero-filled counters give series, none fails
        assert (title, index) in results


def _up(url: str) -> bool:
    try:
        return requests.get(url, timeout=1).status_code == 200
    except requests.RequestException:
        return False
