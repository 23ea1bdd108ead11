"""The Poller in-process with its Outbox, against the simulator over HTTP, with a real (and really full) disk."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import requests

from forewarn.imds.client import ImdsClient
from forewarn.metrics import Metrics
from forewarn.outbox.delivery import DeliveryWorker
from forewarn.outbox.outbox import RETRY_SECONDS, Outbox
from forewarn.poller import DeliveryMetrics, OutboxMetrics, Poller
from forewarn.records import Record
from forewarn.sinks.file import FileSink

from conftest import SimulatorHandle, wait_until


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB tmpfs, so that "disk full" is the kernel's ENOSPC and not a stand-in."""
    mount = tmp_path / "small"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(directory: Path) -> Path:
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


def make_collector(url: str, state_dir: Path, records: Path,
                   retry_seconds: float = RETRY_SECONDS) -> tuple[Poller, threading.Event]:
    """A poller with its outbox and one file sink's worker, wired as `forewarn run` wires them; setting the
    event stops the worker (the caller closes `poller.outbox`)."""
    metrics = Metrics()
    sink = FileSink(str(records))
    metrics.add_sink(sink.name)
    outbox = Outbox(state_dir, [sink.name], 1000, OutboxMetrics(metrics), retry_seconds=retry_seconds)
    stop = threading.Event()
    worker = DeliveryWorker(sink, outbox, DeliveryMetrics(metrics), stop=stop, idle_refresh=0.1)
    worker.start()
    return Poller(ImdsClient(url), metrics, outbox, poll_interval=0.2), stop


def saved_events(state_dir: Path) -> list[str]:
    """The event ids of the document saved under `state_dir`, as the next start would read it."""
    outbox = Outbox(state_dir, [])
    try:
        document = outbox.load_document()
    finally:
        outbox.close()
    assert document is not None, "a document was saved"
    return [event.event_id for event in document.events]


def subjects(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [json.loads(line)["subject"] for line in path.read_text().splitlines()]


def add_event(sim: SimulatorHandle, event_id: str) -> None:
    requests.post(sim.url + "/admin/events", json={"type": "Reboot", "notice": 900, "id": event_id}, timeout=5)


def test_full_disk_degrades_to_memory_and_recovers_without_loss(
        small_disk: Path, tmp_path: Path, simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator("quiet", rate_limit=None)
    records = tmp_path / "records.jsonl"
    state_dir = small_disk / "state"
    collector, stop = make_collector(sim.url, state_dir, records)  # retried by hand below, not every 30 s
    sink = f"file:{records}"
    metrics = collector.metrics
    try:
        add_event(sim, "A")
        collector.poll_once()
        wait_until(lambda: subjects(records) == ["A"], timeout=5)
        assert collector.metrics.views.view.store_writable and collector.outbox.writable
        wait_until(lambda: collector.outbox.backlog(sink).records == 0, timeout=5, message="A acknowledged")

        filler = fill(small_disk)
        for event_id in ("B", "C"):
            add_event(sim, event_id)
        for _ in range(50):  # a document with many events grows the database until the disk is full
            add_event(sim, f"X{_}")
            collector.poll_once()
            if not collector.metrics.views.view.store_writable:
                break
        assert not collector.metrics.views.view.store_writable, "the full disk was noticed"
        assert not collector.outbox.writable
        assert metrics.registry.get_sample_value("azure_scheduled_events_state_write_errors_total") == 1
        wait_until(lambda: {"B", "C"} <= set(subjects(records)), timeout=5, message="delivery while disk full")
        wait_until(lambda: collector.outbox.backlog(sink).records == 0, timeout=5, message="all acknowledged")

        filler.unlink()
        wait_until(collector.outbox.recover, timeout=15, interval=0.2, message="back on disk")
        assert collector.metrics.views.view.store_writable
        add_event(sim, "D")
        collector.poll_once()
        wait_until(lambda: "D" in subjects(records), timeout=5)
    finally:
        stop.set()
        collector.outbox.close()
    assert {"A", "B", "C", "D"} <= set(saved_events(state_dir))
    delivered = subjects(records)
    assert delivered.index("A") < delivered.index("B") < delivered.index("D")
    assert len(delivered) == len(set(delivered)), "cursors moved with the outbox: nothing was sent twice"


def test_state_dir_that_cannot_be_created_is_retried(tmp_path: Path, simulator: Callable[..., SimulatorHandle],
                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "forewarn.outbox")
    sim = simulator("quiet", rate_limit=None)
    blocker = tmp_path / "blocker"
    blocker.write_text("in the way")
    records = tmp_path / "records.jsonl"
    collector, stop = make_collector(sim.url, blocker / "state", records, retry_seconds=0.05)
    try:
        add_event(sim, "A")
        collector.poll_once()
        assert not collector.metrics.views.view.store_writable
        assert "is unusable" in caplog.text
        wait_until(lambda: subjects(records) == ["A"], timeout=5)
        blocker.unlink()
        # The outbox's own retry finds the state dir usable again: no poll is needed for that.
        wait_until(lambda: collector.metrics.views.view.store_writable, timeout=5, message="back on disk")
        assert "state dir recovered" in caplog.text
        add_event(sim, "B")
        collector.poll_once()
        wait_until(lambda: subjects(records)[-1:] == ["B"], timeout=5)
    finally:
        stop.set()
        collector.outbox.close()
    assert saved_events(blocker / "state") == ["A", "B"]


def test_sink_outage_never_delays_polling(tmp_path: Path, simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator("quiet", rate_limit=None)
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("x")
    collector, stop = make_collector(sim.url, tmp_path / "state", blocked / "records.jsonl")
    try:
        for event_id in ("A", "B", "C"):
            add_event(sim, event_id)
            collector.poll_once()
        view = collector.metrics.views.view
        assert view.document is not None and len(view.document.events) == 3
        sink = f"file:{blocked}/records.jsonl"
        wait_until(lambda: (collector.metrics.registry.get_sample_value(
            "azure_scheduled_events_record_failures_total", {"sink": sink}) or 0) > 0, timeout=5)
        wait_until(lambda: collector.metrics.views.view.backlogs[sink].records == 3, timeout=10,
                   message="three records waiting for the broken sink")
    finally:
        stop.set()
        collector.outbox.close()


def test_outbox_overflow_drops_the_oldest_counts_and_logs(tmp_path: Path, simulator: Callable[..., SimulatorHandle],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    sim = simulator("quiet", rate_limit=None)
    metrics = Metrics()
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("x")
    sink = FileSink(str(blocked / "records.jsonl"))  # a sink that never accepts: everything stays waiting
    metrics.add_sink(sink.name)
    outbox = Outbox(tmp_path / "state", [sink.name], max_records=3, observer=OutboxMetrics(metrics))
    worker = DeliveryWorker(sink, outbox, DeliveryMetrics(metrics), idle_refresh=0.1)
    worker.start()
    collector = Poller(ImdsClient(sim.url), metrics, outbox, poll_interval=0.2)
    try:
        for event_id in ("A", "B", "C", "D", "E"):
            add_event(sim, event_id)
            collector.poll_once()
        assert metrics.registry.get_sample_value("azure_scheduled_events_outbox_dropped_records_total") == 2
        assert "outbox full (3 records): dropped the 1 oldest" in caplog.text
        assert [record.subject for record in outbox.take(sink.name, 10).records] == ["C", "D", "E"]
        backlog = wait_until(lambda: metrics.views.view.backlogs[sink.name].records == 3
                             and metrics.views.view.backlogs[sink.name], timeout=10)
        assert backlog.oldest_created is not None
        text = metrics.render()[0].decode()
        assert f'azure_scheduled_events_outbox_oldest_record_age_seconds{{sink="{sink.name}"}}' in text
    finally:
        worker.stop(drain_timeout=0.1)
        outbox.close()


class BatchLog(FileSink):
    """The file sink, noting how many records each `send` was given."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.batches: list[int] = []

    def send(self, records: Sequence[Record]) -> None:
        super().send(records)
        self.batches.append(len(records))


def test_a_delivery_worker_hands_its_sink_at_most_its_batch_size_at_once(tmp_path: Path) -> None:
    metrics = Metrics()
    sink = BatchLog(str(tmp_path / "records.jsonl"))
    metrics.add_sink(sink.name)
    outbox = Outbox(tmp_path / "state", [sink.name], 1000, OutboxMetrics(metrics))
    outbox.append([Record(id=f"r{n}", source="s", type="t", subject=f"e{n}", time="2024-01-01T00:00:00Z",
                          data={"n": n}) for n in range(250)])
    worker = DeliveryWorker(sink, outbox, DeliveryMetrics(metrics), idle_refresh=0.1, batch_size=100)
    worker.start()
    try:
        wait_until(lambda: len(subjects(tmp_path / "records.jsonl")) == 250, timeout=10)
        assert sink.batches == [100, 100, 50]
        assert subjects(tmp_path / "records.jsonl") == [f"e{n}" for n in range(250)]
    finally:
        worker.stop(drain_timeout=0.1)
        outbox.close()
    with pytest.raises(ValueError, match="batch_size"):
        DeliveryWorker(sink, outbox, batch_size=0)
