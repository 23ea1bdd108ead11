"""Collector-core benchmark: detection latency, steady-state cost, scrape latency.

Runs `forewarn run` as a subprocess against the in-process simulator on loopback, exactly as deployed
(file sink, real HTTP), and measures from outside the process:
- detection: the moment the simulator's document changes -> the event on /metrics and in the file sink;
- steady state: CPU time (utime+stime from /proc) per IMDS poll, and resident memory, at 1 poll/s;
- scrape: /metrics latency with 100 events in the document.

    python bench/core.py            # full run (about 5 minutes)
    python bench/core.py --quick    # a smaller run for a smoke check

Results are printed and written to bench/results/core.json.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

from forewarn.simulator import Simulator, SimulatorServer, load_scenario

from common import free_port, header, write_results

CLK_TCK = os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of `pid`, in nanosecond resolution from schedstat where the kernel has it
    (utime/stime in /proc/PID/stat count in 10 ms ticks, too coarse for a sub-millisecond poll)."""
    tasks = list(Path(f"/proc/{pid}/task").glob("*/schedstat"))
    if tasks:
        return sum(int(task.read_text().split()[0]) for task in tasks) / 1e9
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_mib(pid: int) -> tuple[float, float]:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(status["VmRSS"].split()[0]) / 1024, int(status["VmHWM"].split()[0]) / 1024


class Collector:
    def __init__(self, endpoint: str, workdir: Path, interval: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.records = workdir / "records.jsonl"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "forewarn", "run", "--imds-endpoint", endpoint, "--listen-address",
             f"127.0.0.1:{self.port}", "--state-dir", str(workdir / "state"), "--sink", f"file:{self.records}",
             "--poll-interval", str(interval), "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if requests.get(self.url + "/readyz", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.05)
        raise RuntimeError("collector did not become ready")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def detection(sim: Simulator, collector: Collector, changes: int, interval: float) -> dict[str, Any]:
    session = requests.Session()
    to_metric: list[float] = []
    to_record: list[float] = []
    offset = 0
    for i in range(changes):
        time.sleep(random.uniform(0, interval))
        event_id = f"BENCH-{i}"
        changed_at = time.monotonic()
        sim.inject({"id": event_id, "type": "Reboot", "notice": 900})
        seen_metric = seen_record = None
        while seen_metric is None or seen_record is None:
            now = time.monotonic()
            if now - changed_at > 10:
                raise RuntimeError(f"change {event_id} not seen within 10 s")
            if seen_metric is None and f'event_id="{event_id}"' in session.get(collector.url + "/metrics").text:
                seen_metric = time.monotonic()
            if seen_record is None and collector.records.exists():
                with collector.records.open() as handle:
                    handle.seek(offset)
                    tail = handle.read()
                if f'"subject":"{event_id}"' in tail:
                    seen_record = time.monotonic()
                    offset += len(tail.encode())
            time.sleep(0.002)
        to_metric.append(seen_metric - changed_at)
        to_record.append(seen_record - changed_at)
    return {name: {"p50_ms": percentile(v, 50) * 1000, "p99_ms": percentile(v, 99) * 1000,
                   "max_ms": max(v) * 1000, "samples": len(v)}
            for name, v in (("metric", to_metric), ("record", to_record))}


def steady_state(sim: Simulator, collector: Collector, seconds: float) -> dict[str, Any]:
    """Nothing but polling: no scrapes, no changes. Polls are counted at the simulator."""
    pid = collector.proc.pid
    time.sleep(3)
    cpu0, polls0 = cpu_seconds(pid), sum(sim.requests.values())
    time.sleep(seconds)
    cpu1, polls1 = cpu_seconds(pid), sum(sim.requests.values())
    rss, peak = rss_mib(pid)
    done = polls1 - polls0
    return {"seconds": seconds, "polls": done, "cpu_ms_per_poll": (cpu1 - cpu0) * 1000 / max(done, 1),
            "rss_mib": rss, "peak_rss_mib": peak}


def scrape(sim: Simulator, collector: Collector, events: int, scrapes: int) -> dict[str, Any]:
    for event in sim.current()[1]:  # start from an empty document: exactly `events` events
        sim.remove(event["EventId"])
    for i in range(events):
        sim.inject({"id": f"SCRAPE-{i}", "type": random.choice(["Reboot", "Redeploy", "Freeze"]), "notice": 900,
                    "description": "Host server is undergoing maintenance."})
    session = requests.Session()
    deadline = time.monotonic() + 10
    while session.get(collector.url + "/metrics").text.count("azure_scheduled_event_info{") != events:
        if time.monotonic() > deadline:
            raise RuntimeError("events not visible")
        time.sleep(0.1)
    latencies = []
    for _ in range(scrapes):
        started = time.perf_counter()
        response = session.get(collector.url + "/metrics")
        response.raise_for_status()
        latencies.append(time.perf_counter() - started)
    return {"events": events, "scrapes": scrapes, "bytes": len(response.content),
            "p50_ms": percentile(latencies, 50) * 1000, "p99_ms": percentile(latencies, 99) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    changes, steady, scrapes = (20, 20, 300) if args.quick else (200, 60, 2000)
    random.seed(7)
    results: dict[str, Any] = header()
    with tempfile.TemporaryDirectory() as tmp:
        sim = Simulator(load_scenario("quiet"))
        server = SimulatorServer(sim).serve_in_background()
        collector = Collector(server.url, Path(tmp), interval=1.0)
        try:
            results["steady_state_1s"] = steady_state(sim, collector, steady)
            results["detection_1s"] = detection(sim, collector, changes, 1.0)
            results["scrape_100_events"] = scrape(sim, collector, 100, scrapes)
        finally:
            collector.stop()
            server.stop()
    write_results("core", results)


if __name__ == "__main__":
    main()
