"""Fleet mode's metrics: per VM and scope, rendered from a cache that follows every change of the open events,
in both exposition formats, and clean for promtool."""

from __future__ import annotations

import subprocess

from forewarn.fleet.metrics import FleetMetrics
from test_fleet_state import news

from conftest import parse_metrics, require_promtool

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


def info_series(text: bytes) -> list[dict[str, str]]:
    samples = parse_metrics(text.decode())
    return [dict(labels) for (name, labels) in samples if name == "azure_scheduled_event_info"]


def test_each_vm_of_an_open_event_is_a_series_and_it_vanishes_when_the_event_ends() -> None:
    metrics = FleetMetrics(["queue"])
    metrics.events_now([news("Scheduled", "E-1"), news("Started", "E-2")])
    first = info_series(metrics.render()[0])
    assert sorted((s["event_id"], s["vm"], s["vm_scale_set"], s["event_status"]) for s in first) == [
        ("E-1", "pool_0", "pool", "Scheduled"), ("E-2", "pool_0", "pool", "Started")]
    assert metrics.render()[0] == metrics.render()[0]        # unchanged events: the same text
    metrics.events_now([news("Started", "E-2")])             # E-1 ended
    assert [s["event_id"] for s in info_series(metrics.render()[0])] == ["E-2"]


def test_both_formats_pass_promtool_and_openmetrics_ends_once() -> None:
    metrics = FleetMetrics(["resourcegraph", "queue", "eventgrid"], api_version="2024-04-01")
    metrics.events_now([news("Scheduled", f"E-{n}") for n in range(5)])
    metrics.source_succeeded("queue", 1_800_000_000.0)
    text, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    result = subprocess.run([require_promtool(), "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    body, content_type = metrics.render(OPENMETRICS)
    assert content_type.startswith("application/openmetrics-text")
    assert body.count(b"# EOF") == 1 and body.endswith(b"# EOF\n")
    assert b'azure_scheduled_events_source_up{source="queue"} 1.0' in body
    assert b'azure_scheduled_events_build_info{api_version="2024-04-01",mode="fleet"' in text
