"""The `process_*` families every Prometheus client library exports, for forewarn's own process.

On a plain VM they are the only way to watch the agent itself (its CPU, memory and file descriptors).
Names, types, HELP texts and values are those of prometheus-client's `ProcessCollector`
(prometheus_client/process_collector.py), which forewarn exported before it wrote its own exposition:
tests/test_process_metrics.py compares the two for the same process.

    process_virtual_memory_bytes     gauge    /proc/self/stat vsize
    process_resident_memory_bytes    gauge    /proc/self/stat rss, in pages, times the page size
    process_start_time_seconds       gauge    /proc/self/stat starttime (ticks since boot) + /proc/stat btime
    process_cpu_seconds_total        counter  /proc/self/stat utime + stime, in ticks
    process_open_fds                 gauge    the entries of /proc/self/fd
    process_max_fds                  gauge    /proc/self/limits "Max open files", the soft limit

A scrape reads /proc/self/stat once (with `pread` at 0 from a descriptor opened at the first scrape and kept,
one per process: procfs writes it afresh) and counts /proc/self/fd, about 10 µs together; each system call
lets go of the GIL, so they are few. Nothing is read while nobody scrapes. The count is the directory's size
where the kernel gives it (Linux 6.2 on), checked at the first scrape against a listing, plus one: the
descriptor a listing holds, which prometheus-client counts; elsewhere a listing. Unlike the rest of the
scrape path this is a read of the kernel's state, not of forewarn's: procfs answers from memory, never from a
disk. What does not change is read once: the start time, and the
limit on open files from /proc/self/limits (forewarn never changes it; a `prlimit` from outside shows after a
restart). Without /proc (not Linux) there are no process families, as with prometheus-client; where the limit
is unlimited, no `process_max_fds` (prometheus-client fails to parse "unlimited" and leaves out both fd
families then). No `resource` module: the agent also runs on Windows (tests/test_deploy.py).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

from forewarn.metrics.core import Header, number

_VIRTUAL = Header("process_virtual_memory_bytes", "Virtual memory size in bytes.")
_RESIDENT = Header("process_resident_memory_bytes", "Resident memory size in bytes.")
_START = Header("process_start_time_seconds", "Start time of the process since unix epoch in seconds.")
_CPU = Header("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.", "counter")
_OPEN_FDS = Header("process_open_fds", "Number of open file descriptors.")
_MAX_FDS = Header("process_max_fds", "Maximum number of open file descriptors.")


def _read(path: str) -> bytes:
    """A small procfs file in one read (no buffered file object: this runs at every scrape)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        return os.read(fd, 8192)
    finally:
        os.close(fd)


#: Descriptors kept open for reading again, by path: (the process that opened it, the descriptor). A forked
#: child opens its own (/proc/self was the parent when the parent opened it).
_HELD: dict[str, tuple[int, int]] = {}
_HELD_LOCK = threading.Lock()


def _held_read(path: str) -> bytes:
    """A small procfs file, read again from the start through a descriptor kept open: one system call."""
    pid = os.getpid()
    held = _HELD.get(path)
    if held is None or held[0] != pid:
        with _HELD_LOCK:
            held = _HELD.get(path)
            if held is None or held[0] != pid:
                held = _HELD[path] = (pid, os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
    try:
        return os.pread(held[1], 8192, 0)
    except OSError:
        with _HELD_LOCK:
            if _HELD.get(path) == held:
                del _HELD[path]
                os.close(held[1])
        raise


def _boot_time(proc: str) -> float:
    """/proc/stat's btime: when the machine booted, as Unix time (0 when /proc has none)."""
    for line in _read(os.path.join(proc, "stat")).splitlines():
        if line.startswith(b"btime "):
            return float(line.split()[1])
    return 0.0


def _max_fds_line(limits: bytes) -> str:
    """The sample of process_max_fds from /proc/self/limits: the soft limit of "Max open files", as
    prometheus-client reads it; empty when there is none or it is "unlimited"."""
    for line in limits.splitlines():
        if line.startswith(b"Max open file"):
            try:
                return f"{_MAX_FDS.name} {number(float(line.split()[3]))}\n"
            except (ValueError, IndexError):
                return ""
    return ""


class ProcessFamilies:
    """A collector of the process families, for a `Registry`: it writes their text itself at each scrape.

    `proc` is where procfs is mounted (tests give a directory of their own)."""

    def __init__(self, proc: str = "/proc") -> None:
        self._stat = os.path.join(proc, "self", "stat")
        self._limits = os.path.join(proc, "self", "limits")
        self._fds = os.path.join(proc, "self", "fd")
        self._ticks = self._pagesize = 0.0
        try:  # as prometheus-client: /proc/stat's boot time says whether there is a /proc to read at all
            self._btime = _boot_time(proc)
            self._ticks = float(os.sysconf("SC_CLK_TCK"))
            self._pagesize = float(os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError, IndexError, AttributeError):
            self._btime = 0.0
        self._start_line = ""  # written at the first scrape: the start time never changes
        self._max_fds: str | None = None  # the same: read at the first scrape
        self._fds_by_size: bool | None = None  # whether /proc/self/fd's size counts them: known at the first scrape

    @property
    def available(self) -> bool:
        return bool(self._btime)

    def collect(self) -> Iterator[ProcessFamilies]:
        if self._btime:
            yield self

    def write(self, out: list[str], openmetrics: bool) -> None:
        """The families in prometheus-client's order; those whose source cannot be read are left out."""
        try:
            # The command name (field 2) is in parentheses and may hold spaces or parentheses: the fields
            # that count start after the last ")". Index 0 here is field 3 (state), as in proc(5) minus 3.
            fields = _held_read(self._stat).rsplit(b")", 1)[1].split()
            vsize, rss = float(fields[20]), float(fields[21]) * self._pagesize
            cpu = float(fields[11]) / self._ticks + float(fields[12]) / self._ticks  # as prometheus-client adds them
            start_line = self._start_line
            if not start_line:
                start = float(fields[19]) / self._ticks + self._btime
                start_line = self._start_line = f"{_START.name} {number(start)}\n"
        except (OSError, ValueError, IndexError):
            pass
        else:
            out.append(_VIRTUAL.text(openmetrics))
            out.append(f"{_VIRTUAL.name} {number(vsize)}\n")
            out.append(_RESIDENT.text(openmetrics))
            out.append(f"{_RESIDENT.name} {number(rss)}\n")
            out.append(_START.text(openmetrics))
            out.append(start_line)
            out.append(_CPU.text(openmetrics))
            out.append(f"{_CPU.name} {number(cpu)}\n")
        try:
            open_fds = self._open_fds()
        except OSError:
            return
        out.append(_OPEN_FDS.text(openmetrics))
        out.append(f"{_OPEN_FDS.name} {number(open_fds)}\n")
        max_fds = self._max_fds
        if max_fds is None:
            try:
                max_fds = self._max_fds = _max_fds_line(_read(self._limits))
            except OSError:
                max_fds = ""  # tried again at the next scrape
        if max_fds:
            out.append(_MAX_FDS.text(openmetrics))
            out.append(max_fds)

    def _open_fds(self) -> int:
        """The open descriptors as a listing of /proc/self/fd counts them (the listing's own included)."""
        if self._fds_by_size:
            return os.stat(self._fds).st_size + 1
        listed = len(os.listdir(self._fds))
        if self._fds_by_size is None:
            self._fds_by_size = os.stat(self._fds).st_size + 1 == listed == len(os.listdir(self._fds))
        return listed
