"""No record lost to the outbox's bound in fleet mode, end to end: `forewarn fleet` as its own process, Resource
Graph through the strict TLS stand-in, a file sink and a webhook sink whose endpoint refuses every post for a
while and then recovers, and an outbox bound well below the snapshot.

The issue's case is 200,000 VMs with a sink that refuses for a minute (bench/fleet_outbox.py runs it); here the
same mechanism at a size the test command can afford: 1,200 VMs (600 scale-set events of 2 VMs), a bound of 400
records, a sink down for 4 s. The snapshot cannot go in at once: the outbox refuses what does not fit, the rest
waits for the sinks, and every record reaches both sinks once, none dropped.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from fleet_samples import event_grid_event, properties, target_id
from forewarn.fleet.feed import FleetEvent, parse_resource_graph_row
from forewarn.fleet.metrics import FleetMetrics
from forewarn.fleet.scope import FleetScope, ScopeGate
from forewarn.fleet.service import FleetCommitter
from forewarn.fleet.state import PREFIX, load
from forewarn.fleet.tracker import FleetChange, event_key
from forewarn.outbox.outbox import Outbox, OutboxFull
from forewarn.poller import OutboxMetrics
from forewarn.records import Record
from test_fleet_queue import Azurite, count, require_azurite
from test_fleet_service import PUSH_SECRET, SUBS, Fleet, row

from conftest import wait_until
from peers.arm import ArmPeer
from peers.notify import NotifyPeer
from peers.pki import Authority

EVENTS = 600
VMS_PER_EVENT = 2
BOUND = 400
REFUSE_SECONDS = 4.0


def scale_set_row(n: int) -> dict[str, Any]:
    sub = SUBS[n % len(SUBS)]
    event_id = str(uuid.UUID(int=80_000 + n))
    target = target_id("vmss", f"ss-{n}", sub=sub, rg="rg-a")
    props = properties(event_id=event_id, resources=tuple(f"ss-{n}_{i}" for i in range(VMS_PER_EVENT)))
    return {"id": f"{target}/providers/Microsoft.Maintenance/scheduledevents/{event_id}", "name": event_id,
            "subscriptionId": sub, "resourceGroup": "rg-a", "location": "westeurope", "properties": props}


@pytest.fixture
def endpoint() -> Iterator[NotifyPeer]:
    """The CloudEvents webhook stand-in (tests/peers/notify.py), down (503 to every post) until a test says."""
    peer = NotifyPeer("cloudevents")
    peer.received.down = True
    yield peer
    peer.stop()


def sample(text: str, family: str) -> float:
    match = re.search(rf"^{family} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{family} not in /metrics"
    return float(match.group(1))


@pytest.mark.slow
def test_a_snapshot_larger_than_the_outbox_with_a_sink_down_reaches_every_sink_once(
        tmp_path: Path, endpoint: NotifyPeer) -> None:
    authority = Authority("fleet-outbox-test-ca")
    arm = ArmPeer(authority, rows=[scale_set_row(n) for n in range(EVENTS)])
    fleet = Fleet(tmp_path, arm, authority, None, None,
                  extra=("--sink", "webhook", "--outbox-max-records", str(BOUND)),
                  env={"FOREWARN_WEBHOOK_URL": endpoint.url})
    try:
        fleet.start()
        recovery = threading.Timer(REFUSE_SECONDS, lambda: setattr(endpoint.received, "down", False))
        recovery.start()
        expected = {(f"ss-{n}_{i}", str(uuid.UUID(int=80_000 + n))) for n in range(EVENTS)
                    for i in range(VMS_PER_EVENT)}
        # While the endpoint refuses, the outbox fills to its bound and stops there: the sinks hold back news.
        wait_until(lambda: sample(fleet.metrics() or "", "azure_scheduled_events_outbox_refused_commits_total") > 0,
                   timeout=REFUSE_SECONDS + 10, message="the full outbox to refuse a commit")
        assert endpoint.received.attempts and not endpoint.received.ids()
        assert len(fleet.records()) <= BOUND + 200  # nothing past the bound but a slice taken by an empty outbox
        wait_until(lambda: len(endpoint.received.ids()) >= len(expected), timeout=60,
                   message=f"every record at the webhook ({len(endpoint.received.ids())} of {len(expected)})")
        time.sleep(2)  # a repeat would come now
        metrics = fleet.metrics() or ""
        filed = fleet.records()
    finally:
        if fleet.proc is not None:
            fleet.stop()
        arm.stop()
    # (no check of _outbox_dropped_records_total: fleet mode's outbox refuses, it never drops; the records below
    # are what proves nothing was lost)
    assert sample(metrics, "azure_scheduled_events_outbox_capacity_records") == BOUND
    assert sample(metrics, "azure_scheduled_events_outbox_stored_records") == 0
    assert {(r["data"]["vm"]["name"], r["subject"]) for r in filed} == expected
    assert {r["data"]["change"] for r in filed} == {"added"}
    by_id = {r["id"]: r for r in filed}
    assert Counter(r["id"] for r in filed).most_common(1)[0][1] == 1 and len(by_id) == len(expected)
    accepted = endpoint.received.ids()
    assert Counter(accepted).most_common(1)[0][1] == 1  # no record twice at the webhook
    assert set(accepted) == set(by_id)                  # the same records, by id, at both sinks


def test_a_snapshot_the_full_outbox_cuts_short_keeps_what_fitted_ends_nothing_and_is_whole_after_the_next() -> None:
    """In process, through FleetCommitter: 250 events on single VMs against a bound of 150 records. The first
    slice of 100 fits, the second is refused: the first stands (saved, its records waiting), the rest is not
    open, and the snapshot does not count as complete. News that fits still goes in. Once the sink took the
    records the next snapshot brings exactly the rest, and every event has one record."""
    metrics = FleetMetrics(["resourcegraph"])
    outbox = Outbox(None, ["s"], max_records=150, observer=OutboxMetrics(metrics, metrics.outbox_refused),
                    overflow="refuse")
    # The refusal reloads the tracker, which restarts the term's count of complete snapshots at the clock's time
    # (0.5): the next snapshot, started at 1.0, counts.
    committer = FleetCommitter(outbox, metrics, clock=lambda: 0.5)
    events = [parse_resource_graph_row(row(SUBS[n % 3], n)) for n in range(250)]
    try:
        with pytest.raises(OutboxFull):
            committer.snapshot(events, started_at=0.0, complete=True)
        assert len(committer.view().open_events) == 100 and committer.complete_snapshots == 0
        assert committer.outbox.stored == 100
        # News that fits still goes in while the snapshot waits (a queue message, a push).
        assert len(committer.news([events[-1]])) == 1 and committer.outbox.stored == 101
        first = outbox.take("s", 1000)
        outbox.ack("s", first.last)
        changes = committer.snapshot(events, started_at=1.0, complete=True)
        assert len(changes) == 149 and committer.complete_snapshots == 1
        second = outbox.take("s", 1000)
        subjects = Counter(record.subject for record in [*first.records, *second.records])
        assert set(subjects) == {event.event_id for event in events} and set(subjects.values()) == {1}
        text = metrics.render()[0].decode()
        assert sample(text, "azure_scheduled_events_outbox_refused_commits_total") == 1
        assert sample(text, "azure_scheduled_events_outbox_stored_records") == 149
    finally:
        outbox.close()


def test_a_complete_snapshot_the_full_outbox_cuts_short_ends_no_event_that_was_missing_already() -> None:
    """Ten events open, missing from one complete snapshot already: one more complete snapshot that lacks them
    would end them. That snapshot (390 events against a bound of 150) is refused part way: it ends nothing (no
    listener call, no record), does not count as complete, and the tracker, the saved state and /metrics agree.
    Complete snapshots that go in whole end the ten later, each once, and every event has one `added` record."""
    metrics = FleetMetrics(["resourcegraph"])
    outbox = Outbox(None, ["s"], max_records=150, observer=OutboxMetrics(metrics, metrics.outbox_refused),
                    overflow="refuse")
    clock = [1000.0]
    committer = FleetCommitter(outbox, metrics, clock=lambda: clock[0])
    ended: list[FleetChange] = []
    committer.on_ended = ended.extend
    events = [parse_resource_graph_row(row(SUBS[n % 3], n)) for n in range(400)]
    old, rest = events[:10], events[10:]
    records: list[Record] = []

    def snapshot(listed: list[FleetEvent]) -> list[FleetChange]:
        clock[0] += 10   # started 5 s before the commit: news older than that counts missing
        return committer.snapshot(listed, started_at=clock[0] - 5, complete=True)

    def drain() -> None:
        batch = outbox.take("s", 100_000)
        if batch.last:
            outbox.ack("s", batch.last)
        records.extend(batch.records)

    try:
        snapshot(old)
        drain()
        snapshot(rest[:10])   # the ten old events missing once
        drain()
        assert committer.complete_snapshots == 2 and not ended
        with pytest.raises(OutboxFull):
            snapshot(rest)
        open_keys = {event_key(event) for event in committer.view().open_events}
        assert {event_key(event) for event in old} <= open_keys and not ended
        assert committer.complete_snapshots <= 2
        assert {event_key(event) for event in load(outbox.load_states(PREFIX), 0).open_events} == open_keys
        text = metrics.render()[0].decode()
        shown = set(re.findall(r'^azure_scheduled_event_info\{[^}]*event_id="([^"]+)"', text, re.MULTILINE))
        assert shown == {event_id for _, event_id in open_keys}
        drain()
        assert {record.data["change"] for record in records} == {"added"}
        completes = committer.complete_snapshots
        while committer.complete_snapshots < completes + 2:   # two complete snapshots that go in whole
            try:
                snapshot(rest)
            except OutboxFull:
                assert not ended, "a refused snapshot ended an event"
            drain()
        assert sorted(change.event.event_id for change in ended) == sorted(event.event_id for event in old)
        by_change = Counter((record.subject, record.data["change"]) for record in records)
        assert by_change == Counter({**{(event.event_id, "added"): 1 for event in events},
                                     **{(event.event_id, "removed"): 1 for event in old}})
        assert len({record.id for record in records}) == len(records)
    finally:
        outbox.close()


def test_counts_of_a_delivery_the_full_outbox_refuses_are_taken_once_it_is_committed() -> None:
    """A queue receive (through the scope gate, as QueueReader commits it) with an event already known and two
    outside the scope, whose commit the outbox refuses: neither count moves. Its retry, once the sinks made room,
    counts the repeat once and the two strangers once."""
    metrics = FleetMetrics(["resourcegraph", "queue"])
    outbox = Outbox(None, ["s"], max_records=150, observer=OutboxMetrics(metrics, metrics.outbox_refused),
                    overflow="refuse")
    committer = FleetCommitter(outbox, metrics)
    gate = ScopeGate(FleetScope.of(subscriptions=SUBS), metrics.left_out_of_scope)
    stranger = str(uuid.UUID(int=99))
    events = [parse_resource_graph_row(row(SUBS[n % 3], n)) for n in range(161)]
    receive = [events[0], *events[100:], *(parse_resource_graph_row(row(stranger, 500 + n)) for n in range(2))]

    def counts() -> tuple[float, float]:
        text = metrics.render()[0].decode()
        return (sample(text, "azure_scheduled_events_duplicates_total"),
                float(re.findall(r'^azure_scheduled_events_out_of_scope_total\{source="queue"\} (\S+)$', text,
                                 re.MULTILINE)[0]))

    try:
        committer.snapshot(events[:100], started_at=0.0, complete=True)   # 100 of 150 stored
        with pytest.raises(OutboxFull):   # 61 new records do not fit: refused by the append, nothing committed
            gate.admit(receive, "queue", committer.news)
        assert outbox.stored == 100 and counts() == (0, 0)
        batch = outbox.take("s", 1000)
        outbox.ack("s", batch.last)
        assert len(gate.admit(receive, "queue", committer.news)) == 61
        assert counts() == (1, 2)
    finally:
        outbox.close()


@pytest.fixture(scope="module")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    peer = Azurite(require_azurite(), tmp_path_factory.mktemp("azurite"))
    yield peer
    peer.stop()


def grid_on_scale_set(n: int, delivery: str) -> dict[str, Any]:
    sub = SUBS[n % len(SUBS)]
    props = properties(event_id=str(uuid.UUID(int=90_000 + n)), resources=tuple(f"qs-{n}_{i}" for i in range(10)))
    return event_grid_event(props, target_id("vmss", f"qs-{n}", sub=sub, rg="rg-a"), delivery)


@pytest.mark.slow
def test_queue_messages_and_pushes_the_full_outbox_refuses_come_back_and_reach_the_sinks_once(
        tmp_path: Path, endpoint: NotifyPeer, azurite: Azurite) -> None:
    """Queue and push, no Resource Graph: 60 queue messages of scale-set events (10 VMs each) against a bound
    of 100 records while the webhook refuses. The first receive fills the outbox; the next is refused and its
    messages stay in the queue; a push is answered 503 (Event Grid retries that). Once the webhook recovers the
    queue empties, the push's retry is taken, and each of the 610 records reaches both sinks once."""
    queue = azurite.queue()
    for n in range(60):
        queue.send_message(json.dumps(grid_on_scale_set(n, f"q-{n}")))
    fleet = Fleet(tmp_path, None, Authority("fleet-outbox-queue-ca"), azurite, queue.queue_name,
                  extra=("--sink", "webhook", "--outbox-max-records", "100", "--eventgrid-path", "/eventgrid"),
                  env={"FOREWARN_WEBHOOK_URL": endpoint.url, "FOREWARN_EVENTGRID_SECRET": PUSH_SECRET})
    push = [grid_on_scale_set(60, "p-60")]
    try:
        fleet.start()
        wait_until(lambda: sample(fleet.metrics() or "", "azure_scheduled_events_outbox_refused_commits_total") > 0,
                   timeout=30, message="the full outbox to refuse a receive")
        url = f"http://127.0.0.1:{fleet.port}/eventgrid"
        assert requests.post(url, params={"code": PUSH_SECRET}, json=push, timeout=10).status_code == 503
        assert count(queue) > 0 and not endpoint.received.ids()
        endpoint.received.down = False
        wait_until(lambda: count(queue) == 0 and len(endpoint.received.ids()) >= 600, timeout=60,
                   message=f"the queue empty and its records at the webhook ({len(endpoint.received.ids())} of 600)")
        assert requests.post(url, params={"code": PUSH_SECRET}, json=push, timeout=10).status_code == 200
        wait_until(lambda: len(endpoint.received.ids()) >= 610, timeout=30, message="the push's records at the webhook")
        time.sleep(2)  # a repeat would come now
        metrics = fleet.metrics() or ""
        filed = fleet.records()
    finally:
        if fleet.proc is not None:
            fleet.stop()
    assert sample(metrics, "azure_scheduled_events_outbox_stored_records") == 0   # every sink took every record
    expected = {(f"qs-{n}_{i}", str(uuid.UUID(int=90_000 + n))) for n in range(61) for i in range(10)}
    assert {(r["data"]["vm"]["name"], r["subject"]) for r in filed} == expected
    assert len(filed) == len({r["id"] for r in filed}) == len(expected)
    assert sorted(endpoint.received.ids()) == sorted(r["id"] for r in filed)
