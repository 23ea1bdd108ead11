"""The delivery workers: batches sized by the sink, acknowledged only after the sink took them, in order;
what they report goes through an observer, so the outbox and the metrics never import each other."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

from forewarn.backlog import Backlog
from forewarn.outbox.delivery import DeliveryObserver, DeliveryWorker
from forewarn.outbox.outbox import Outbox
from forewarn.records import JsonRecords, Record, json_lines
from forewarn.retry import Backoff
from forewarn.sinks import SinkError
from forewarn.sinks.file import FileSink

SRC = Path(__file__).resolve().parent.parent / "src" / "forewarn"


def record(n: int) -> Record:
    return Record(id=f"id-{n}", source="forewarn://vm-0", type="io.github.forewarn.scheduled_event.added",
                  subject=f"E{n}", time="2024-01-01T00:00:00.000Z",
                  data={"change": "added", "n": n, "event": {"EventId": f"E{n}", "Resources": ["vm-0"]},
                        "affects_this_vm": True, "not_before": None, "ratio": 0.5})


class Report(DeliveryObserver):
    def __init__(self) -> None:
        self.delivered_count = 0
        self.failures = 0
        self.backlogs: list[Backlog] = []

    def delivered(self, sink: str, count: int) -> None:
        self.delivered_count += count

    def delivery_failed(self, sink: str) -> None:
        self.failures += 1

    def backlog(self, sink: str, backlog: Backlog) -> None:
        self.backlogs.append(backlog)


class Flaky:
    """A sink that takes `batch_size` records at a time and refuses the batches listed in `refuse` (by
    call number, from 1), after writing half of them: a sink that fails mid-batch."""

    name = "flaky"

    def __init__(self, batch_size: int, refuse: set[int]) -> None:
        self.batch_size = batch_size
        self.refuse = refuse
        self.calls = 0
        self.received: list[str] = []
        self.sizes: list[int] = []

    def send(self, records: Sequence[Record]) -> None:
        self.calls += 1
        self.sizes.append(len(records))
        if self.calls in self.refuse:
            self.received += [r.id for r in records[: len(records) // 2]]
            raise SinkError("peer went away mid-batch")
        self.received += [r.id for r in records]

    def close(self) -> None:
        return None


def wait_until(check: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.01)
    raise AssertionError("condition not met in time")


def test_the_outbox_and_the_metrics_do_not_import_each_other() -> None:
    # The metrics implement the delivery workers' observer, and Backlog lives beside both: neither package
    # names the other, not even for type checking.
    def imported(path: Path) -> set[str]:
        tree = ast.parse(path.read_text())
        return ({node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
                | {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names})

    def names(imports: set[str], package: str) -> set[str]:
        return {name for name in imports if name == package or name.startswith(package + ".")}

    outbox_files = sorted((SRC / "outbox").glob("*.py"))
    metrics_files = [*sorted((SRC / "metrics").glob("*.py")), SRC / "fleet" / "metrics.py"]
    assert outbox_files and len(metrics_files) > 2
    for path in outbox_files:
        assert not names(imported(path), "forewarn.metrics"), path
    for path in metrics_files:
        assert not names(imported(path), "forewarn.outbox"), path
    assert "forewarn.backlog" in imported(SRC / "outbox" / "store.py")
    assert "forewarn.backlog" in imported(SRC / "metrics" / "view.py")


def test_a_worker_hands_its_sink_batches_of_the_sinks_own_size(tmp_path: Path) -> None:
    sink = Flaky(batch_size=3, refuse=set())
    outbox = Outbox(tmp_path, [sink.name])
    outbox.append([record(n) for n in range(7)])
    report = Report()
    worker = DeliveryWorker(sink, outbox, report, idle_refresh=0.1)
    worker.start()
    try:
        wait_until(lambda: report.backlogs and report.backlogs[-1].records == 0 and len(sink.received) == 7)
    finally:
        worker.stop(drain_timeout=1)
        outbox.close()
    assert sink.sizes == [3, 3, 1]
    assert sink.received == [f"id-{n}" for n in range(7)]
    assert report.delivered_count == 7 and report.failures == 0


def test_a_batch_the_sink_refuses_mid_way_is_sent_again_whole_and_in_order(tmp_path: Path) -> None:
    sink = Flaky(batch_size=4, refuse={2, 3})
    outbox = Outbox(tmp_path, [sink.name])
    outbox.append([record(n) for n in range(10)])
    report = Report()
    worker = DeliveryWorker(sink, outbox, report, backoff=Backoff(base=0.01, cap=0.01), idle_refresh=0.1)
    worker.start()
    try:
        wait_until(lambda: report.delivered_count == 10 and report.backlogs[-1].records == 0)
    finally:
        worker.stop(drain_timeout=1)
        outbox.close()
    # The second batch failed twice after half of it got through; it came back whole each time, and
    # nothing after it went out before it did.
    assert sink.sizes == [4, 4, 4, 4, 2]
    assert sink.received == ["id-0", "id-1", "id-2", "id-3", "id-4", "id-5", "id-4", "id-5",
                             "id-4", "id-5", "id-6", "id-7", "id-8", "id-9"]
    assert report.failures == 2
    assert list(dict.fromkeys(sink.received)) == [f"id-{n}" for n in range(10)]


class Encoding(Flaky):
    """A sink that encodes apart from sending (as OTLP and Event Hubs do): the worker encodes the next batch
    while this one is sent. `bad_encodes` lists the encodings (by number, from 1) that raise."""

    def __init__(self, batch_size: int, refuse: set[int], bad_encodes: set[int]) -> None:
        super().__init__(batch_size, refuse)
        self.bad_encodes = bad_encodes
        self.encodes = 0

    def encode(self, records: Sequence[Record]) -> list[Record]:
        self.encodes += 1
        if self.encodes in self.bad_encodes:
            raise ValueError("cannot encode")
        return list(records)

    def send_encoded(self, payload: list[Record]) -> None:
        self.send(payload)


def test_a_sink_that_encodes_apart_gets_every_batch_in_order_through_failed_sends_and_encodings(
        tmp_path: Path) -> None:
    sink = Encoding(batch_size=3, refuse={2}, bad_encodes={4})
    outbox = Outbox(tmp_path, [sink.name])
    outbox.append([record(n) for n in range(10)])
    report = Report()
    worker = DeliveryWorker(sink, outbox, report, backoff=Backoff(base=0.01, cap=0.01), idle_refresh=0.1)
    worker.start()
    try:
        wait_until(lambda: report.delivered_count == 10 and report.backlogs[-1].records == 0)
        outbox.append([record(n) for n in range(10, 12)])
        wait_until(lambda: report.delivered_count == 12 and report.backlogs[-1].records == 0)
    finally:
        worker.stop(drain_timeout=1)
        outbox.close()
    # The second send failed after its first record, then the second batch's encoding failed once (the
    # third batch, encoded ahead meanwhile, was dropped and taken again later): the second batch came back
    # whole each time, and nothing after it went out first.
    assert sink.received == [f"id-{n}" for n in (0, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10, 11)]
    assert report.failures == 2
    assert report.delivered_count == 12


def test_records_read_back_from_the_outbox_are_the_records_written(tmp_path: Path) -> None:
    written = [record(n) for n in range(5)]
    outbox = Outbox(tmp_path, ["file"])
    outbox.append(written)
    batch = outbox.take("file", 10)
    outbox.close()
    assert isinstance(batch.records, JsonRecords)
    assert list(batch.records) == written
    assert [r.to_json() for r in batch.records] == [r.to_json() for r in written]
    assert batch.records[1:3] == written[1:3]
    assert json_lines(batch.records) == json_lines(written) == "".join(r.to_json() + "\n" for r in written)
    assert json_lines([]) == ""


def test_the_file_sink_writes_each_record_as_one_json_line(tmp_path: Path) -> None:
    written = [record(n) for n in range(3)]
    outbox = Outbox(tmp_path / "state", ["file"])
    outbox.append(written)
    sink = FileSink(str(tmp_path / "out" / "records.jsonl"))
    sink.send(outbox.take("file", 10).records)
    outbox.close()
    lines = (tmp_path / "out" / "records.jsonl").read_text().splitlines()
    assert [Record.from_dict(json.loads(line)) for line in lines] == written


DRAIN_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from forewarn.outbox.delivery import DeliveryWorker
    from forewarn.outbox.outbox import Outbox
    from forewarn.sinks.file import FileSink

    state, out = Path(sys.argv[1]), sys.argv[2]
    sink = FileSink(out)
    outbox = Outbox(state, [sink.name])
    worker = DeliveryWorker(sink, outbox, batch_size=int(sys.argv[3]))
    worker.start()
    worker.stop(drain_timeout=600)
""")


def test_a_drain_killed_mid_way_loses_nothing_and_repeats_only_with_the_same_ids(tmp_path: Path) -> None:
    out = tmp_path / "records.jsonl"
    count, batch = 20_000, 100
    outbox = Outbox(tmp_path / "state", [f"file:{out}"])
    written = [record(n) for n in range(count)]
    outbox.append(written)
    outbox.close()
    command = [sys.executable, "-c", DRAIN_SCRIPT, str(tmp_path / "state"), str(out), str(batch)]
    first = subprocess.Popen(command)
    try:
        wait_until(lambda: out.exists() and out.stat().st_size > 0, timeout=60)
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
    lines_before = len(out.read_text().splitlines())
    assert 0 < lines_before < count, "killed while draining"
    subprocess.run(command, check=True, timeout=120)
    lines = out.read_text().splitlines()
    by_id = {r.id: r for r in written}
    for line in lines:  # every line is a whole record, as written
        received = Record.from_dict(json.loads(line))
        assert by_id[received.id] == received
    ids = [json.loads(line)["id"] for line in lines]
    assert list(dict.fromkeys(ids)) == [r.id for r in written], "everything, first deliveries in order"
    assert len(ids) - count <= batch, "at most the batch in flight is repeated"


class Resting(Flaky):
    """A sink that counts the times it is told that nothing came for a while."""

    def __init__(self) -> None:
        super().__init__(batch_size=10, refuse=set())
        self.idles = 0

    def idle(self) -> None:
        self.idles += 1


def test_an_idle_worker_rests_until_records_come_and_then_delivers_them_at_once(tmp_path: Path) -> None:
    """After a quiet spell the sink is told once that it is idle; then the worker sleeps (it no longer reads the
    outbox again every spell) until an append wakes it, and delivers at once."""
    sink = Resting()
    outbox = Outbox(tmp_path, [sink.name])
    report = Report()
    worker = DeliveryWorker(sink, outbox, report, idle_refresh=0.1)
    worker.start()
    try:
        wait_until(lambda: sink.idles == 1)
        reads = len(report.backlogs)
        time.sleep(1.0)  # ten quiet spells
        assert sink.idles == 1 and len(report.backlogs) == reads, "the worker woke while nothing came"
        outbox.append([record(1)])
        started = time.monotonic()
        wait_until(lambda: sink.received == ["id-1"])
        assert time.monotonic() - started < 0.5
        wait_until(lambda: sink.idles == 2)  # quiet again after the delivery: told once more
    finally:
        worker.stop(drain_timeout=1)
        outbox.close()
