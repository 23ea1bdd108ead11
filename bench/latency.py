"""Reaction latency: from the moment the simulator's document changes to each place the change shows.

For every change (a new Reboot event injected at a random moment of the poll cycle) it measures:
- metric: the event's series on /metrics (scraped every few ms from the change on);
- file, otlp, eventhubs: the record in the file sink, at the local OTLP gRPC receiver and at the local
  AMQP 1.0 peer that `azure-eventhub` talks to (arrival times taken by the peers);
- approval: the StartRequests POST at the simulator, the policy approving Reboot events at once,
  measured from the collector's detection (the first poll served after the change) and from the change.
  This is a series of its own: an approval a change spends one of IMDS's 5 requests/s, and a new
  approved event every second would slow the polls of the other series (the budget is shared).
The baseline (bench/baseline.py) runs against the same simulator at the same interval in the same run;
its figure is the change printed on its standard output.

    python bench/latency.py [--changes 200] [--intervals 1 0.2]

Results are printed and written to bench/results/latency.json.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests

from forewarn.simulator import Simulator, SimulatorServer, load_scenario

from common import BENCH, Collector, header, summary_ms, write_results
from peers.amqp import AmqpPeer
from peers.otlp import GrpcReceiver

POLICY = """version: 1
rules:
  - name: bench-approve-reboots
    match:
      event_type: [Reboot]
    action: approve
"""
TIMEOUT = 15.0


class Arrivals:
    """When each id first showed up in a list a peer appends to (requests or messages, with times)."""

    def __init__(self, items: list[Any], times: list[float], lock: threading.Lock) -> None:
        self.items, self.times, self.lock = items, times, lock
        self.scanned = 0
        self.seen: dict[bytes, float] = {}

    def first(self, key: bytes) -> float | None:
        with self.lock:
            new = list(zip(self.items[self.scanned:], self.times[self.scanned:], strict=True))
            self.scanned += len(new)
        for item, at in new:
            payload = item.SerializeToString() if hasattr(item, "SerializeToString") else repr(item).encode()
            start = 0
            while (found := payload.find(b"BENCH-", start)) >= 0:
                self.seen.setdefault(payload[found:found + 11], at)
                start = found + 1
        return self.seen.get(key)


def event_id(i: int) -> str:
    return f"BENCH-{i:05d}"


def collector_run(interval: float, changes: int, workdir: Path, approve: bool) -> dict[str, Any]:
    sim = Simulator(load_scenario("quiet"))
    server = SimulatorServer(sim).serve_in_background()
    otlp, amqp = GrpcReceiver(), AmqpPeer()
    policy = workdir / "policy.yaml"
    policy.write_text(POLICY)
    records = workdir / "records.jsonl"
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": otlp.endpoint,
           "FOREWARN_EVENTHUBS_CONNECTION_STRING": amqp.connection_string}
    collector = Collector(server.url, workdir / "state", interval, sinks=[f"file:{records}", "otlp", "eventhubs"],
                          env=env, extra=["--policy", str(policy)] if approve else [])
    wanted = {"metric", "approval"} if approve else {"metric", "file", "otlp", "eventhubs"}
    otlp_arrivals = Arrivals(otlp.received.requests, otlp.received.times, otlp.received.lock)
    amqp_arrivals = Arrivals(amqp.received.messages, amqp.received.times, amqp.received.lock)
    session = requests.Session()
    samples: dict[str, list[float]] = {k: [] for k in ("first_poll", *sorted(wanted - {"approval"}))}
    if approve:
        samples |= {"approval_from_detection": [], "approval_from_change": []}
    offset = 0
    try:
        for i in range(changes):
            time.sleep(random.uniform(0, interval))
            name = event_id(i)
            key = name.encode()
            wall0, t0 = time.time(), time.monotonic()
            sim.inject({"id": name, "type": "Reboot", "notice": 900, "source": "Platform"})
            seen: dict[str, float] = {}
            while not wanted <= seen.keys():
                now = time.monotonic()
                if now - t0 > TIMEOUT:
                    raise RuntimeError(f"{name}: only {sorted(seen)} within {TIMEOUT:g} s")
                if "metric" not in seen and f'event_id="{name}"' in session.get(collector.url + "/metrics").text:
                    seen["metric"] = time.monotonic()
                if "file" in wanted and "file" not in seen and records.exists():
                    with records.open("rb") as handle:
                        handle.seek(offset)
                        tail = handle.read()
                    if key in tail:
                        seen["file"] = time.monotonic()
                        offset += len(tail)
                for label, arrivals in (("otlp", otlp_arrivals), ("eventhubs", amqp_arrivals)):
                    if label in wanted and label not in seen and (at := arrivals.first(key)) is not None:
                        seen[label] = at
                if approve and "approval" not in seen and any(name in post["event_ids"] for post in sim.approval_posts):
                    seen["approval"] = time.monotonic()
                time.sleep(0.003)
            for label in wanted - {"approval"}:
                samples[label].append(seen[label] - t0)
            polls = [t for caller, stamps in sim.request_times.items() if caller.startswith("forewarn/")
                     for t in stamps if t >= wall0]
            samples["first_poll"].append(min(polls) - wall0)
            if approve:
                post = next(p for p in sim.approval_posts if name in p["event_ids"])
                post_wall = sim.started_wall + post["at"] / sim.speed
                samples["approval_from_detection"].append(post_wall - min(polls))
                samples["approval_from_change"].append(post_wall - wall0)
            sim.remove(name)
        return {label: summary_ms(values) for label, values in samples.items()} | {
            "imds_max_requests_per_s": sim.max_rate("forewarn/"), "rate_violations": sim.rate_violations}
    finally:
        collector.stop()
        otlp.stop()
        amqp.stop()
        server.stop()


def baseline_run(interval: float, changes: int) -> dict[str, Any]:
    sim = Simulator(load_scenario("quiet"))
    server = SimulatorServer(sim).serve_in_background()
    proc = subprocess.Popen([sys.executable, str(BENCH / "baseline.py"), server.url, "--interval", str(interval)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: list[tuple[float, str]] = []
    lock = threading.Lock()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with lock:
                lines.append((time.monotonic(), line))

    threading.Thread(target=read, daemon=True).start()
    samples: list[float] = []
    try:
        time.sleep(2)
        for i in range(changes):
            time.sleep(random.uniform(0, interval))
            name = event_id(i)
            t0 = time.monotonic()
            sim.inject({"id": name, "type": "Reboot", "notice": 900, "source": "Platform"})
            while True:
                with lock:
                    hit = next((at for at, line in lines if at >= t0 and name in line), None)
                if hit is not None:
                    break
                if time.monotonic() - t0 > TIMEOUT:
                    raise RuntimeError(f"baseline did not print {name}")
                time.sleep(0.003)
            samples.append(hit - t0)
            sim.remove(name)
            with lock:
                lines.clear()
        return {"printed": summary_ms(samples)}
    finally:
        proc.kill()
        proc.wait()
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=200)
    parser.add_argument("--intervals", type=float, nargs="+", default=[1.0, 0.2])
    args = parser.parse_args()
    random.seed(11)
    results: dict[str, Any] = header() | {"changes": args.changes}
    for interval in args.intervals:
        for series, approve in (("forewarn", False), ("approvals", True)):
            with tempfile.TemporaryDirectory() as tmp:
                results[f"{series}_{interval:g}s"] = collector_run(interval, args.changes, Path(tmp), approve)
            print(f"{series} at {interval:g} s:", results[f"{series}_{interval:g}s"], flush=True)
        results[f"baseline_{interval:g}s"] = baseline_run(interval, args.changes)
        print(f"baseline at {interval:g} s:", results[f"baseline_{interval:g}s"], flush=True)
    write_results("latency", results)


if __name__ == "__main__":
    main()
