"""The approver in-process: plain documents, a clock the test moves, and a Starter that records requests.

Decisions depend on time (delay, stagger, approve_within, windows, the re-check after an approval), so
the approver reads a fake clock. Its slow work (hooks, the start request) runs on its pool, and `settle`
waits (`Approver.idle`) for everything handed to it so far, so "nothing was sent" is checked after the
work had every chance to happen, not after a sleep. One test drives the real IMDS POST (`ImdsStarter`)
against the simulator.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from forewarn.approval.approver import CONFIRM_AFTER, STAGES, Approver, Stage, Track
from forewarn.approval.policy import parse_policy
from forewarn.approval.starter import ImdsStarter, Starter, StartError
from forewarn.imds.client import ImdsClient
from forewarn.imds.document import Document, format_not_before, parse_document
from forewarn.imds.instance import VmInfo
from forewarn.metrics import Metrics
from forewarn.records import Record
from forewarn.tracker import Tracker

from conftest import SimulatorHandle, parse_metrics, sample, wait_until

VM = VmInfo(name="vm-0", vm_id="0000-vm-0")
#: Wednesday 2024-01-10 12:00:00 UTC: inside a 09:00-17:00 weekday window.
NOON = datetime(2024, 1, 10, 12, 0, tzinfo=timezone.utc).timestamp()


class Clock:
    def __init__(self, now: float = NOON) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Starts:
    """Stands in for the Starter (IMDS's POST): records each request; `fail` makes the next ones fail."""

    def __init__(self) -> None:
        self.posts: list[list[str]] = []
        self.fail = 0

    def start(self, event_ids: Sequence[str]) -> None:
        if self.fail:
            self.fail -= 1
            raise StartError("IMDS answered 500")
        self.posts.append(list(event_ids))


class SlowStarts(Starts):
    """A Starter that answers only once `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def start(self, event_ids: Sequence[str]) -> None:
        self.release.wait(30)
        super().start(event_ids)


def event(event_id: str = "E1", *, status: str = "Scheduled", not_before: float | None = NOON + 900,
          event_type: str = "Reboot", source: str = "Platform", resources: Sequence[str] = ("vm-0",)) -> dict[str, Any]:
    return {"EventId": event_id, "EventType": event_type, "ResourceType": "VirtualMachine",
            "Resources": list(resources), "EventStatus": status, "EventSource": source, "DurationInSeconds": -1,
            "Description": "", "NotBefore": format_not_before(datetime.fromtimestamp(not_before, tz=timezone.utc))
            if not_before is not None else ""}


class Harness:
    """An approver fed documents the way the collector feeds it, with everything it does recorded."""

    def __init__(self, policy: str, starter: Starter | None = None, dry_run: bool = False, vm: VmInfo = VM,
                 spool: Callable[[], None] = lambda: None) -> None:
        self.clock = Clock()
        self.starter = starter if starter is not None else Starts()
        self.spooling = spool  # runs in each call that hands the approver's records to the outbox
        self.metrics = Metrics()
        self.records: list[dict[str, Any]] = []  # as the sinks would write them
        self.vm = vm
        self.tracker = Tracker()
        self.incarnation = 0
        self.approver = Approver(parse_policy(policy), self.starter, self.metrics, self._spool,
                                 dry_run=dry_run, clock=self.clock, workers=1)

    def _spool(self, records: Sequence[Record]) -> None:
        self.spooling()
        self.records.extend(record.to_dict() for record in records)

    def poll(self, *events: dict[str, Any]) -> Document:
        """Hand the approver a document (a new incarnation whenever its events differ)."""
        current = self.tracker.current
        if current is None or [dict(e.raw) for e in current.events] != list(events):
            self.incarnation += 1
        document = parse_document({"DocumentIncarnation": self.incarnation, "Events": list(events)})
        self.approver.on_changes(document, self.tracker.apply(document), self.vm)
        return document

    def settle(self) -> None:
        """Wait for every hook and start request handed to the approver so far."""
        assert self.approver.idle(timeout=30), "the approver's work did not finish within 30 s"

    def posts(self) -> list[list[str]]:
        self.settle()
        assert isinstance(self.starter, Starts)
        return list(self.starter.posts)

    def approved(self) -> list[tuple[str, str, bool]]:
        self.settle()
        return [(r["subject"], r["data"]["policy_rule"], r["data"]["dry_run"]) for r in self.records
                if r["data"]["change"] == "approved"]

    def counter(self, name: str, **labels: str) -> float | None:
        return sample(parse_metrics(self.metrics.render()[0].decode()), name, **labels)

    def approvals(self, result: str, event_type: str = "Reboot") -> float | None:
        return self.counter("azure_scheduled_events_approvals_total", event_type=event_type, result=result)

    def hook_runs(self, result: str, hook: str = "prepare") -> float | None:
        return self.counter("azure_scheduled_events_hook_runs_total", hook=hook, result=result)


@pytest.fixture
def harnesses() -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def make(*args: Any, **kwargs: Any) -> Harness:
        made.append(Harness(*args, **kwargs))
        return made[-1]

    yield make
    for harness in made:
        harness.approver.close()


APPROVE_REBOOTS = "rules: [{name: reboots, match: {event_type: [Reboot]}, action: approve}]\n"


def test_a_matching_event_is_approved_once_recorded_and_counted(harnesses: Callable[..., Harness]) -> None:
    h = harnesses(APPROVE_REBOOTS)
    h.poll(event("E1"))
    assert h.posts() == [["E1"]]
    assert h.approved() == [("E1", "reboots", False)]
    assert h.approvals("approved") == 1
    (record,) = h.records
    assert record["data"]["event"]["EventId"] == "E1" and record["data"]["vm"]["name"] == "vm-0"
    h.clock.advance(5)
    h.poll(event("E1"))
    assert h.posts() == [["E1"]], "not sent again while the approval is fresh"
    h.poll(event("E1", status="Started"))
    h.clock.advance(3600)
    h.poll(event("E1", status="Started"))
    assert h.posts() == [["E1"]] and len(h.records) == 1 and h.approvals("approved") == 1


@pytest.mark.parametrize("policy", [
    "rules: [{name: freezes, match: {event_type: [Freeze]}, action: approve}]\n",
    "rules: [{name: nothing-now, match: {event_type: [Reboot]}, action: hold},"
    " {name: reboots, match: {event_type: [Reboot]}, action: approve}]\n",
    "rules: [{name: others, match: {affects_this_vm: false}, action: approve}]\n",
], ids=["no-rule-matches", "hold-rule-first", "other-vms-only"])
def test_no_match_or_a_hold_is_never_approved(policy: str, harnesses: Callable[..., Harness]) -> None:
    h = harnesses(policy)
    for _ in range(5):
        h.poll(event("E1"))
        h.clock.advance(3600)
    assert h.posts() == [] and h.approved() == []
    assert not h.approvals("approved") and not h.approvals("dry_run")


def test_an_event_for_another_vm_is_not_approved_even_when_a_rule_matches(
        harnesses: Callable[..., Harness]) -> None:
    h = harnesses(APPROVE_REBOOTS)
    h.poll(event("E1", resources=["vm-7"]))
    h.clock.advance(3600)
    h.poll(event("E1", resources=["vm-7"]))
    assert h.posts() == []


def test_delay_counts_from_when_the_event_was_first_seen(harnesses: Callable[..., Harness]) -> None:
    h = harnesses("rules: [{name: later, match: {event_type: [Reboot]}, action: approve, delay: 60}]\n")
    h.poll(event("E1"))
    h.clock.advance(59.9)
    h.poll(event("E1"))
    assert h.posts() == []
    h.clock.advance(0.1)
    h.poll(event("E1"))
    assert h.posts() == [["E1"]]
    assert h.approved() == [("E1", "later", False)]


def test_approve_within_waits_until_that_long_before_not_before(harnesses: Callable[..., Harness]) -> None:
    h = harnesses("rules: [{name: close, match: {event_type: [Reboot]}, action: approve, approve_within: 300}]\n")
    h.poll(event("E1", not_before=NOON + 900))
    h.clock.advance(599)
    h.poll(event("E1", not_before=NOON + 900))
    assert h.posts() == []
    h.clock.advance(1)
    h.poll(event("E1", not_before=NOON + 900))
    assert h.posts() == [["E1"]]


STAGGERED = ("leader: {mode: staggered, stagger: 30}\n"
             "rules: [{name: reboots, match: {event_type: [Reboot]}, action: approve}]\n")


def test_stagger_lets_a_later_vm_approve_only_after_its_turn(harnesses: Callable[..., Harness]) -> None:
    second = harnesses(STAGGERED)  # vm-0, listed second: its turn comes 30 s after it saw the event
    listed = event("E1", resources=["vm-1", "vm-0"])
    second.poll(listed)
    second.clock.advance(29)
    second.poll(listed)
    assert second.posts() == []
    second.clock.advance(1)
    second.poll(listed)
    assert second.posts() == [["E1"]]
    first = harnesses(STAGGERED, vm=VmInfo(name="vm-1"))
    first.poll(listed)
    assert first.posts() == [["E1"]], "the first VM listed approves at once"


def test_leader_mode_first_never_lets_a_later_vm_approve(harnesses: Callable[..., Harness]) -> None:
    h = harnesses("leader: {mode: first}\nrules: [{name: reboots, match: {event_type: [Reboot]}, action: approve}]\n")
    listed = event("E1", resources=["vm-1", "vm-0"])
    for _ in range(3):
        h.poll(listed)
        h.clock.advance(3600)
    assert h.posts() == []


def hook_policy(tmp_path: Path, exit_code: int, on_failure: str = "hold", extra: str = "") -> tuple[str, Path]:
    """A rule with one real prepare command, which appends its event id to a file and exits `exit_code`."""
    ran = tmp_path / "ran.txt"
    script = (f"import os, sys; open({str(ran)!r}, 'a').write(os.environ['FOREWARN_EVENT_ID'] + '\\n'); "
              f"sys.exit({exit_code})")
    command = json.dumps([sys.executable, "-c", script])
    return (f"{extra}rules:\n  - name: drain\n    match: {{event_type: [Reboot]}}\n    action: approve\n"
            f"    prepare: [{{name: drain, command: {command}, timeout: 20}}]\n"
            f"    on_hook_failure: {on_failure}\n"), ran


def test_prepare_hook_runs_before_the_approval(tmp_path: Path, harnesses: Callable[..., Harness]) -> None:
    policy, ran = hook_policy(tmp_path, 0)
    h = harnesses(policy)
    h.poll(event("E1"))  # starts the hook; the approval waits for its result
    assert h.posts() == [] and ran.read_text() == "E1\n"
    assert h.hook_runs("success") == 1 and h.approver.stage("E1") is Stage.PREPARED
    h.poll(event("E1"))
    assert h.posts() == [["E1"]]
    assert h.approved() == [("E1", "drain", False)]
    h.poll(event("E1"))
    assert ran.read_text() == "E1\n", "the hook ran once"


def test_failed_prepare_hook_holds_by_default_and_runs_once(tmp_path: Path,
                                                           harnesses: Callable[..., Harness]) -> None:
    policy, ran = hook_policy(tmp_path, 3)
    h = harnesses(policy)
    for _ in range(4):
        h.poll(event("E1"))
        h.settle()
        h.clock.advance(60)
    assert h.posts() == [] and h.approved() == []
    assert h.hook_runs("failure") == 1 and ran.read_text() == "E1\n"
    assert h.approver.stage("E1") is Stage.HOOK_FAILED


def test_failed_prepare_hook_may_be_set_to_approve_anyway(tmp_path: Path,
                                                         harnesses: Callable[..., Harness]) -> None:
    policy, _ = hook_policy(tmp_path, 3, on_failure="approve")
    h = harnesses(policy)
    h.poll(event("E1"))
    h.settle()
    h.poll(event("E1"))
    assert h.posts() == [["E1"]] and h.hook_runs("failure") == 1


@pytest.mark.parametrize("after_hooks", ["started", "gone", "other-vm"])
def test_the_decision_is_made_again_after_the_hooks(after_hooks: str, tmp_path: Path,
                                                    harnesses: Callable[..., Harness]) -> None:
    """While the hook ran, the event moved on: the poll after it decides on the event as it is now."""
    policy, ran = hook_policy(tmp_path, 0)
    h = harnesses(policy)
    h.poll(event("E1"))
    h.settle()
    assert ran.read_text() == "E1\n" and h.hook_runs("success") == 1
    now = {"started": [event("E1", status="Started")], "gone": [],
           "other-vm": [event("E1", resources=["vm-7"])]}[after_hooks]
    h.poll(*now)
    h.clock.advance(60)
    h.poll(*now)
    assert h.posts() == [] and h.approved() == []


def test_a_maintenance_window_that_closed_while_the_hook_ran_holds_the_approval(
        tmp_path: Path, harnesses: Callable[..., Harness]) -> None:
    policy, _ = hook_policy(tmp_path, 0, extra="maintenance_windows: [{start: '09:00', end: '12:01'}]\n")
    h = harnesses(policy)
    h.poll(event("E1", not_before=NOON + 86400))
    h.settle()
    h.clock.advance(120)  # 12:02, the window has closed
    h.poll(event("E1", not_before=NOON + 86400))
    assert h.posts() == []
    h.clock.advance(21 * 3600 - 60)  # 09:01 the next day
    h.poll(event("E1", not_before=NOON + 86400))
    assert h.posts() == [["E1"]]


def test_an_approved_event_still_scheduled_is_asked_for_again(harnesses: Callable[..., Harness]) -> None:
    h = harnesses(APPROVE_REBOOTS)
    h.poll(event("E1"))
    assert h.posts() == [["E1"]]
    h.clock.advance(CONFIRM_AFTER - 1)
    h.poll(event("E1"))
    assert h.posts() == [["E1"]]
    h.clock.advance(1)
    h.poll(event("E1"))
    assert h.posts() == [["E1"], ["E1"]]
    assert h.approved() == [("E1", "reboots", False)], "asking again is not a second approval"
    assert h.approvals("approved") == 1
    h.clock.advance(CONFIRM_AFTER)
    h.poll(event("E1", status="Started"))
    h.clock.advance(CONFIRM_AFTER)
    h.poll(event("E1", status="Started"))
    assert len(h.posts()) == 2, "a Started event is not asked for again"


def test_no_second_request_once_not_before_has_passed(harnesses: Callable[..., Harness]) -> None:
    h = harnesses(APPROVE_REBOOTS)
    h.poll(event("E1", not_before=NOON + 20))
    assert h.posts() == [["E1"]]
    h.clock.advance(CONFIRM_AFTER * 3)
    h.poll(event("E1", not_before=NOON + 20))
    assert h.posts() == [["E1"]], "past NotBefore Azure starts it anyway"


def test_a_failed_post_is_counted_and_retried_after_a_backoff(harnesses: Callable[..., Harness]) -> None:
    h = harnesses(APPROVE_REBOOTS)
    assert isinstance(h.starter, Starts)
    h.starter.fail = 1
    h.poll(event("E1"))
    h.settle()
    assert h.approvals("failed") == 1 and h.approved() == []
    assert h.approver.stage("E1") is Stage.START_FAILED
    h.poll(event("E1"))
    assert h.posts() == [], "not at once: the retry waits for its backoff"
    h.clock.advance(2.0)  # the first retry waits between 1 and 2 s
    h.poll(event("E1"))
    assert h.posts() == [["E1"]] and h.approved() == [("E1", "reboots", False)]


def test_dry_run_records_once_and_sends_nothing(harnesses: Callable[..., Harness]) -> None:
    for h in (harnesses(APPROVE_REBOOTS, dry_run=True), harnesses("dry_run: true\n" + APPROVE_REBOOTS)):
        for _ in range(3):
            h.poll(event("E1"))
            h.clock.advance(CONFIRM_AFTER)
        assert h.posts() == []
        assert h.approved() == [("E1", "reboots", True)] and h.approver.stage("E1") is Stage.DECIDED
        assert h.approvals("dry_run") == 1 and not h.approvals("approved")


def test_the_hourly_cap_holds_what_exceeds_it(harnesses: Callable[..., Harness]) -> None:
    h = harnesses("max_approvals_per_hour: 1\n" + APPROVE_REBOOTS)
    second = event("E2", not_before=NOON + 7200)
    h.poll(event("E1"), second)
    assert h.posts() == [["E1"]]
    h.clock.advance(60)
    h.poll(event("E1", status="Started"), second)
    assert h.posts() == [["E1"]], "E2 waits for room under the cap"
    h.clock.advance(3600)
    h.poll(event("E1", status="Started"), second)
    assert h.posts() == [["E1"], ["E2"]]


def test_recover_hook_runs_when_an_event_of_this_vm_completed(tmp_path: Path,
                                                             harnesses: Callable[..., Harness]) -> None:
    ran = tmp_path / "recovered.txt"
    script = f"import os; open({str(ran)!r}, 'a').write(os.environ['FOREWARN_HOOK'])"
    h = harnesses(f"hooks: {{recover: [{{command: {json.dumps([sys.executable, '-c', script])}}}]}}\n"
                  + APPROVE_REBOOTS)
    h.poll(event("E1", status="Started"))
    h.poll()  # gone after Started: it ran
    h.poll(event("E2"))
    h.poll()  # gone while Scheduled: cancelled, nothing to recover from
    h.settle()
    assert ran.read_text() == "recover"
    assert h.hook_runs("success", hook="recover") == 1


def test_the_post_reaches_imds_over_http_and_starts_the_event(simulator: Callable[..., SimulatorHandle],
                                                             harnesses: Callable[..., Harness]) -> None:
    sim = simulator({"events": [{"at": 0, "type": "Reboot", "notice": 900, "id": "E1"}]})
    client = ImdsClient(sim.url)
    try:
        h = harnesses(APPROVE_REBOOTS, starter=ImdsStarter(client))
        document = wait_until(lambda: (d := client.get_scheduled_events()).events and d, timeout=5)
        h.approver.on_changes(document, h.tracker.apply(document), VM)
        wait_until(lambda: sim.sim.approval_posts, timeout=10, message="the StartRequests POST")
        assert [post["event_ids"] for post in sim.sim.approval_posts] == [["E1"]]
        assert h.approved() == [("E1", "reboots", False)] and h.approver.stage("E1") is Stage.APPROVED
        started = wait_until(lambda: (d := client.get_scheduled_events()).events[0].status == "Started" and d,
                             timeout=10, message="the event started")
        h.approver.on_changes(started, h.tracker.apply(started), VM)
        h.settle()
        assert [post["event_ids"] for post in sim.sim.approval_posts] == [["E1"]]
    finally:
        client.close()


def test_on_changes_never_waits_for_the_post(harnesses: Callable[..., Harness]) -> None:
    starter = SlowStarts()
    h = harnesses(APPROVE_REBOOTS, starter=starter)
    h.poll(event("E1"))
    h.poll(event("E1"))  # returns although the request is still under way, and does not send a second one
    assert starter.posts == [] and h.approver.stage("E1") is Stage.STARTING
    starter.release.set()
    assert h.posts() == [["E1"]] and h.approver.stage("E1") is Stage.APPROVED


def test_polls_while_the_request_is_under_way_do_not_use_up_the_hourly_cap(
        harnesses: Callable[..., Harness]) -> None:
    starter = SlowStarts()
    h = harnesses("max_approvals_per_hour: 2\n" + APPROVE_REBOOTS, starter=starter)
    for _ in range(3):
        h.poll(event("E1"))  # one request under way: polls meanwhile send nothing and count nothing
    starter.release.set()
    assert h.posts() == [["E1"]]
    h.poll(event("E1", status="Started"), event("E2"))
    assert h.posts() == [["E1"], ["E2"]], "one approval so far: the cap of 2 leaves room for E2"


def test_a_reload_into_dry_run_stops_asking_again(harnesses: Callable[..., Harness]) -> None:
    h = harnesses(APPROVE_REBOOTS)
    h.poll(event("E1"), event("E2"))
    assert h.posts() == [["E1", "E2"]]
    h.approver.replace_policy(parse_policy(APPROVE_REBOOTS), dry_run=True)
    h.clock.advance(CONFIRM_AFTER)
    h.poll(event("E1"), event("E2"), event("E3"))
    assert h.posts() == [["E1", "E2"]], "a dry run sends nothing, not even the re-check of an approval"
    assert h.approved() == [("E1", "reboots", False), ("E2", "reboots", False), ("E3", "reboots", True)]


def test_a_slow_outbox_never_holds_up_the_next_poll(harnesses: Callable[..., Harness]) -> None:
    """Records are handed to the outbox outside the approver's lock: a disk that takes its time to write
    the `approved` record must not stall the poll loop, which calls the approver after every poll."""
    spooling, release = threading.Event(), threading.Event()
    h = harnesses(APPROVE_REBOOTS, spool=lambda: (spooling.set(), release.wait(30)))
    h.poll(event("E1"))
    wait_until(spooling.is_set, timeout=10, message="the approved record on its way to the outbox")
    polled = threading.Thread(target=h.poll, args=(event("E1"),))
    polled.start()
    try:
        wait_until(lambda: not polled.is_alive(), timeout=5, message="the poll during a slow spool returned")
    finally:
        release.set()
        polled.join(10)
    assert h.approved() == [("E1", "reboots", False)]


def test_a_stage_takes_only_the_steps_the_table_lists() -> None:
    track = Track(first_seen=NOON)
    with pytest.raises(AssertionError, match="waiting cannot become approved"):
        track.move(Stage.APPROVED)
    for step in (Stage.PREPARING, Stage.PREPARED, Stage.STARTING, Stage.START_FAILED, Stage.STARTING,
                 Stage.APPROVED):
        track.move(step)
    assert track.stage is Stage.APPROVED and STAGES[Stage.APPROVED] == frozenset()
