"""The Grafana dashboards: current schema, one datasource variable everywhere, VM variables from vm_info,
and only metric names that forewarn exports. Their queries run against a real Prometheus in
test_prometheus.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from forewarn.metrics import Metrics

#: The boards of the per-VM agent's metrics (forewarn fleet's own, fleet-central.json, is tested in
#: tests/test_fleet_dashboard.py).
DASHBOARDS = sorted(p for p in (Path(__file__).parent.parent / "dashboards").glob("*.json")
                    if p.name != "fleet-central.json")
PROMQL_WORDS = {"by", "on", "group_left", "group_right", "count", "min", "max", "sum", "avg", "rate", "increase",
                "time", "vector", "or", "and", "histogram_quantile", "label_values", "without", "ignoring"}


def load(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in board["panels"] if p["type"] != "row"]


def queries(board: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(board) for t in p["targets"]]


def exported_names() -> set[str]:
    metrics = Metrics()
    metrics.policy_loaded(hooks=True, node_actions=True)  # every family, those of the features that may be off too
    text = metrics.render()[0].decode()
    names = set(re.findall(r"^# TYPE (\S+) (\S+)", text, re.MULTILINE))
    out = set()
    for name, kind in names:
        out.add(name)
        if kind == "counter":
            out.add(name + "_total")
        if kind == "histogram":
            out.update({name + "_bucket", name + "_sum", name + "_count"})
    return out


def test_there_are_a_fleet_and_a_single_vm_dashboard() -> None:
    assert [p.name for p in DASHBOARDS] == ["fleet-overview.json", "single-vm.json"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_panel_uses_the_datasource_variable(path: Path) -> None:
    board = load(path)
    assert board["schemaVersion"] >= 39 and board["uid"].startswith("forewarn-")
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("vm", "vm_scale_set", "location"):
        assert "azure_scheduled_events_vm_info" in variables[name]["definition"]
    for panel in panels(board):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_queries_use_only_exported_metrics_and_the_vm_filter(path: Path) -> None:
    exported = exported_names()
    for expr in queries(load(path)):
        for name in re.findall(r"\b(azure_scheduled_events?_[a-z_]+)\b", expr):
            assert name in exported, (name, expr)
        assert 'vm_name=~"$vm"' in expr, expr
