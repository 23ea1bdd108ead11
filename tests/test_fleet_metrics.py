"""Fleet mode's metrics: per VM and scope, rendered from a cache that follows every change of the open events,
in both exposition formats, and clean for promtool."""

from __future__ import annotations

import subprocess

from forewarn.fleet.metrics import FleetMetrics
from forewarn.imds.document import Document
from forewarn.imds.instance import VmInfo
from forewarn.metrics import Metrics
from forewarn.metrics.events import PLACE_LABELS
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


def families(text: bytes) -> dict[str, set[frozenset[str]]]:
    """Each per-event family's name with the label names of its series."""
    found: dict[str, set[frozenset[str]]] = {}
    for name, labels in parse_metrics(text.decode()):
        if name.startswith("azure_scheduled_event_"):
            found.setdefault(name, set()).add(frozenset(key for key, _ in labels))
    return found


def test_the_fleet_shows_the_per_vm_agents_event_families_with_the_vms_place_as_labels() -> None:
    fleet = FleetMetrics(["queue"])
    event = news("Scheduled", "E-1")
    fleet.events_now([event], now=1000.0)
    agent = Metrics()
    agent.views.vm_known(VmInfo(name="pool_0"))
    agent.views.document_seen(Document(7, (event.event,)), 1000.0, status_since={"E-1": 1000.0})
    fleet_families, agent_families = families(fleet.render()[0]), families(agent.render()[0])
    # the per-VM agent's scrape-time countdown is its own (10,000 fleet series would be rendered per scrape)
    del agent_families["azure_scheduled_event_seconds_to_not_before"]
    place = frozenset(PLACE_LABELS)
    assert fleet_families == {name: {labels | place for labels in label_sets}
                              for name, label_sets in agent_families.items()}
    assert set(fleet_families) >= {"azure_scheduled_event_info", "azure_scheduled_event_duration_seconds",
                                   "azure_scheduled_event_status_since_timestamp_seconds"}


def test_status_since_holds_while_the_status_does_and_moves_with_it() -> None:
    metrics = FleetMetrics(["queue"])

    def since(text: bytes) -> dict[str, float]:
        return {dict(labels)["event_id"]: value for (name, labels), value in parse_metrics(text.decode()).items()
                if name == "azure_scheduled_event_status_since_timestamp_seconds"}

    metrics.events_now([news("Scheduled", "E-1"), news("Scheduled", "E-2")], now=100.0)
    metrics.events_now([news("Scheduled", "E-1"), news("Started", "E-2")], now=160.0)
    assert since(metrics.render()[0]) == {"E-1": 100.0, "E-2": 160.0}
    metrics.events_now([news("Started", "E-2")], now=200.0)   # E-1 ended, E-2 unchanged
    assert since(metrics.render()[0]) == {"E-2": 160.0}
