"""Metrics through their public seams: the typed operations of the view holder in, the exposition out."""

from __future__ import annotations

import subprocess
import threading
import time
from typing import Any

from forewarn.imds.document import EVENT_SOURCES, EVENT_STATUSES, EVENT_TYPES, parse_document
from forewarn.imds.instance import VmInfo
from forewarn.metrics import MAX_LABEL_CHARS, Metrics
from forewarn.outbox.store import Backlog

from conftest import parse_metrics, require_promtool, sample, series

OPENMETRICS = "application/openmetrics-text; version=1.0.0"

DOC = parse_document({"DocumentIncarnation": 4, "Events": [
    {"EventId": "A", "EventType": "Reboot", "ResourceType": "VirtualMachine", "Resources": ["vm-0"],
     "EventStatus": "Scheduled", "NotBefore": "Thu, 01 Jan 1970 00:16:40 GMT", "Description": "host update",
     "EventSource": "Platform", "DurationInSeconds": -1},
    {"EventId": "B", "EventType": "Freeze", "ResourceType": "VirtualMachine", "Resources": ["vm-1"],
     "EventStatus": "Started", "NotBefore": "", "Description": "", "EventSource": "Platform", "DurationInSeconds": 5},
    {"EventId": "C", "EventType": "Hibernate", "Resources": [], "EventStatus": "Scheduled", "NotBefore": ""},
]})


def scrape(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return parse_metrics(metrics.render()[0].decode())


def test_per_event_series_follow_the_document_and_countdown_uses_scrape_time() -> None:
    now = [900.0]
    metrics = Metrics(clock=lambda: now[0])
    metrics.views.vm_known(VmInfo(name="vm-0"))
    metrics.views.document_seen(DOC, 899.0)
    samples = scrape(metrics)
    info = {row["event_id"]: row for row in series(samples, "azure_scheduled_event_info")}
    assert info["A"] == {"event_id": "A", "event_type": "Reboot", "event_status": "Scheduled",
                         "event_source": "Platform", "resource_type": "VirtualMachine", "affects_this_vm": "true",
                         "description": "host update"}
    assert info["B"]["affects_this_vm"] == "false" and info["C"]["event_source"] == ""
    assert sample(samples, "azure_scheduled_event_not_before_timestamp_seconds", event_id="A",
                  event_type="Reboot") == 1000.0
    assert sample(samples, "azure_scheduled_event_seconds_to_not_before", event_id="A", event_type="Reboot") == 100.0
    now[0] = 950.0
    assert sample(scrape(metrics), "azure_scheduled_event_seconds_to_not_before", event_id="A",
                  event_type="Reboot") == 50.0
    # absent while NotBefore is empty; duration absent when the document lacks it
    assert [r["event_id"] for r in series(samples, "azure_scheduled_event_seconds_to_not_before")] == ["A"]
    assert sorted(r["event_id"] for r in series(samples, "azure_scheduled_event_duration_seconds")) == ["A", "B"]
    assert sample(samples, "azure_scheduled_events_document_incarnation") == 4
    assert sample(samples, "azure_scheduled_events_imds_up") == 1
    assert sample(samples, "azure_scheduled_events_imds_last_success_timestamp_seconds") == 899.0


def test_series_vanish_when_the_event_leaves() -> None:
    metrics = Metrics()
    metrics.views.document_seen(DOC, 1.0)
    assert len(series(scrape(metrics), "azure_scheduled_event_info")) == 3
    metrics.views.document_seen(parse_document({"DocumentIncarnation": 5, "Events": []}), 2.0)
    assert series(scrape(metrics), "azure_scheduled_event_info") == []


def test_a_failed_poll_keeps_the_last_document_and_success_time() -> None:
    metrics = Metrics()
    metrics.views.document_seen(DOC, 10.0)
    metrics.views.imds_failed()
    samples = scrape(metrics)
    assert sample(samples, "azure_scheduled_events_imds_up") == 0
    assert sample(samples, "azure_scheduled_events_imds_last_success_timestamp_seconds") == 10.0
    assert len(series(samples, "azure_scheduled_event_info")) == 3
    metrics.views.document_seen(DOC, 11.0)
    assert sample(scrape(metrics), "azure_scheduled_events_imds_up") == 1


def test_a_resumed_document_is_shown_but_is_not_a_successful_poll() -> None:
    metrics = Metrics()
    metrics.views.document_resumed(DOC, {"A": 5.0})
    samples = scrape(metrics)
    assert len(series(samples, "azure_scheduled_event_info")) == 3
    assert sample(samples, "azure_scheduled_events_imds_up") == 0
    assert sample(samples, "azure_scheduled_events_imds_last_success_timestamp_seconds") is None
    assert sample(samples, "azure_scheduled_event_status_since_timestamp_seconds", event_id="A", event_type="Reboot",
                  event_status="Scheduled") == 5.0


def test_status_since_is_kept_until_a_poll_gives_a_new_one() -> None:
    metrics = Metrics()
    metrics.views.document_seen(DOC, 1.0, {"A": 1.0, "B": 1.0})
    metrics.views.document_seen(DOC, 2.0)  # no status changed: the earlier times stay
    samples = scrape(metrics)
    assert {row["event_id"] for row in series(samples, "azure_scheduled_event_status_since_timestamp_seconds")} \
        == {"A", "B"}
    assert sample(samples, "azure_scheduled_event_status_since_timestamp_seconds", event_id="B", event_type="Freeze",
                  event_status="Started") == 1.0
    metrics.views.document_seen(DOC, 3.0, {"A": 1.0, "B": 3.0})
    assert sample(scrape(metrics), "azure_scheduled_event_status_since_timestamp_seconds", event_id="B",
                  event_type="Freeze", event_status="Started") == 3.0


def test_aggregates_are_zero_filled_and_unknown_values_pass_through() -> None:
    metrics = Metrics()
    metrics.views.document_seen(DOC, 1.0)
    samples = scrape(metrics)
    rows = series(samples, "azure_scheduled_events")
    assert len(rows) == len(EVENT_TYPES) * len(EVENT_STATUSES) * len(EVENT_SOURCES) + 1
    assert sample(samples, "azure_scheduled_events", event_type="Reboot", event_status="Scheduled",
                  event_source="Platform") == 1
    assert sample(samples, "azure_scheduled_events", event_type="Terminate", event_status="Started",
                  event_source="User") == 0
    assert sample(samples, "azure_scheduled_events", event_type="Hibernate", event_status="Scheduled",
                  event_source="") == 1
    assert sample(samples, "azure_scheduled_events_observed_total", event_type="Preempt", event_source="User") == 0
    assert sample(samples, "azure_scheduled_events_ended_total", event_type="Freeze", outcome="cancelled") == 0
    metrics.policy_loaded(hooks=True, node_actions=False)
    samples = scrape(metrics)
    assert sample(samples, "azure_scheduled_events_approvals_total", event_type="Reboot", result="dry_run") == 0
    assert sample(samples, "azure_scheduled_events_hook_runs_total", hook="recover", result="timeout") == 0


def test_long_label_values_are_clipped() -> None:
    fits, long = "d" * MAX_LABEL_CHARS, "x" * (MAX_LABEL_CHARS + 100)
    metrics = Metrics()
    metrics.views.document_seen(parse_document({"DocumentIncarnation": 1, "Events": [
        {"EventId": "A", "EventType": "Reboot", "Resources": [], "EventStatus": "Scheduled", "NotBefore": "",
         "Description": fits, "EventSource": long},
        {"EventId": "B", "EventType": "Reboot", "Resources": [], "EventStatus": "Scheduled", "NotBefore": "",
         "Description": long},
    ]}), 1.0)
    samples = scrape(metrics)
    info = {row["event_id"]: row for row in series(samples, "azure_scheduled_event_info")}
    clipped = "x" * (MAX_LABEL_CHARS - 3) + "..."
    assert info["A"]["description"] == fits and info["A"]["event_source"] == clipped
    assert info["B"]["description"] == clipped
    assert sample(samples, "azure_scheduled_events", event_type="Reboot", event_status="Scheduled",
                  event_source=clipped) == 1


def test_health_backlogs_build_and_vm_info() -> None:
    now = [100.0]
    metrics = Metrics(api_version="2019-08-01", clock=lambda: now[0])
    metrics.add_sink("stdout")
    metrics.add_sink("file")
    samples = scrape(metrics)
    assert sample(samples, "azure_scheduled_events_outbox_records", sink="file") == 0
    assert sample(samples, "azure_scheduled_events_outbox_oldest_record_age_seconds", sink="file") == 0
    assert sample(samples, "azure_scheduled_events_records_total", sink="stdout") == 0
    assert sample(samples, "azure_scheduled_events_record_failures_total", sink="stdout") == 0
    assert sample(samples, "azure_scheduled_events_state_writable") == 1
    metrics.views.backlog("stdout", Backlog(records=3, oldest_created=40.0))
    metrics.views.store_writable(False)
    metrics.views.vm_known(VmInfo(name="vm-0", vm_id="id", vm_scale_set="ss", resource_group="rg",
                                  subscription_id="sub", location="westeurope", zone="2"))
    samples = scrape(metrics)
    assert sample(samples, "azure_scheduled_events_imds_up") == 0
    assert sample(samples, "azure_scheduled_events_outbox_records", sink="stdout") == 3
    assert sample(samples, "azure_scheduled_events_outbox_oldest_record_age_seconds", sink="stdout") == 60.0
    assert sample(samples, "azure_scheduled_events_outbox_records", sink="file") == 0  # other sinks untouched
    assert sample(samples, "azure_scheduled_events_state_writable") == 0
    (build,) = series(samples, "azure_scheduled_events_build_info")
    assert build["api_version"] == "2019-08-01"
    (vm,) = series(samples, "azure_scheduled_events_vm_info")
    assert vm == {"vm_name": "vm-0", "vm_id": "id", "vm_scale_set": "ss", "resource_group": "rg",
                  "subscription_id": "sub", "location": "westeurope", "zone": "2"}
    # no last-success sample before the first good poll
    assert sample(samples, "azure_scheduled_events_imds_last_success_timestamp_seconds") is None
    metrics.views.store_writable(True)
    assert sample(scrape(metrics), "azure_scheduled_events_state_writable") == 1


def test_promtool_accepts_the_exposition() -> None:
    promtool = require_promtool()
    metrics = Metrics()
    metrics.add_sink("stdout")
    metrics.views.vm_known(VmInfo(name="vm-0"))
    metrics.views.document_seen(DOC, 1.0, {"A": 1.0})
    metrics.observed.labels("Reboot", "Platform").inc()
    metrics.imds_duration.labels("GET").observe(0.01)
    result = subprocess.run([promtool, "check", "metrics"], input=metrics.render()[0],
                            capture_output=True, timeout=30)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    assert result.stdout.strip() == b"" and result.stderr.strip() == b""


def test_document_families_are_rendered_again_only_when_the_document_vm_or_a_status_changes() -> None:
    now = [900.0]
    metrics = Metrics(clock=lambda: now[0])
    metrics.views.vm_known(VmInfo(name="vm-0"))
    metrics.views.document_seen(DOC, 1.0, {"A": 1.0})
    first = metrics.render()[0]
    assert first.count(b"azure_scheduled_event_info{") == 3 and metrics.document_renders == 1
    # health, backlogs and polls without a status change reuse the text
    metrics.views.document_seen(DOC, 2.0)
    metrics.views.imds_failed()
    metrics.views.store_writable(False)
    metrics.views.backlog("stdout", Backlog(records=1, oldest_created=None))
    now[0] = 950.0
    second = scrape(metrics)
    assert metrics.document_renders == 1
    assert sample(second, "azure_scheduled_event_seconds_to_not_before", event_id="A", event_type="Reboot") == 50.0
    assert sample(second, "azure_scheduled_events_imds_up") == 0
    assert sample(second, "azure_scheduled_events_outbox_records", sink="stdout") == 1
    metrics.views.document_seen(DOC, 3.0, {"A": 3.0})
    assert sample(scrape(metrics), "azure_scheduled_event_status_since_timestamp_seconds", event_id="A",
                  event_type="Reboot", event_status="Scheduled") == 3.0
    assert metrics.document_renders == 2
    metrics.views.vm_known(VmInfo(name="vm-1"))
    assert series(scrape(metrics), "azure_scheduled_events_vm_info")[0]["vm_name"] == "vm-1"
    assert metrics.document_renders == 3
    metrics.views.document_seen(parse_document({"DocumentIncarnation": 5, "Events": []}), 4.0)
    assert b"azure_scheduled_event_info{" not in metrics.render()[0]
    assert metrics.document_renders == 4
    # each format has text of its own, and OpenMetrics still ends once, at the very end
    text, content_type = metrics.render(OPENMETRICS)
    assert content_type.startswith("application/openmetrics-text") and metrics.document_renders == 5
    assert text.count(b"# EOF") == 1 and text.endswith(b"# EOF\n")


class _CountingCondition(threading.Condition):
    """A Condition that counts its waits (the scrapes that found a rendering under way)."""

    waiting = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting += 1  # the lock is held here
        return super().wait(timeout)


def test_scrapes_that_arrive_together_share_a_rendering_that_began_after_them() -> None:
    metrics = Metrics()
    many = parse_document({"DocumentIncarnation": 9, "Events": [  # a rendering that takes a while
        {"EventId": f"E{i}", "EventType": "Reboot", "Resources": ["vm-0"], "EventStatus": "Scheduled",
         "NotBefore": "Thu, 01 Jan 1970 00:16:40 GMT"} for i in range(1000)]})
    metrics.views.vm_known(VmInfo(name="vm-0"))
    metrics.views.document_seen(many, 1.0)
    for expected in (1, 2, 3):  # one after another: each scrape renders afresh
        metrics.render()
        assert metrics.renders == expected
    # Deterministic overlap: the first scrape's rendering is held until the 19 that arrive after it
    # began are all waiting; they cannot use it (it began before they arrived) and share the next one.
    rendering = metrics._rendering
    flight = _CountingCondition()
    rendering._flight = flight
    render_once = rendering._render
    first_started = threading.Event()

    def held_render(encoder: Any) -> bytes:
        if not first_started.is_set():
            first_started.set()
            deadline = time.monotonic() + 10
            while flight.waiting < 19 and time.monotonic() < deadline:
                time.sleep(0.001)
        return render_once(encoder)

    rendering._render = held_render  # type: ignore[method-assign]
    bodies: list[bytes] = []

    def scrape() -> None:
        bodies.append(metrics.render()[0])

    first = threading.Thread(target=scrape)
    first.start()
    assert first_started.wait(10)
    threads = [threading.Thread(target=scrape) for _ in range(19)]
    for thread in threads:
        thread.start()
    for thread in [first, *threads]:
        thread.join()
    assert flight.waiting >= 19
    assert len(bodies) == 20 and all(b"azure_scheduled_event_info{" in body for body in bodies)
    assert metrics.renders == 3 + 2  # the held one, then one for the 19 together
    rendering._render = render_once  # type: ignore[method-assign]
    # each content type is rendered on its own
    text, content_type = metrics.render(OPENMETRICS)
    assert text.endswith(b"# EOF\n") and content_type.startswith("application/openmetrics-text")


def test_the_countdown_is_written_to_the_millisecond_ahead_behind_and_for_a_fractional_not_before() -> None:
    """Whole-second NotBefores (as IMDS writes them) take an integer path; the text is the difference
    rounded to the millisecond either way."""
    name = "azure_scheduled_event_seconds_to_not_before"
    whole = parse_document({"DocumentIncarnation": 1, "Events": [
        {"EventId": "ahead", "EventType": "Reboot", "EventStatus": "Scheduled",
         "NotBefore": "Thu, 01 Jan 1970 00:16:40 GMT"},  # 1000
        {"EventId": "behind", "EventType": "Freeze", "EventStatus": "Scheduled",
         "NotBefore": "Thu, 01 Jan 1970 00:00:10 GMT"}]})  # 10
    fractional = parse_document({"DocumentIncarnation": 2, "Events": [
        {"EventId": "ahead", "EventType": "Reboot", "EventStatus": "Scheduled",
         "NotBefore": "1970-01-01T00:16:40.25Z"},
        {"EventId": "behind", "EventType": "Freeze", "EventStatus": "Scheduled",
         "NotBefore": "Thu, 01 Jan 1970 00:00:10 GMT"}]})
    now = [0.0]
    metrics = Metrics(clock=lambda: now[0])
    # Every millisecond of a second (off the half-millisecond, where rounding a float's binary value may go
    # either way), and whole seconds on both sides of NotBefore.
    clocks = [500 + k / 1000 + 0.0002 for k in range(1000)] + [999.0, 1000.0, 1001.0, 1000.9998, 9.9998, 1000.3002,
                                                                  10.5002]
    for document, ahead in ((whole, 1000.0), (fractional, 1000.25)):
        metrics.views.document_seen(document, 1.0)
        for clock in clocks:
            now[0] = clock
            lines = {line.split('"', 2)[1]: line.rsplit(" ", 1)[1]
                     for line in metrics.render()[0].decode().splitlines() if line.startswith(name + "{")}
            assert lines == {"ahead": f"{ahead - clock:.3f}", "behind": f"{10 - clock:.3f}"}, clock


FEATURE_FAMILIES = {
    "approvals": ["azure_scheduled_events_approvals_total"],
    "policy_reload": ["azure_scheduled_events_policy_last_reload_successful",         # the per-VM agent's only
                      "azure_scheduled_events_policy_last_reload_success_timestamp_seconds"],
    "hooks": ["azure_scheduled_events_hook_runs_total"],
    "node_actions": ["azure_scheduled_events_node_actions_total", "azure_scheduled_events_node_drains_in_progress",
                     "azure_scheduled_events_node_drain_blocked_since_timestamp_seconds",
                     "azure_scheduled_events_node_drain_pods_total", "azure_scheduled_events_node_drain_reports_total"],
}


def family_names(text: str) -> set[str]:
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def test_families_of_features_that_are_off_are_absent_and_appear_with_the_feature() -> None:
    metrics = Metrics()
    every = {name for names in FEATURE_FAMILIES.values() for name in names}
    assert family_names(metrics.render()[0].decode()) & every == set()
    metrics.policy_loaded(hooks=False, node_actions=False)            # a policy without hooks or node actions
    shown = family_names(metrics.render()[0].decode())
    assert shown & every == {*FEATURE_FAMILIES["approvals"], *FEATURE_FAMILIES["policy_reload"]}
    assert len(series(scrape(metrics), "azure_scheduled_events_approvals_total")) == len(EVENT_TYPES) * 3
    metrics.policy_loaded(hooks=True, node_actions=True)              # a reload (SIGHUP) that adds both
    assert family_names(metrics.render()[0].decode()) & every == every
    metrics.policy_loaded(hooks=False, node_actions=False)            # turned on, they stay: counters never vanish
    assert family_names(metrics.render()[0].decode()) & every == every
    text = metrics.render(OPENMETRICS)[0].decode()   # OpenMetrics names a counter's family without _total
    assert {name.removesuffix("_total") for name in every} <= family_names(text) and text.count("# EOF") == 1
