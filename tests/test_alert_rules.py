"""The shipped Prometheus rules: valid, and every alert covered by a passing promtool unit test."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from conftest import require_promtool

PROMETHEUS = Path(__file__).parent.parent / "deploy" / "prometheus"
RULES = PROMETHEUS / "forewarn-alerts.yaml"
UNIT_TESTS = PROMETHEUS / "tests" / "forewarn-alerts.test.yaml"
RUNBOOK = Path(__file__).parent.parent / "docs" / "runbook.md"


def alerts() -> list[dict[str, object]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_promtool_checks_the_rules() -> None:
    result = subprocess.run([require_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_pass() -> None:
    result = subprocess.run([require_promtool(), "test", "rules", str(UNIT_TESTS)], capture_output=True,
                            text=True, timeout=120, cwd=UNIT_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_unit_test_and_a_runbook_section() -> None:
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    fired = {case["alertname"] for test in tests for case in test.get("alert_rule_test", []) if case["exp_alerts"]}
    names = {str(rule["alert"]) for rule in alerts()}
    assert names == fired
    headings = set(re.findall(r"^## (\w+)$", RUNBOOK.read_text(), flags=re.MULTILINE))
    assert names <= headings
    for rule in alerts():
        annotations = rule["annotations"]
        assert isinstance(annotations, dict) and annotations["summary"]
        assert annotations["runbook_url"] == f"docs/runbook.md#{str(rule['alert']).lower()}"
