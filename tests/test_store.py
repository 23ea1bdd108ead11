from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import pytest

from forewarn.imds.document import parse_document
from forewarn.imds.instance import VmInfo
from forewarn.outbox.store import DB_FILE, Store, StoreError
from forewarn.records import Record, to_record
from forewarn.tracker import diff_documents


def records(n: int, start: int = 0) -> list[Record]:
    out = []
    for i in range(start, start + n):
        document = parse_document({"DocumentIncarnation": i + 1, "Events": [
            {"EventId": f"E{i}", "EventType": "Reboot", "EventStatus": "Scheduled", "Resources": ["vm-0"]}]})
        (change,) = diff_documents(None, document)
        out.append(to_record(change, VmInfo(name="vm-0"), datetime.now(timezone.utc)))
    return out


DOC = parse_document({"DocumentIncarnation": 7, "Events": []})


def test_state_survives_reopening(tmp_path: Path) -> None:
    store = Store(tmp_path / DB_FILE, ["stdout"])
    store.commit(DOC, records(2))
    store.close()
    reopened = Store(tmp_path / DB_FILE, ["stdout"])
    loaded = reopened.load_document()
    assert loaded is not None and loaded.incarnation == 7
    assert [r.subject for _, r in reopened.fetch("stdout", 10)] == ["E0", "E1"]


def test_each_sink_has_its_own_cursor_and_acked_records_are_pruned(tmp_path: Path) -> None:
    store = Store(tmp_path / DB_FILE, ["fast", "slow"])
    store.commit(DOC, records(5))
    fast = store.fetch("fast", 10)
    store.ack("fast", fast[-1][0])
    assert store.fetch("fast", 10) == []
    assert store.backlog("fast").records == 0
    assert [r.subject for _, r in store.fetch("slow", 2)] == ["E0", "E1"]
    assert store.backlog("slow").records == 5
    slow = store.fetch("slow", 3)
    store.ack("slow", slow[-1][0])
    assert store.dump()[0][0][0] == slow[-1][0] + 1, "records every sink has are deleted"


def test_overflow_drops_the_oldest(tmp_path: Path) -> None:
    store = Store(tmp_path / DB_FILE, ["stdout"], max_records=3)
    assert store.commit(DOC, records(2)) == 0
    assert store.commit(DOC, records(3, start=2)) == 2
    assert [r.subject for _, r in store.fetch("stdout", 10)] == ["E2", "E3", "E4"]


def test_new_sink_gets_what_is_still_waiting_and_removed_sink_stops_holding_records(tmp_path: Path) -> None:
    store = Store(tmp_path / DB_FILE, ["a", "b"])
    store.commit(DOC, records(3))
    store.ack("a", store.fetch("a", 10)[-1][0])
    store.close()
    store = Store(tmp_path / DB_FILE, ["a", "c"])
    assert [r.subject for _, r in store.fetch("c", 10)] == ["E0", "E1", "E2"]
    store.ack("c", store.fetch("c", 10)[-1][0])
    assert store.dump()[0] == []


def test_outbox_moves_between_stores_with_cursors_intact(tmp_path: Path) -> None:
    disk = Store(tmp_path / DB_FILE, ["a", "b"])
    disk.commit(DOC, records(4))
    disk.ack("a", disk.fetch("a", 2)[-1][0])
    memory = Store(None, ["a", "b"])
    memory.adopt(*disk.dump(), DOC)
    assert [r.subject for _, r in memory.fetch("a", 10)] == ["E2", "E3"]
    assert [r.subject for _, r in memory.fetch("b", 10)] == ["E0", "E1", "E2", "E3"]
    memory.commit(DOC, records(1, start=4))
    assert memory.fetch("a", 10)[-1][1].subject == "E4"


@contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """Make `directory` unwritable for this process: mode bits, or for root (which ignores them) the
    immutable attribute."""
    if os.geteuid() != 0:
        directory.chmod(0o500)
        try:
            yield
        finally:
            directory.chmod(0o700)
        return
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(directory)],
                                                        capture_output=True).returncode != 0:
        pytest.skip("root ignores directory permissions and this filesystem has no immutable attribute")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=True)


def test_read_only_state_dir_is_a_store_error(tmp_path: Path) -> None:
    with read_only(tmp_path), pytest.raises(StoreError):
        Store(tmp_path / DB_FILE, ["stdout"])
    assert not (tmp_path / DB_FILE).exists()


def test_unwritable_database_is_a_store_error(tmp_path: Path) -> None:
    target = tmp_path / "not-a-dir"
    target.write_text("x")
    with pytest.raises(StoreError):
        Store(target / DB_FILE, ["stdout"])


def test_adopted_cursors_never_skip_new_records(tmp_path: Path) -> None:
    disk = Store(tmp_path / DB_FILE, ["a"])
    disk.commit(DOC, records(3))
    disk.ack("a", disk.fetch("a", 10)[-1][0])
    memory = Store(None, ["a"])
    memory.adopt(*disk.dump(), DOC)
    memory.commit(DOC, records(2, start=3))
    assert [r.subject for _, r in memory.fetch("a", 10)] == ["E3", "E4"]
    fresh = Store(tmp_path / "other.sqlite", ["a"])
    fresh.adopt(*memory.dump(), DOC)
    fresh.commit(DOC, records(1, start=5))
    assert [r.subject for _, r in fresh.fetch("a", 10)] == ["E3", "E4", "E5"]
