"""The outbox's count without a scan: MAX(seq) - MIN(seq) + 1 equals COUNT(*) whatever happened before.

The count rests on one invariant: records are numbered one after another and deleted only from the low end
(acknowledged by every sink, or dropped as the oldest when full), and a move to another store (the fail-over to
memory and back) keeps the numbers without a gap. A state machine appends (each overflow mode), acknowledges,
carries the outbox between stores in any order (also the fail-over whose carry failed, after which memory's records
are added after the disk's), and after every step checks the
count against COUNT(*) and every sink's records against a plain model of what it still has to receive.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from forewarn.imds.document import parse_document
from forewarn.imds.instance import VmInfo
from forewarn.outbox.outbox import Outbox, OutboxFull, OutboxObserver
from forewarn.outbox.store import DB_FILE, ENDS_SQL, Overflow, Store
from forewarn.records import Record, to_record
from forewarn.tracker import diff_documents

SINKS = ("a", "b")
BOUND = 12

_pool: list[Record] = []


def record(i: int) -> Record:
    """A real record whose subject names `i` (built once per number: the parse costs more than the test)."""
    while len(_pool) <= i:
        n = len(_pool)
        document = parse_document({"DocumentIncarnation": 1, "Events": [
            {"EventId": f"E{n}", "EventType": "Reboot", "EventStatus": "Scheduled", "Resources": [f"vm-{n}"]}]})
        (change,) = diff_documents(None, document)
        _pool.append(to_record(change, VmInfo(name=f"vm-{n}"), datetime.now(timezone.utc)))
    return _pool[i]


def count_all(store: Store) -> int:
    with sqlite3.connect(store._uri, uri=True) as conn:
        return int(conn.execute("SELECT COUNT(*) FROM records").fetchone()[0])


class OutboxCount(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = Store(None, SINKS, max_records=BOUND)
        self.next = 0
        #: What each sink has still to receive, oldest first (record numbers): the model.
        self.pending: dict[str, list[int]] = {sink: [] for sink in SINKS}
        #: The disk store set aside by a fail-over that could not read it, and what each sink lacked on it.
        self.disk: Store | None = None
        self.disk_pending: dict[str, list[int]] = {}

    def teardown(self) -> None:
        self.store.close()
        if self.disk is not None:
            self.disk.close()

    def _held(self) -> list[int]:
        """The records the outbox holds: those some sink still needs (each list is a tail of the longest)."""
        return max(self.pending.values(), key=len)

    @rule(n=st.integers(0, 2 * BOUND), overflow=st.sampled_from(["drop", "refuse", "exceed"]))
    def append(self, n: int, overflow: Overflow) -> None:
        numbers = list(range(self.next, self.next + n))
        held = len(self._held())
        if overflow == "refuse" and n and held and held + n > BOUND:
            with pytest.raises(OutboxFull):
                self.store.commit(None, [record(i) for i in numbers], {"k": str(self.next)}, overflow)
            return  # nothing written
        self.next += n
        dropped, stored = self.store.commit(None, [record(i) for i in numbers], {"k": str(self.next)}, overflow)
        for sink in SINKS:
            self.pending[sink] += numbers
        excess = len(self._held()) - BOUND if overflow == "drop" else 0
        assert dropped == max(0, excess)
        if excess > 0:
            gone = set(self._held()[:excess])
            for sink in SINKS:
                self.pending[sink] = [i for i in self.pending[sink] if i not in gone]
        assert stored == len(self._held())

    @rule(sink=st.sampled_from(SINKS), k=st.integers(1, BOUND))
    def ack(self, sink: str, k: int) -> None:
        rows = self.store.fetch(sink, k)
        if not rows:
            return
        stored = self.store.ack(sink, rows[-1][0])
        self.pending[sink] = self.pending[sink][len(rows):]
        assert stored == len(self._held())

    @rule(numbered_before=st.integers(0, 3 * BOUND))
    def carry(self, numbered_before: int) -> None:
        """The fail-over: the outbox carried into a fresh store (sequence numbers and cursors as they were); the
        target may have numbered records of its own before (a disk store it comes back to)."""
        target = Store(None, SINKS, max_records=BOUND)
        if numbered_before:
            target.commit(None, [record(i) for i in range(numbered_before)], overflow="exceed")
        target.adopt(*self.store.dump(), None, self.store.states())
        self.store.close()
        self.store = target

    @precondition(lambda self: self.disk is None)
    @rule()
    def fail_over_unread(self) -> None:
        """The fail-over whose carry failed (the disk could not even be read): an empty store in memory takes the
        appends and acknowledgements, and the disk keeps its records and cursors as they were."""
        self.disk, self.disk_pending = self.store, self.pending
        self.store = Store(None, SINKS, max_records=BOUND)
        self.pending = {sink: [] for sink in SINKS}

    @precondition(lambda self: self.disk is not None)
    @rule()
    def recover_unread(self) -> None:
        """The disk works again: memory's records go after the disk's (Store.merge); each sink gets what it lacked
        on disk, then everything memory still held (what one sink took from memory is sent again: at least once)."""
        assert self.disk is not None
        held = self._held()
        rows, _ = self.store.dump()
        self.disk.merge(rows, None, self.store.states())
        self.store.close()
        self.store, self.disk = self.disk, None
        self.pending = {sink: self.disk_pending[sink] + held for sink in SINKS}

    @invariant()
    def count_is_exact(self) -> None:
        assert self.store.stored() == count_all(self.store) == len(self._held())

    @invariant()
    def each_sink_gets_what_it_lacks(self) -> None:
        for sink in SINKS:
            got = [row[1] for row in self.store.fetch(sink, 1_000_000)]
            assert got == [record(i).to_json() for i in self.pending[sink]]


def test_count_without_a_scan_equals_count_star_through_any_history() -> None:
    run_state_machine_as_test(OutboxCount, settings=settings(
        max_examples=100, stateful_step_count=20, deadline=None, suppress_health_check=list(HealthCheck)))


def test_count_reads_the_primary_key_index_not_the_table() -> None:
    store = Store(None, SINKS)
    try:
        with sqlite3.connect(store._uri, uri=True) as conn:
            plan = " | ".join(row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + ENDS_SQL))
    finally:
        store.close()
    assert "SCAN records" not in plan and plan.count("SEARCH records") == 2, plan


class Sizes(OutboxObserver):
    def __init__(self) -> None:
        self.stored: list[tuple[int, int]] = []
        self.refused = 0

    def stored_changed(self, stored: int, capacity: int) -> None:
        self.stored.append((stored, capacity))

    def commit_refused(self) -> None:
        self.refused += 1


def numbered(start: int, n: int) -> Sequence[Record]:
    return [record(i) for i in range(start, start + n)]


def test_a_refusing_outbox_writes_nothing_and_takes_the_commit_once_the_sinks_have_taken_records() -> None:
    told = Sizes()
    outbox = Outbox(None, ["s"], max_records=10, observer=told, overflow="refuse")
    try:
        assert told.stored == [(0, 10)]
        outbox.append(numbered(0, 8), state={"fleet:x": "1"})
        with pytest.raises(OutboxFull) as refused:
            outbox.append(numbered(8, 3), state={"fleet:x": "2"})
        assert (refused.value.stored, refused.value.adding, told.refused) == (8, 3, 1)
        assert outbox.load_state("fleet:x") == "1" and outbox.stored == 8
        # Records of actions already taken go over the bound rather than be refused or push others out.
        assert outbox.append(numbered(20, 3), overflow="exceed") == 0 and outbox.stored == 11
        assert not outbox.wait_for_room(5, timeout=0.05)
        outbox.ack("s", outbox.take("s", 6).last)
        assert outbox.wait_for_room(5, timeout=0.05) and told.stored[-1] == (5, 10)
        outbox.append(numbered(8, 3), state={"fleet:x": "2"})
        assert outbox.load_state("fleet:x") == "2"
        assert [r.subject for r in outbox.take("s", 100).records] == \
            [r.subject for r in [*numbered(6, 2), *numbered(20, 3), *numbered(8, 3)]]
    finally:
        outbox.close()


def test_an_empty_outbox_takes_a_commit_larger_than_its_bound_whole() -> None:
    """Refusing it would refuse it for ever: no sink can make more room than an empty outbox has."""
    outbox = Outbox(None, ["s"], max_records=4, overflow="refuse")
    try:
        outbox.append(numbered(0, 9))
        assert outbox.stored == 9
        with pytest.raises(OutboxFull):
            outbox.append(numbered(9, 1))
        assert outbox.append([], state={"fleet:y": "kept"}) == 0  # state alone always fits
        assert outbox.load_state("fleet:y") == "kept"
    finally:
        outbox.close()


def test_records_on_a_disk_that_could_not_be_read_at_the_fail_over_are_kept_when_it_recovers(tmp_path: Path) -> None:
    """The disk's database reads as malformed: the append moves to memory and cannot carry the disk's records
    over. Once the file reads again, its records stay and memory's are numbered after them, without a gap."""
    outbox = Outbox(tmp_path, ["s"], retry_seconds=3600)
    try:
        outbox.append(numbered(0, 5))
        db = tmp_path / DB_FILE
        with sqlite3.connect(db) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")   # every record in the main file
        good = db.read_bytes()
        db.write_bytes(good[:100] + b"\xff" * (len(good) - 100))   # the header kept, every page damaged
        outbox.append(numbered(5, 2))
        assert not outbox.writable and outbox.stored == 2
        db.write_bytes(good)
        assert outbox.recover() and outbox.writable
        assert [r.subject for r in outbox.take("s", 100).records] == [r.subject for r in numbered(0, 7)]
        assert outbox.stored == 7
        with sqlite3.connect(db) as conn:
            assert conn.execute("SELECT COUNT(*), MIN(seq), MAX(seq) FROM records").fetchone() == (7, 1, 7)
    finally:
        outbox.close()
