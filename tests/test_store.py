"""The outbox through its interface: append, take, ack, backlog, wait, and its fail-over to memory and back."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import pytest

from forewarn.imds.document import parse_document
from forewarn.imds.instance import VmInfo
from forewarn.outbox.outbox import Outbox, OutboxObserver, StoreError
from forewarn.outbox.store import DB_FILE
from forewarn.records import Record, to_record
from forewarn.tracker import diff_documents

from conftest import wait_until


def records(n: int, start: int = 0) -> list[Record]:
    out = []
    for i in range(start, start + n):
        document = parse_document({"DocumentIncarnation": i + 1, "Events": [
            {"EventId": f"E{i}", "EventType": "Reboot", "EventStatus": "Scheduled", "Resources": ["vm-0"]}]})
        (change,) = diff_documents(None, document)
        out.append(to_record(change, VmInfo(name="vm-0"), datetime.now(timezone.utc)))
    return out


DOC = parse_document({"DocumentIncarnation": 7, "Events": []})


class Told(OutboxObserver):
    """Remembers what the outbox reported (the agent turns the same calls into metrics)."""

    def __init__(self) -> None:
        self.dropped: list[int] = []
        self.writable: list[bool] = []

    def records_dropped(self, count: int) -> None:
        self.dropped.append(count)

    def writable_changed(self, writable: bool) -> None:
        self.writable.append(writable)


def subjects(outbox: Outbox, sink: str) -> list[str]:
    return [record.subject for record in outbox.take(sink, 100).records]


def ack_through(outbox: Outbox, sink: str, count: int) -> None:
    """Acknowledge the first `count` records waiting for `sink`."""
    outbox.ack(sink, outbox.take(sink, count).last)


def test_state_and_records_survive_reopening(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path, ["stdout"])
    assert outbox.writable and outbox.load_document() is None
    outbox.append(records(2), DOC)
    outbox.close()
    reopened = Outbox(tmp_path, ["stdout"])
    loaded = reopened.load_document()
    assert loaded is not None and loaded.incarnation == 7
    assert subjects(reopened, "stdout") == ["E0", "E1"]
    reopened.close()
    with pytest.raises(StoreError):
        reopened.append(records(1))


def test_each_sink_has_its_own_cursor_and_what_every_sink_has_is_deleted(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path, ["fast", "slow"])
    outbox.append(records(5), DOC)
    ack_through(outbox, "fast", 10)
    assert subjects(outbox, "fast") == [] and outbox.backlog("fast").records == 0
    assert [record.subject for record in outbox.take("slow", 2).records] == ["E0", "E1"]
    backlog = outbox.backlog("slow")
    assert backlog.records == 5 and backlog.oldest_created is not None
    ack_through(outbox, "slow", 3)
    outbox.close()
    # A sink seen for the first time starts at the oldest record still waiting: E0-E2 are gone.
    reopened = Outbox(tmp_path, ["fast", "slow", "new"])
    assert subjects(reopened, "new") == ["E3", "E4"]
    reopened.close()


def test_overflow_drops_the_oldest_and_says_so(tmp_path: Path) -> None:
    told = Told()
    outbox = Outbox(tmp_path, ["stdout"], max_records=3, observer=told)
    assert outbox.append(records(2), DOC) == 0
    assert outbox.append(records(3, start=2), DOC) == 2
    assert subjects(outbox, "stdout") == ["E2", "E3", "E4"]
    assert told.dropped == [2]
    outbox.close()


def test_new_sink_gets_what_is_still_waiting_and_removed_sink_stops_holding_records(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path, ["a", "b"])
    outbox.append(records(3), DOC)
    ack_through(outbox, "a", 10)
    outbox.close()
    outbox = Outbox(tmp_path, ["a", "c"])
    assert subjects(outbox, "c") == ["E0", "E1", "E2"]
    ack_through(outbox, "c", 10)
    outbox.close()
    # Had "b" still held them, a sink added now would start at E0.
    outbox = Outbox(tmp_path, ["a", "c", "d"])
    assert subjects(outbox, "d") == []
    outbox.close()


def test_wait_ends_when_records_are_appended(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path, ["a"])
    assert not outbox.wait("a", 0.01), "nothing appended: the wait times out"
    appender = threading.Thread(target=outbox.append, args=(records(1),))
    appender.start()
    assert outbox.wait("a", 5)
    appender.join()
    assert subjects(outbox, "a") == ["E0"]
    outbox.wake("a")
    assert outbox.wait("a", 5), "wake ends a wait too (a worker that is stopping)"
    outbox.close()


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


def test_read_only_state_dir_holds_records_in_memory_until_it_is_writable(tmp_path: Path) -> None:
    told = Told()
    with read_only(tmp_path):
        outbox = Outbox(tmp_path, ["stdout"], observer=told)
        assert not outbox.writable
        outbox.append(records(2), DOC)
        assert subjects(outbox, "stdout") == ["E0", "E1"]
        assert not outbox.recover()
    assert not (tmp_path / DB_FILE).exists()
    assert outbox.recover() and outbox.writable and told.writable == [True]
    outbox.close()
    reopened = Outbox(tmp_path, ["stdout"])
    assert subjects(reopened, "stdout") == ["E0", "E1"], "carried to disk"
    document = reopened.load_document()
    assert document is not None and document.incarnation == 7
    reopened.close()


def test_records_carried_to_disk_keep_their_cursors_and_new_ones_are_never_skipped(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    outbox = Outbox(blocker / "state", ["a", "b"])
    assert not outbox.writable
    outbox.append(records(3), DOC)
    ack_through(outbox, "a", 1)
    blocker.unlink()
    assert outbox.recover()
    outbox.append(records(1, start=3), DOC)
    assert subjects(outbox, "a") == ["E1", "E2", "E3"]
    assert subjects(outbox, "b") == ["E0", "E1", "E2", "E3"]
    ack_through(outbox, "a", 3)
    outbox.close()
    reopened = Outbox(blocker / "state", ["a", "b"])
    assert subjects(reopened, "a") == [] and len(subjects(reopened, "b")) == 4
    reopened.close()


def test_unusable_state_dir_is_retried_on_its_own(tmp_path: Path) -> None:
    told = Told()
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    outbox = Outbox(blocker / "state", ["a"], observer=told, retry_seconds=0.02)
    outbox.append(records(1), DOC)
    assert not outbox.writable
    blocker.unlink()
    wait_until(lambda: outbox.writable, timeout=5, message="the retry to find the state dir usable")
    assert told.writable == [True]
    assert (blocker / "state" / DB_FILE).exists() and subjects(outbox, "a") == ["E0"]
    outbox.close()


CLOSE_WHILE_READING = """
import threading
from forewarn.outbox.outbox import Outbox, StoreError

for _ in range(50):
    outbox = Outbox(None, ["a"])
    reading = threading.Barrier(5)
    ended = []

    def read() -> None:
        reading.wait()
        try:
            while True:
                outbox.backlog("a")
                outbox.take("a", 10)
        except StoreError as exc:
            ended.append(exc)

    readers = [threading.Thread(target=read) for _ in range(4)]
    for reader in readers:
        reader.start()
    reading.wait()
    outbox.close()
    for reader in readers:
        reader.join(5)
    assert len(ended) == 4, ended
print("ok")
"""


def test_closing_while_workers_read_ends_their_reads_with_store_error() -> None:
    # A delivery worker left behind a hung sink may still read when the agent closes the outbox at stop,
    # and a move between stores closes the old one under the workers: that must never crash the process.
    result = subprocess.run([sys.executable, "-c", CLOSE_WHILE_READING], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr[-2000:]


def test_a_named_state_is_saved_with_its_records_and_survives_memory_and_restarts(tmp_path: Path) -> None:
    """Fleet mode saves its tracker as a named state, in the records' transaction, beside (never over) the
    IMDS document; a move to memory and back carries it."""
    with read_only(tmp_path):
        outbox = Outbox(tmp_path, ["stdout"])
        outbox.append(records(1), DOC, state={"fleet": '{"open": 1}'})
        assert outbox.load_state("fleet") == '{"open": 1}' and outbox.load_state("other") is None
    assert outbox.recover()
    outbox.append(records(1, start=1), state={"fleet": '{"open": 2}'})
    outbox.close()
    reopened = Outbox(tmp_path, ["stdout"])
    assert reopened.load_state("fleet") == '{"open": 2}'
    document = reopened.load_document()
    assert document is not None and document.incarnation == 7   # the document's own key is untouched
    with pytest.raises(ValueError, match="document"):
        reopened.append(records(1, start=2), state={"document": "{}"})
    assert subjects(reopened, "stdout") == ["E0", "E1"]          # the refused write added nothing
    reopened.close()
