"""Fleet mode's metrics: per VM and scope, rendered from a cache that follows every change of the open events,
in both exposition formats, and clean for promtool."""

from __future__ import annotations

import gzip
import http.client
import re
import subprocess
from pathlib import Path

import pytest

import fleet_samples
from forewarn.fleet.feed import FleetEvent, parse_resource_graph_row
from forewarn.fleet.metrics import FleetMetrics, takes_gzip
from forewarn.imds.document import Document
from forewarn.imds.instance import VmInfo
from forewarn.metrics import Metrics
from forewarn.metrics.events import PLACE_LABELS
from forewarn.web.endpoints import add_metrics_endpoints
from forewarn.web.server import HttpServer
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
    # unchanged events: the same text (but for the process_* families, whose CPU and memory move between renders)
    assert without_process(metrics.render()[0]) == without_process(metrics.render()[0])
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


def scrape(port: int, headers: dict[str, str]) -> tuple[dict[str, str], bytes]:
    """One GET /metrics with exactly these headers (http.client adds no Accept-Encoding of its own)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/metrics", headers=headers)
        response = connection.getresponse()
        assert response.status == 200
        return {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def without_process(text: bytes) -> bytes:
    return b"".join(line for line in text.splitlines(keepends=True) if not line.startswith(b"process_"))


def test_metrics_go_out_compressed_to_a_gzip_client_and_inflated_to_any_other() -> None:
    """The events' families are kept as gzip: Prometheus (Accept-Encoding: gzip) gets them with the live
    families as a second member; a client without gzip gets the same text, with the right length."""
    metrics = FleetMetrics(["queue"])
    metrics.events_now([news("Scheduled", f"E-{n}") for n in range(3000)])  # a text of several parts
    metrics.source_succeeded("queue", 1_800_000_000.0)
    server = HttpServer("127.0.0.1", 0)
    add_metrics_endpoints(server, metrics.respond, lambda: (True, "ok"))
    server.start()
    try:
        port = server.server_address[1]
        plain_headers, plain = scrape(port, {"Accept": "text/plain"})
        gzip_headers, packed = scrape(port, {"Accept": "text/plain", "Accept-Encoding": "gzip"})
        refused_headers, refused = scrape(port, {"Accept-Encoding": "gzip;q=0, identity"})
        om_headers, om = scrape(port, {"Accept": OPENMETRICS, "Accept-Encoding": "gzip"})
    finally:
        server.stop()
    assert "content-encoding" not in plain_headers and int(plain_headers["content-length"]) == len(plain)
    assert gzip_headers["content-encoding"] == "gzip" and int(gzip_headers["content-length"]) == len(packed)
    assert len(packed) * 10 < len(plain)
    # the same text but for the process's own CPU, memory and descriptors, which move between scrapes
    assert len({without_process(text) for text in (gzip.decompress(packed), plain, refused, metrics.render()[0])}) == 1
    assert "content-encoding" not in refused_headers
    assert len(info_series(plain)) == 3000
    assert plain.count(b"azure_scheduled_events_source_up{") == 1
    text = gzip.decompress(om).decode()
    assert om_headers["content-type"].startswith("application/openmetrics-text")
    assert text.count("# EOF") == 1 and text.endswith("# EOF\n")


def test_the_compressed_families_follow_every_change_of_the_events() -> None:
    metrics = FleetMetrics(["queue"])
    metrics.events_now([news("Scheduled", "E-1")])
    first = metrics.render()[0]
    metrics.events_now([news("Started", "E-1")])
    assert [s["event_status"] for s in info_series(metrics.render()[0])] == ["Started"]
    metrics.events_now([])
    assert info_series(metrics.render()[0]) == [] and first != metrics.render()[0]


@pytest.mark.parametrize(("header", "takes"), [
    ("gzip", True), ("gzip, deflate, br", True), ("deflate, GZIP;q=0.5", True), ("x-gzip", True),
    ("", False), ("identity", False), ("gzip;q=0", False), ("br, gzip ; q=0.0", False), ("*", False),
])
def test_accept_encoding_is_read_as_http_says(header: str, takes: bool) -> None:
    assert takes_gzip(header) is takes


def test_approval_hook_and_node_families_are_absent_without_a_policy_and_appear_with_one() -> None:
    from test_metrics import FEATURE_FAMILIES, family_names

    node = [*FEATURE_FAMILIES["node_actions"], "azure_scheduled_events_fleet_vms_without_node_total",
            "azure_scheduled_events_fleet_undo_held", "azure_scheduled_events_fleet_nodes_waiting_for_snapshot"]
    every = {*FEATURE_FAMILIES["approvals"], *FEATURE_FAMILIES["hooks"], *node}
    metrics = FleetMetrics(["resourcegraph"])
    assert family_names(metrics.render()[0].decode()) & every == set()
    metrics.policy_loaded(hooks=False, node_actions=False)
    assert family_names(metrics.render()[0].decode()) & every == set(FEATURE_FAMILIES["approvals"])
    metrics.policy_loaded(hooks=True, node_actions=True)
    assert family_names(metrics.render()[0].decode()) & every == every


# --- per-VM series bounded by --metrics-max-vms; aggregates over every VM -------------------------------------

def scale_set_event(n: int, vms: int, status: str = "Scheduled", not_before: str | None = None,
                    group: str = "rg-a") -> FleetEvent:
    props = fleet_samples.properties(event_id=f"E-{n}", status=status, resources=[f"ss{n}_{k}" for k in range(vms)],
                                     not_before=not_before, DurationInSeconds=9)
    return parse_resource_graph_row(fleet_samples.resource_graph_row(
        props, fleet_samples.target_id("vmss", f"ss{n}", rg=group)))


def per_vm(text: bytes) -> dict[str, set[str]]:
    """Each per-VM family's series, by event id."""
    found: dict[str, set[str]] = {}
    for (name, labels) in parse_metrics(text.decode()):
        if name.startswith("azure_scheduled_event_"):
            found.setdefault(name, set()).add(dict(labels)["event_id"])
    return found


def totals(text: bytes) -> dict[str, float]:
    """The sum of each aggregate family, and the left-out counts by unit."""
    sums: dict[str, float] = {}
    for (name, labels), value in parse_metrics(text.decode()).items():
        if name == "azure_scheduled_events_per_vm_left_out":
            sums[f"left_out_{dict(labels)['unit']}"] = value
        elif name in ("azure_scheduled_events", "azure_scheduled_events_by_scope", "azure_scheduled_events_vms"):
            sums[name] = sums.get(name, 0) + value
    return sums


LATE, EARLY = "Tue, 24 Nov 2026 14:00:00 GMT", "Tue, 24 Nov 2026 12:00:00 GMT"
EARLIEST = "Tue, 24 Nov 2026 11:00:00 GMT"


@pytest.mark.parametrize(("max_vms", "shown"), [(0, "ABCD"), (17, "ABCD"), (12, "ABD"), (11, "AD"), (2, "")])
def test_per_vm_series_stop_at_the_limit_in_the_order_an_operator_acts_and_the_aggregates_count_every_vm(
        max_vms: int, shown: str) -> None:
    # A has Started (first whatever its NotBefore); then the earliest NotBefore: D, B, C. Whole events only.
    events = {"A": scale_set_event(1, 3, "Started"), "B": scale_set_event(2, 5, not_before=EARLY),
              "C": scale_set_event(3, 5, not_before=LATE), "D": scale_set_event(4, 4, not_before=EARLIEST,
                                                                                 group="rg-b")}
    metrics = FleetMetrics(["resourcegraph"], max_vms=max_vms)
    metrics.events_now(list(events.values()))
    text = metrics.render()[0]
    ids = {events[key].event_id for key in shown}
    vms = sum(len(events[key].vms.names) for key in shown)
    series = per_vm(text)
    assert series.get("azure_scheduled_event_info", set()) == ids and all(found <= ids for found in series.values())
    assert len([1 for name, _ in parse_metrics(text.decode()) if name == "azure_scheduled_event_info"]) == vms
    assert totals(text) == {"azure_scheduled_events": 4, "azure_scheduled_events_by_scope": 4,
                            "azure_scheduled_events_vms": 17, "left_out_events": 4 - len(shown),
                            "left_out_vms": 17 - vms}
    places = {dict(labels)["vm_scale_set"]: value for (name, labels), value in parse_metrics(text.decode()).items()
              if name == "azure_scheduled_events_vms"}
    assert places == {"ss1": 3, "ss2": 5, "ss3": 5, "ss4": 4}


def test_an_event_too_large_for_the_room_left_does_not_hide_the_smaller_ones_after_it() -> None:
    # A (Started, 3 VMs) first, then B (10 VMs, earliest NotBefore) that does not fit in 6, then C (2 VMs): C fits
    events = {"A": scale_set_event(1, 3, "Started"), "B": scale_set_event(2, 10, not_before=EARLIEST),
              "C": scale_set_event(3, 2, not_before=LATE)}
    metrics = FleetMetrics(["resourcegraph"], max_vms=6)
    metrics.events_now(list(events.values()))
    text = metrics.render()[0]
    assert per_vm(text)["azure_scheduled_event_info"] == {events["A"].event_id, events["C"].event_id}
    assert totals(text) == {"azure_scheduled_events": 3, "azure_scheduled_events_by_scope": 3,
                            "azure_scheduled_events_vms": 15, "left_out_events": 1, "left_out_vms": 10}


def sample_lines(metrics: FleetMetrics) -> int:
    return sum(1 for line in metrics.render()[0].decode().splitlines()
               if line and not line.startswith(("#", "process_")))


def series_costs() -> tuple[int, int]:
    """(series per VM, aggregate series an event adds at most), measured: a fleet with no event, one Scheduled
    event (NotBefore and DurationInSeconds set) on one VM, and one on five VMs, each in a scale set and scope of
    its own."""
    def count(*events: FleetEvent) -> int:
        metrics = FleetMetrics(["resourcegraph"], max_vms=0)
        metrics.events_now(list(events))
        return sample_lines(metrics)

    none = count()
    one, five = count(scale_set_event(1, 1, not_before=EARLY)), count(scale_set_event(1, 5, not_before=EARLY))
    per_vm_series = (five - one) // 4
    assert per_vm_series * 4 == five - one
    two = count(scale_set_event(1, 1, not_before=EARLY), scale_set_event(2, 1, not_before=EARLY, group="rg-b"))
    assert two - one == one - none  # each event costs the same
    return per_vm_series, one - none - per_vm_series


def test_docs_give_the_measured_series_per_vm_and_per_event() -> None:
    per_vm_series, per_event = series_costs()
    docs = (Path(__file__).parent.parent / "docs/metrics.md").read_text()
    stated = re.search(r"(\d+) series per VM it acts on,? plus (\d+) aggregate series", " ".join(docs.split()))
    assert stated is not None, "docs/metrics.md states the series an open event costs"
    assert (int(stated[1]), int(stated[2])) == (per_vm_series, per_event)


def test_the_families_of_a_source_or_the_lease_are_there_only_when_it_is_configured() -> None:
    queue = {"azure_scheduled_events_queue_messages_total", "azure_scheduled_events_feed_lag_seconds"}
    push = {"azure_scheduled_events_eventgrid_push_requests_total"}
    scoped = {"azure_scheduled_events_out_of_scope_total"}
    lease = {"azure_scheduled_events_handover_skipped_total"}
    every = queue | push | scoped | lease
    from test_metrics import family_names

    def shown(metrics: FleetMetrics) -> set[str]:
        return family_names(metrics.render()[0].decode()) & every

    def errors(metrics: FleetMetrics) -> list[str]:
        samples = parse_metrics(metrics.render()[0].decode())
        return sorted(dict(labels)["source"] for name, labels in samples
                      if name == "azure_scheduled_events_source_errors_total")

    only_snapshots = FleetMetrics(["resourcegraph"])
    assert shown(only_snapshots) == set() and errors(only_snapshots) == ["resourcegraph"]
    assert shown(FleetMetrics(["queue"])) == queue | scoped
    pushed = FleetMetrics(["resourcegraph", "eventgrid"])
    assert shown(pushed) == push | scoped
    text = pushed.render()[0].decode()
    assert 'out_of_scope_total{source="eventgrid"} 0.0' in text and 'out_of_scope_total{source="queue"}' not in text
    pushed.lease_in_use()
    assert shown(pushed) == push | scoped | lease


def test_the_node_families_help_speaks_of_the_fleets_nodes_not_of_this_node() -> None:
    metrics = FleetMetrics(["resourcegraph"])
    metrics.policy_loaded(hooks=False, node_actions=True)
    helps = {line.split()[2]: line for line in metrics.render()[0].decode().splitlines()
             if line.startswith("# HELP azure_scheduled_events_node_")}
    assert {"azure_scheduled_events_node_drains_in_progress", "azure_scheduled_events_node_drain_pods_total",
            "azure_scheduled_events_node_drain_blocked_since_timestamp_seconds"} <= set(helps)
    assert [line for line in helps.values() if "this node" in line or "this Kubernetes node" in line] == []
    assert "nodes of the fleet's VMs" in helps["azure_scheduled_events_node_drains_in_progress"]
