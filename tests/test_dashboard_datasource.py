"""Every dashboard works with whichever Prometheus data source a Grafana has: in Azure Managed Grafana that is
an Azure Monitor workspace, added as a data source of type prometheus under a uid of its own. So the data source
is the dashboard variable `datasource` (type datasource, query prometheus) in every panel, every panel nested in
a row, every query and every templating query, and no data source uid is written anywhere."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parent.parent
BOARDS = sorted((ROOT / "dashboards").glob("*.json"))
CHART_COPIES = ROOT / "deploy" / "helm" / "forewarn" / "files" / "dashboards"
VARIABLE = {"type": "prometheus", "uid": "${datasource}"}


def every_panel(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Panels at every depth: a row holds its panels in `panels` while collapsed."""
    for panel in panels:
        yield panel
        yield from every_panel(panel.get("panels", []))


def references(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every `datasource` value anywhere in the board, with where it is."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource":
                yield f"{path}/{key}", value
            yield from references(value, f"{path}/{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from references(value, f"{path}/{index}")


def problems(board: dict[str, Any]) -> list[str]:
    """What would tie the board to one Grafana's data source, or leave a part without the variable."""
    found = []
    variables = board.get("templating", {}).get("list", [])
    pickers = [v for v in variables if v.get("type") == "datasource"]
    if [(v.get("name"), v.get("query")) for v in pickers] != [("datasource", "prometheus")]:
        found.append("templating: not exactly one variable `datasource` of type datasource with query prometheus")
    elif pickers[0].get("current", {}).get("value") not in (None, "", "default"):
        found.append("templating/datasource: a fixed current data source")
    for variable in variables:
        if variable.get("type") == "query" and variable.get("datasource") != VARIABLE:
            found.append(f"templating/{variable.get('name')}: datasource {variable.get('datasource')!r}")
    for panel in every_panel(board.get("panels", [])):
        where = f"panel {panel.get('title')!r}"
        if panel.get("type") == "row":
            if "datasource" in panel and panel["datasource"] not in (None, VARIABLE):
                found.append(f"{where}: datasource {panel['datasource']!r}")
            continue
        if panel.get("datasource") != VARIABLE:
            found.append(f"{where}: datasource {panel.get('datasource')!r}")
        if not panel.get("targets"):
            found.append(f"{where}: no query")
        for target in panel.get("targets", []):
            if target.get("datasource") != VARIABLE:
                found.append(f"{where} query {target.get('refId')}: datasource {target.get('datasource')!r}")
    for path, value in references(board):
        if value != VARIABLE:
            found.append(f"{path}: {value!r} is not the variable")
    if "__inputs" in board or "${DS_" in json.dumps(board):
        found.append("__inputs: an import-time data source beside the variable")
    return sorted(set(found))


@pytest.mark.parametrize("path", BOARDS, ids=lambda p: p.name)
def test_every_part_of_every_dashboard_uses_the_datasource_variable(path: Path) -> None:
    board = json.loads(path.read_text())
    assert problems(board) == []
    assert sum(1 for p in every_panel(board["panels"]) if p["type"] != "row") >= 5
    # the chart's ConfigMaps carry the same boards (tests/test_helm.py compares the bytes)
    assert json.loads((CHART_COPIES / path.name).read_text()) == board


def test_there_are_dashboards_to_check() -> None:
    assert [p.name for p in BOARDS] == sorted(p.name for p in CHART_COPIES.glob("*.json"))
    assert len(BOARDS) >= 3


def test_the_check_finds_a_fixed_uid_at_any_depth() -> None:
    board = json.loads(BOARDS[0].read_text())
    fixed = {"type": "prometheus", "uid": "P1809F7CD0C75ACF3"}
    broken = copy.deepcopy(board)
    inner = {"id": 900, "type": "stat", "title": "nested", "datasource": VARIABLE,
             "targets": [{"refId": "A", "expr": "up", "datasource": fixed}]}
    broken["panels"].append({"id": 901, "type": "row", "title": "collapsed", "collapsed": True, "panels": [inner]})
    query_variable = next(v for v in broken["templating"]["list"] if v["type"] == "query")
    query_variable["datasource"] = fixed
    broken["annotations"]["list"].append({"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                          "enable": True, "hide": True, "name": "Annotations & Alerts"})
    broken["__inputs"] = [{"name": "DS_PROMETHEUS", "type": "datasource", "pluginId": "prometheus"}]
    found = problems(broken)
    assert "panel 'nested' query A: datasource {'type': 'prometheus', 'uid': 'P1809F7CD0C75ACF3'}" in found
    assert f"templating/{query_variable['name']}: datasource {fixed!r}" in found
    assert any(p.startswith("/annotations/list/0/datasource:") for p in found)
    assert "__inputs: an import-time data source beside the variable" in found
    no_picker = copy.deepcopy(board)
    no_picker["templating"]["list"] = [v for v in no_picker["templating"]["list"] if v["type"] != "datasource"]
    assert problems(no_picker)[0].startswith("templating: not exactly one variable")
