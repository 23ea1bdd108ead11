"""Helpers shared by the benchmarks: the collector as a subprocess, /proc readings, percentiles."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import requests

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
sys.path.insert(0, str(BENCH.parent / "tests"))  # the local peers (OTLP receiver, AMQP 1.0 peer)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def commit() -> str | None:
    """The checkout's commit, "+changes" after it when src/ or bench/ differ from it (the code measured is
    then that commit and the working tree's changes); None outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=BENCH.parent, capture_output=True, text=True, check=True).stdout
    try:
        head = git("rev-parse", "--short", "HEAD").strip()
        changed = git("status", "--porcelain", "--untracked-files=no", "--", "src", "bench").strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{head}+changes" if changed else head


def header() -> dict[str, Any]:
    """When, where and on which code a benchmark ran, for the results file (docs/performance.md gives each
    figure with its date and commit)."""
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "python": platform.python_version(),
    }


def write_results(name: str, results: dict[str, Any]) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


def percentile(values: Sequence[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def summary_ms(seconds: Sequence[float]) -> dict[str, Any]:
    return {"p50_ms": round(percentile(seconds, 50) * 1000, 2), "p99_ms": round(percentile(seconds, 99) * 1000, 2),
            "max_ms": round(max(seconds) * 1000, 2), "samples": len(seconds)}


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of `pid`, in nanoseconds from schedstat where the kernel has it (utime and
    stime in /proc/PID/stat count 10 ms ticks, too coarse for a sub-millisecond poll). Threads that have
    ended are not counted; the processes measured here keep theirs."""
    tasks = list(Path(f"/proc/{pid}/task").glob("*/schedstat"))
    if tasks:
        total = 0
        for task in tasks:
            with contextlib.suppress(OSError, IndexError, ValueError):  # the thread ended while we read
                total += int(task.read_text().split()[0])
        return total / 1e9
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def peak_rss_mib(pid: int) -> float:
    """The most resident memory `pid` has had (VmHWM): since it started, or since reset_peak_rss."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def reset_peak_rss(pid: int) -> bool:
    """Start VmHWM again from the current RSS (Linux 4.0+, our own processes); False where it cannot."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class Collector:
    """`forewarn run` as its own process, as deployed, with its metrics on a free loopback port."""

    def __init__(self, endpoint: str, state_dir: Path, interval: float = 1.0, sinks: Sequence[str] = (),
                 env: dict[str, str] | None = None, extra: Sequence[str] = (), wait: bool = True,
                 log: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "forewarn", "run", "--imds-endpoint", endpoint,
                "--listen-address", f"127.0.0.1:{self.port}", "--state-dir", str(state_dir),
                "--poll-interval", str(interval), "--log-level", "warning"]
        args += [f"--sink={sink}" for sink in sinks] if sinks else ["--sink="]
        log_file = log.open("ab") if log is not None else None  # its warnings, when asked for
        self.proc = subprocess.Popen([*args, *extra], stdout=subprocess.DEVNULL,
                                     stderr=log_file or subprocess.DEVNULL, env={**os.environ, **(env or {})})
        if log_file is not None:
            log_file.close()  # the child has its own copy
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"collector exited with {self.proc.returncode}")
            try:
                if requests.get(self.url + "/readyz", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.05)
        raise RuntimeError("collector did not become ready")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(20)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(20)
