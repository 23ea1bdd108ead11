"""Fault soak: a long simulated run, compressed, with everything going wrong that can.

The simulator plays a random timeline of at least 30 simulated hours (accelerated into minutes):
planned events of every type (Scheduled, then Started, then gone), cancelled ones (Scheduled, then
gone) and unannounced failures (Started at once). Meanwhile the benchmark:
- opens IMDS fault windows of 1-4 s (500, 503, 429, 410, connection resets, timeouts, malformed
  documents, 300 ms of latency);
- takes the OTLP receiver or the AMQP 1.0 peer down for 5-20 s, then brings it back on the same port;
- kills the collector with SIGKILL and starts it again on the same state directory.
Every phase of an event lasts at least 20 s of real time: longer than any blind spell the faults
cause (a restart, a fault window plus the backoff after it), so every transition can be seen.

Reported: the transitions the simulator produced (observed by a thread that reads its timeline every
50 ms) against the transitions in the records (missed, phantom); records describing the same transition
under different ids (duplicates; a record redelivered with its own id after a SIGKILL is allowed by the
delivery promise and counted apart); records each sink lacks at the end; crashes; the most IMDS requests
in any second.

    python bench/soak.py [--hours 30] [--minutes 12] [--seed 1]

Results are printed and written to bench/results/soak.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from forewarn.simulator import Simulator, SimulatorServer
from forewarn.simulator.scenarios import parse_scenario

from common import Collector, header, write_results
from peers.amqp import AmqpPeer
from peers.otlp import GrpcReceiver, Received

MIN_PHASE_REAL = 20.0
TYPES = ["Reboot", "Redeploy", "Freeze", "Preempt", "Terminate"]
IMDS_FAULTS = ["500", "503", "429", "410", "reset", "timeout", "malformed", "latency"]


def timeline(hours: float, speed: float, rng: random.Random) -> dict[str, Any]:
    """A scenario whose every phase lasts at least MIN_PHASE_REAL seconds of real time."""
    phase = MIN_PHASE_REAL * speed
    events = []
    at = 60.0
    end = hours * 3600 - 3 * phase
    while at < end:
        kind = rng.choices(["planned", "cancelled", "unannounced"], weights=[6, 2, 1])[0]
        event: dict[str, Any] = {"id": f"SOAK-{len(events):04d}", "type": rng.choice(TYPES), "at": round(at),
                                 "run_for": round(rng.uniform(phase, 2 * phase))}
        if kind == "planned":
            event["notice"] = round(rng.uniform(phase, 2 * phase))
        elif kind == "cancelled":
            event["notice"] = round(3 * phase)
            event["cancel_after"] = round(rng.uniform(phase, 2 * phase))
        else:
            event["notice"] = None
        if event["type"] == "Freeze":
            event["duration"] = 5
        events.append(event)
        at += rng.uniform(0.3, 1.0) * phase
    return {"name": "soak", "vm_name": "vm-0", "vms": ["vm-0", "vm-1"], "events": events}


class Soak:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.rng = random.Random(args.seed)
        self.speed = args.hours * 3600 / (args.minutes * 60)
        self.scenario = parse_scenario(timeline(args.hours, self.speed, self.rng))
        self.sim = Simulator(self.scenario, speed=self.speed)
        self.server = SimulatorServer(self.sim).serve_in_background()
        self.otlp_received = Received()
        self.otlp = GrpcReceiver(received=self.otlp_received)
        self.otlp_port = self.otlp.port
        self.amqp = AmqpPeer()
        self.amqp_port = self.amqp.port
        self.amqp_received = self.amqp.received
        self.workdir = workdir
        self.records = workdir / "records.jsonl"
        self.env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": self.otlp.endpoint,
                    "OTEL_EXPORTER_OTLP_TIMEOUT": "2",
                    "FOREWARN_EVENTHUBS_CONNECTION_STRING": self.amqp.connection_string}
        self.counts: collections.Counter[str] = collections.Counter()
        self.done = threading.Event()
        self.collector = self.start_collector()

    def start_collector(self) -> Collector:
        return Collector(self.server.url, self.workdir / "state", 1.0,
                         sinks=[f"file:{self.records}", "otlp", "eventhubs"], env=self.env)

    # --- the ground truth -------------------------------------------------------------------
    def watch_timeline(self) -> None:
        while not self.done.is_set():
            self.sim.current()
            time.sleep(0.05)

    # --- trouble ------------------------------------------------------------------------------
    def imds_faults(self) -> None:
        faults = self.sim.faults
        while not self.done.wait(self.rng.uniform(3, 12)):
            kind = self.rng.choice(IMDS_FAULTS)
            window = self.rng.uniform(1, 4)
            if kind == "latency":
                faults.latency = 0.3
            else:
                faults.rates[kind] = self.rng.choice([0.5, 1.0])
            self.counts[f"imds_fault_{kind}"] += 1
            self.done.wait(window)
            faults.latency = 0.0
            faults.rates.clear()

    def sink_outages(self) -> None:
        while not self.done.wait(self.rng.uniform(20, 60)):
            down = self.rng.uniform(5, 20)
            if self.rng.random() < 0.5:
                self.otlp.stop()
                self.counts["otlp_outages"] += 1
                self.done.wait(down)
                self.otlp = GrpcReceiver(port=self.otlp_port, received=self.otlp_received)
            else:
                self.amqp.stop()
                self.counts["amqp_outages"] += 1
                self.done.wait(down)
                self.amqp = AmqpPeer(port=self.amqp_port)
                self.amqp.received = self.amqp_received

    def run(self, kills_every: float) -> None:
        helpers = [threading.Thread(target=f, daemon=True) for f in
                   (self.watch_timeline, self.imds_faults, self.sink_outages)]
        for helper in helpers:
            helper.start()
        end = max(self.scenario.events[-1].at + 4 * MIN_PHASE_REAL * self.speed, 0) / self.speed
        next_kill = time.monotonic() + self.rng.uniform(0.5, 1.5) * kills_every
        started = time.monotonic()
        while time.monotonic() - started < end:
            time.sleep(0.5)
            if self.collector.proc.poll() is not None:
                self.counts["crashes"] += 1
                self.collector = self.start_collector()
            if time.monotonic() >= next_kill:
                self.collector.proc.send_signal(signal.SIGKILL)
                self.collector.proc.wait(10)
                self.counts["sigkills"] += 1
                time.sleep(self.rng.uniform(0.2, 2.0))
                self.collector = self.start_collector()
                next_kill = time.monotonic() + self.rng.uniform(0.5, 1.5) * kills_every
        self.done.set()
        for helper in helpers:
            helper.join()  # an outage in progress ends with its peer back up

    def wait_delivered(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ids = set(file_records(self.records))
            if ids and ids <= otlp_ids(self.otlp_received) and ids <= amqp_ids(self.amqp_received):
                return
            time.sleep(1)


def file_records(path: Path) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            out[record["id"]] = record
    return out


def file_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def otlp_ids(received: Received) -> set[str]:
    return {r["body_value"]["id"] for r in received.log_records()}


def amqp_ids(received: Any) -> set[str]:
    return {json.loads(bytes(m.data[0]))["id"] for m in received.events()}


def transition(record: dict[str, Any]) -> tuple[str, str] | None:
    change = record["data"]["change"]
    if change == "removed":
        return record["subject"], ""
    if change in ("added", "updated"):
        return record["subject"], record["data"]["event"]["EventStatus"]
    return None


def report(soak: Soak) -> dict[str, Any]:
    expected = {(t.event_id, t.status) for t in soak.sim.transitions}
    records = file_records(soak.records)
    reported = [tr for r in records.values() if (tr := transition(r)) is not None]
    by_key = collections.Counter((r["subject"], r["data"]["change"], transition(r)) for r in records.values())
    file_ids = set(records)
    return {
        "simulated_hours": round(soak.sim.now() / 3600, 1),
        "speed": round(soak.speed, 1),
        "events": len(soak.scenario.events),
        "transitions_produced": len(expected),
        "transitions_reported": len(set(reported)),
        "missed": sorted(map(list, expected - set(reported))),
        "phantom": sorted(map(list, set(reported) - expected)),
        "duplicates_beyond_same_id": sum(n - 1 for n in by_key.values() if n > 1),
        "records": len(file_ids),
        "records_redelivered_with_same_id": file_lines(soak.records) - len(file_ids),
        "missing_at_otlp": len(file_ids - otlp_ids(soak.otlp_received)),
        "missing_at_eventhubs": len(file_ids - amqp_ids(soak.amqp_received)),
        "imds_max_requests_in_any_second": soak.sim.max_rate("forewarn/"),
        "imds_over_budget_replies": soak.sim.rate_violations,
        "trouble": dict(soak.counts),
        "crashes": soak.counts["crashes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hours", type=float, default=30.0, help="simulated hours (default 30)")
    parser.add_argument("--minutes", type=float, default=12.0, help="real minutes to play them in (default 12)")
    parser.add_argument("--kill-every", type=float, default=60.0, help="mean real seconds between SIGKILLs")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    results: dict[str, Any] = header()
    with tempfile.TemporaryDirectory() as tmp:
        soak = Soak(args, Path(tmp))
        try:
            soak.run(args.kill_every)
            soak.wait_delivered()
        finally:
            soak.collector.stop()
            soak.otlp.stop()
            soak.amqp.stop()
            soak.server.stop()
        results["soak"] = report(soak)
    write_results("soak", results)


if __name__ == "__main__":
    main()
