"""What a Resource Graph snapshot costs, as /metrics tells it: the read and the commit timed apart, through the
real client against the ARM stand-in over TLS (tests/peers/arm.py) and a real outbox on disk."""

from __future__ import annotations

import ssl
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import fleet_samples as samples
from forewarn.fleet.feed import parse_resource_graph_row
from forewarn.fleet.metrics import FleetMetrics
from forewarn.fleet.resourcegraph import ResourceGraphClient
from forewarn.fleet.service import FleetCommitter, ResourceGraphSource
from forewarn.outbox.outbox import Outbox
from forewarn.poller import OutboxMetrics
from forewarn.tracker import ChangeKind
from test_fleet_resourcegraph import TOKEN, FixedToken

from conftest import parse_metrics
from peers.arm import ArmPeer
from peers.pki import Authority

READ = "azure_scheduled_events_reconcile_duration_seconds"
COMMIT = "azure_scheduled_events_reconcile_commit_duration_seconds"


@contextmanager
def _reading(rows: list[dict[str, Any]], committer: FleetCommitter, metrics: FleetMetrics) -> Iterator[ArmPeer]:
    """A Resource Graph source reading `rows` from the ARM stand-in over TLS into `committer`, in a thread, until
    the block ends; then the source stops and the committer's outbox closes."""
    authority = Authority("reconcile-test-ca")
    arm = ArmPeer(authority, token=TOKEN, rows=rows)
    stop = threading.Event()
    client = ResourceGraphClient(arm.base, FixedToken(), timeout=5.0, stop=stop,
                                 context=ssl.create_default_context(cadata=authority.pem.decode()))
    source = ResourceGraphSource(client, [samples.SUB], [], 3600.0, committer, metrics)
    thread = threading.Thread(target=source.run, args=(stop,), daemon=True)
    try:
        thread.start()
        yield arm
    finally:
        stop.set()
        thread.join(10)
        client.close()
        committer.outbox.close()
        arm.stop()


def test_the_commit_of_a_snapshot_is_timed_beside_its_read(tmp_path: Path) -> None:
    # 8 rows, 2,000 records: a read of one page and a commit of 20 transactions, so the two differ
    rows = [samples.resource_graph_row(
        samples.properties(event_id=str(uuid.UUID(int=n + 1)), resources=[f"ss{n}_{k}" for k in range(250)]),
        samples.target_id("vmss", f"ss{n}")) for n in range(8)]
    metrics = FleetMetrics(["resourcegraph"])
    outbox = Outbox(tmp_path / "state", ["file"])
    with _reading(rows, FleetCommitter(outbox, metrics), metrics) as arm:
        deadline = time.monotonic() + 60
        while metrics.view.commit_seconds is None and time.monotonic() < deadline:
            time.sleep(0.002)  # the view, not a render: rendering 2,000 VMs' series takes longer than the commit
        seen = time.monotonic()
        with arm.received.lock:
            last_page = arm.received.times[-1]
    found = {name: value for (name, _), value in parse_metrics(metrics.render()[0].decode()).items()
             if name in (READ, COMMIT)}
    assert found == {READ: metrics.view.reconcile_seconds, COMMIT: metrics.view.commit_seconds}
    assert len(arm.received.times) == 1
    # The commit follows the last page: it fits between that page and the moment the view showed it, and is most
    # of that time (the rest is one page's answer and parse, and the poll), and longer than the read of 8 rows.
    after_read = seen - last_page
    assert 0.5 * after_read <= found[COMMIT] <= after_read
    assert found[COMMIT] > found[READ] > 0


def test_a_later_snapshot_holds_the_trackers_own_objects_for_what_did_not_change(tmp_path: Path) -> None:
    committer = FleetCommitter(Outbox(tmp_path / "state", ["file"]), FleetMetrics(["resourcegraph"]))
    rows = [samples.resource_graph_row(samples.properties(event_id=str(uuid.UUID(int=n + 1)), resources=[f"vm-{n}"]),
                                       samples.target_id("vm", f"vm-{n}")) for n in range(3)]
    first = [committer.known(parse_resource_graph_row(row)) for row in rows]
    assert len(committer.snapshot(first, 0.0, complete=True)) == 3
    rows[1]["properties"] = {**rows[1]["properties"], "EventStatus": "Started", "NotBefore": ""}
    second = [committer.known(parse_resource_graph_row(row)) for row in rows]
    assert second[0] is first[0] and second[2] is first[2] and second[1] is not first[1]
    (change,) = committer.snapshot(second, 1.0, complete=True)
    assert change.kind is ChangeKind.UPDATED and change.event is second[1] and change.previous is first[1]
    # an equal event from another feed is not the tracker's: its origin differs
    pushed = replace(first[0], origin="eventgrid")
    assert committer.known(pushed) is pushed
    committer.outbox.close()


def test_a_snapshot_the_full_outbox_cuts_short_is_timed_too(tmp_path: Path) -> None:
    # 250 events on single VMs against a bound of 150 records: the first slice of 100 goes in, the second is refused
    rows = [samples.resource_graph_row(samples.properties(event_id=str(uuid.UUID(int=n + 1)), resources=[f"vm-{n}"]),
                                       samples.target_id("vm", f"vm-{n}")) for n in range(250)]
    metrics = FleetMetrics(["resourcegraph"])
    outbox = Outbox(tmp_path / "state", ["file"], max_records=150, overflow="refuse",
                    observer=OutboxMetrics(metrics, metrics.outbox_refused))
    committer = FleetCommitter(outbox, metrics)
    with _reading(rows, committer, metrics):
        deadline = time.monotonic() + 20
        while metrics.view.commit_seconds is None and time.monotonic() < deadline:
            time.sleep(0.01)
        text = metrics.render()[0].decode()
    found = parse_metrics(text)
    assert found[("azure_scheduled_events_outbox_refused_commits_total", ())] == 1
    assert len(committer.view().open_events) == 100 and outbox.stored == 100   # cut short after one slice
    assert found[(COMMIT, ())] == metrics.view.commit_seconds and found[(COMMIT, ())] > 0
    assert found[(READ, ())] == metrics.view.reconcile_seconds
