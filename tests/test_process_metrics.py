"""The process families are prometheus-client's ProcessCollector's, for the same process, in both modes."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.process_collector import ProcessCollector

from forewarn.fleet.metrics import FleetMetrics
from forewarn.metrics import Metrics
from forewarn.metrics.core import OPENMETRICS, Registry
from forewarn.metrics.process import ProcessFamilies

NAMES = ["process_virtual_memory_bytes", "process_resident_memory_bytes", "process_start_time_seconds",
         "process_cpu_seconds_total", "process_open_fds", "process_max_fds"]
linux_only = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="prometheus-client reads /proc")


def theirs(proc: str = "/proc") -> CollectorRegistry:
    registry = CollectorRegistry()
    ProcessCollector(proc=proc, registry=registry)
    return registry


def ours(proc: str = "/proc") -> Registry:
    registry = Registry()
    registry.register(ProcessFamilies(proc))
    return registry


def headers(text: bytes) -> list[str]:
    return [line for line in text.decode().splitlines() if line.startswith("#")]


def values(text: bytes) -> dict[str, float]:
    samples = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            assert sample.labels == {}, sample  # label-free, as prometheus-client's
            samples[sample.name] = sample.value
    return samples


@linux_only
def test_the_families_are_prometheus_clients_names_types_and_help_in_both_formats() -> None:
    """HELP and TYPE lines byte for byte, in the same order, in the text format and in OpenMetrics (where the
    counter's family drops `_total`)."""
    assert headers(ours().render(False)) == headers(generate_latest(theirs()))
    assert headers(ours().render(True)) == headers(generate_openmetrics(theirs()))
    families = {f.name: (f.type, f.documentation) for f in text_string_to_metric_families(ours().render().decode())}
    reference = {f.name: (f.type, f.documentation)
                 for f in text_string_to_metric_families(generate_latest(theirs()).decode())}
    assert families == reference and [name.removesuffix("_total") for name in NAMES] == list(families)


@linux_only
def test_the_values_are_prometheus_clients_for_the_same_process() -> None:
    """Sampled as ours, theirs, ours, back to back, in one thread that allocates only the texts:
    - the start time and the limit are the same numbers from the same sources: equal;
    - the open descriptors are equal (each lister counts the descriptor of its own listing, and nothing opens
      or closes one in between);
    - CPU time is between our two samples, which differ by at most 5 ticks (the three take well under a
      millisecond of CPU; a tick is 10 ms at the usual 100 Hz);
    - memory is between our two samples, give or take one pymalloc arena (1 MiB: the most that writing the
      texts could map and touch in between; in practice they do not move at all)."""
    mine, reference = ours(), theirs()
    for _ in range(20):
        before, their, after = values(mine.render()), values(generate_latest(reference)), values(mine.render())
        assert list(before) == list(their) == NAMES
        assert their["process_start_time_seconds"] == before["process_start_time_seconds"]
        assert their["process_max_fds"] == before["process_max_fds"] == after["process_max_fds"]
        assert their["process_open_fds"] == before["process_open_fds"] == after["process_open_fds"]
        ticks = 1 / os.sysconf("SC_CLK_TCK")
        cpu = "process_cpu_seconds_total"
        assert before[cpu] <= their[cpu] + 1e-9 and their[cpu] <= after[cpu] + 1e-9
        assert after[cpu] - before[cpu] <= 5 * ticks + 1e-9
        arena = 1 << 20
        for name in ("process_resident_memory_bytes", "process_virtual_memory_bytes"):
            low, high = sorted((before[name], after[name]))
            assert low - arena <= their[name] <= high + arena, name
        assert before["process_resident_memory_bytes"] % os.sysconf("SC_PAGE_SIZE") == 0


def fake_proc(root: Path, command: str, fds: int, limit: str) -> Path:
    """A /proc of one process: its stat (fields from proc(5)), limits and descriptors, and the boot time."""
    (root / "self" / "fd").mkdir(parents=True)
    (root / "stat").write_text("cpu  1 2 3 4\nbtime 1700000000\nprocesses 10\n")
    fields = ["S", "1", "1", "1", "0", "-1", "4194560", "100", "0", "0", "0", "1234", "567", "0", "0", "20", "0",
              "3", "0", "98765", "123456789", "4321", "18446744073709551615"]
    (root / "self" / "stat").write_text(f"4242 ({command}) {' '.join(fields)} 0 0 0\n")
    (root / "self" / "limits").write_text(
        "Limit                     Soft Limit           Hard Limit           Units     \n"
        f"Max open files            {limit:<20} {limit:<20} files     \n")
    for n in range(fds):
        (root / "self" / "fd" / str(n)).touch()
    return root


def test_a_command_name_with_spaces_and_parentheses_is_read_past_as_prometheus_client_does(tmp_path: Path) -> None:
    """The command name is in parentheses and may hold anything: the fields are read after the last ")". With
    every source fixed, the exposition is prometheus-client's byte for byte, in both formats."""
    proc = fake_proc(tmp_path, "a) b (c", 7, "4096")
    mine = ours(str(proc))
    assert mine.render(False) == generate_latest(theirs(str(proc)))
    assert mine.render(True) == generate_openmetrics(theirs(str(proc)))
    ticks = os.sysconf("SC_CLK_TCK")
    assert values(mine.render()) == {
        "process_virtual_memory_bytes": 123456789.0, "process_resident_memory_bytes": 4321.0 * os.sysconf(
            "SC_PAGE_SIZE"), "process_start_time_seconds": 98765 / ticks + 1700000000,
        "process_cpu_seconds_total": 1234 / ticks + 567 / ticks, "process_open_fds": 7.0, "process_max_fds": 4096.0}


def test_an_unlimited_descriptor_limit_leaves_out_only_max_fds(tmp_path: Path) -> None:
    """prometheus-client cannot parse "unlimited" and then leaves out both descriptor families; here only the one
    without a number is left out."""
    with pytest.raises(ValueError):  # prometheus-client's own reading of it
        generate_latest(theirs(str(fake_proc(tmp_path / "theirs", "forewarn", 3, "unlimited"))))
    proc = fake_proc(tmp_path, "forewarn", 3, "unlimited")
    names = list(values(ours(str(proc)).render()))
    assert names == NAMES[:-1]


def test_without_proc_there_are_no_process_families_as_with_prometheus_client(tmp_path: Path) -> None:
    assert ours(str(tmp_path)).render() == b"" == generate_latest(theirs(str(tmp_path)))
    assert not ProcessFamilies(str(tmp_path)).available


def test_a_source_that_cannot_be_read_leaves_out_its_families(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, "forewarn", 2, "1024")
    (proc / "self" / "stat").unlink()
    assert list(values(ours(str(proc)).render())) == NAMES[4:]
    for name in os.listdir(proc / "self" / "fd"):
        (proc / "self" / "fd" / name).unlink()
    (proc / "self" / "fd").rmdir()
    assert ours(str(proc)).render() == b""


@linux_only
def test_proc_is_read_only_when_scraped_once_per_scrape_and_the_limit_once(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []
    listed: list[str] = []
    real_open, real_listdir = os.open, os.listdir

    def counting_open(path: Any, *args: Any, **kwargs: Any) -> int:
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    def counting_listdir(path: Any = ".") -> list[str]:
        listed.append(str(path))
        return real_listdir(path)

    monkeypatch.setattr(os, "open", counting_open)
    monkeypatch.setattr(os, "listdir", counting_listdir)
    families = ProcessFamilies()
    assert opened == ["/proc/stat"] and listed == []  # at start: is there a /proc, and when did the machine boot
    time.sleep(0.05)
    assert opened == ["/proc/stat"] and listed == []  # nothing while nobody scrapes
    families.write([], False)
    # the first scrape opens the stat (kept for the next ones: this process may have opened it already), reads
    # the limit, and lists the descriptors twice to check that the directory's size counts them
    assert set(opened[1:]) <= {"/proc/self/stat", "/proc/self/limits"} and "/proc/self/limits" in opened
    assert listed == ["/proc/self/fd"] * 2
    opened.clear()
    for _ in range(3):
        families.write([], False)
    by_size = os.stat("/proc/self/fd").st_size > 0  # Linux 6.2 on: no listing at all
    assert opened == [] and listed == ["/proc/self/fd"] * (2 if by_size else 5)


@linux_only
def test_the_process_families_cost_a_scrape_little() -> None:
    """The median of writing them is well under a millisecond (about 20-100 µs: two procfs reads)."""
    families = ProcessFamilies()
    took = []
    for _ in range(200):
        start = time.perf_counter()
        families.write([], True)
        took.append(time.perf_counter() - start)
    assert statistics.median(took) < 0.001


@linux_only
def test_the_agent_and_fleet_mode_show_the_process_families() -> None:
    """In both formats, after the rest; the values are this process's (the start time is prometheus-client's)."""
    for render in (Metrics().render, FleetMetrics(["queue"]).render):
        for accept, expected in (("", NAMES), (OPENMETRICS, [name.removesuffix("_total") for name in NAMES])):
            text = render(accept)[0]
            assert [line.split()[2] for line in headers(text) if line.startswith("# TYPE process_")] == expected
        lines = render("")[0].decode().splitlines()
        process = [line for line in lines if line.startswith("process_")]
        assert len(process) == len(NAMES) and lines[-1].startswith("process_max_fds ")
        assert values("\n".join(process).encode())["process_start_time_seconds"] == values(
            generate_latest(theirs()))["process_start_time_seconds"]
