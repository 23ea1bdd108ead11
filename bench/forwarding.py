"""Forwarding benchmark: backlog drain rate per sink (the memory the sinks add is in bench/cost.py).

- drain: 10,000 records already waiting in the outbox of a stopped collector; `forewarn run` starts
  and its delivery worker drains them to the sink's local peer (OTLP gRPC, OTLP HTTP, the AMQP 1.0 peer,
  the CloudEvents webhook receiver, the file sink). Rate = records / seconds from the first to the last
  record the peer received.

    python bench/forwarding.py [--records 10000] [--only webhook,file]

Results are printed and written to bench/results/forwarding.json. The peers run in this process,
the collector in its own.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from forewarn.imds.document import parse_document
from forewarn.imds.instance import VmInfo
from forewarn.outbox.outbox import Outbox
from forewarn.records import to_record
from forewarn.simulator import Simulator, SimulatorServer, load_scenario
from forewarn.tracker import diff_documents

from common import Collector, header, peak_rss_mib, rss_mib, write_results  # also puts tests/ (the peers) on sys.path
from peers.amqp import AmqpPeer
from peers.notify import NotifyPeer
from peers.otlp import GrpcReceiver, HttpReceiverServer

VM = VmInfo(name="vm-0", vm_id="4d1824cf-fdc0-5660-b82f-b2a54105ac90", location="westeurope",
            resource_id="/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/vm-0")


def backlog(state_dir: Path, sink: str, count: int) -> None:
    outbox = Outbox(state_dir, [sink])
    records = []
    for i in range(count):
        document = parse_document({"DocumentIncarnation": i + 1, "Events": [{
            "EventId": f"BENCH-{i:05d}", "EventType": "Reboot", "ResourceType": "VirtualMachine",
            "Resources": ["vm-0", "vm-1"], "EventStatus": "Scheduled", "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT",
            "Description": "Host server is undergoing maintenance.", "EventSource": "Platform",
            "DurationInSeconds": -1}]})
        (change,) = diff_documents(None, document)
        records.append(to_record(change, VM, datetime.now(timezone.utc)))
    outbox.append(records)
    outbox.close()


def wait_count(count_fn: Any, target: int, timeout: float) -> tuple[float, float]:
    """Times (monotonic) of the first record seen and of the target count."""
    first = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = count_fn()
        if n and first is None:
            first = time.monotonic()
        if n >= target:
            return first or time.monotonic(), time.monotonic()
        time.sleep(0.005)
    raise RuntimeError(f"only {count_fn()} of {target} records arrived")


def drain(sim_url: str, records: int, only: list[str] | None = None) -> dict[str, Any]:
    results: dict[str, Any] = {}
    cases: list[tuple[str, Any]] = [("otlp-grpc", GrpcReceiver), ("otlp-http", HttpReceiverServer),
                                    ("eventhubs", AmqpPeer), ("webhook", lambda: NotifyPeer("cloudevents")),
                                    ("file", None)]
    for name, peer_type in cases:
        if only and name not in only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            state = Path(tmp) / "state"
            state.mkdir()
            peer = peer_type() if peer_type else None
            env: dict[str, str] = {}
            if name.startswith("otlp"):
                sink = "otlp"
                env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc" if name == "otlp-grpc" else "http/protobuf",
                       "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": peer.endpoint}

                def count(p: Any = peer) -> int:
                    with p.received.lock:
                        return sum(len(sl.log_records) for r in p.received.requests for rl in r.resource_logs
                                   for sl in rl.scope_logs)
            elif name == "eventhubs":
                sink = "eventhubs"
                env = {"FOREWARN_EVENTHUBS_CONNECTION_STRING": peer.connection_string}

                def count(p: Any = peer) -> int:
                    with p.received.lock:
                        return len(p.received.messages)
            elif name == "webhook":  # one CloudEvent per POST, parsed by the SDK in the receiver
                sink = "webhook"
                env = {"FOREWARN_WEBHOOK_URL": peer.url}

                def count(p: Any = peer) -> int:
                    with p.received.lock:
                        return len(p.received.accepted)
            else:
                out = Path(tmp) / "records.jsonl"
                sink = f"file:{out}"

                def count(path: Path = out) -> int:
                    if not path.exists():
                        return 0
                    with path.open("rb") as handle:
                        return sum(1 for _ in handle)
            backlog(state, sink, records)
            started = time.monotonic()
            collector = Collector(sim_url, state, sinks=[sink], env=env, wait=False)
            try:
                first, last = wait_count(count, records, timeout=300)
                # The agent's memory with this sink: at its most (during the drain) and just after it.
                rss = {"rss_after_drain_mib": round(rss_mib(collector.pid), 1),
                       "peak_rss_mib": round(peak_rss_mib(collector.pid), 1)}
            finally:
                collector.stop()
                if peer is not None:
                    peer.stop()
            results[name] = {"records": records, "records_per_s": records / max(last - first, 1e-9),
                             "seconds_from_start": last - started, **rss}
            print(name, json.dumps(results[name]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--only", help="comma-separated cases to run (default: all)")
    args = parser.parse_args()
    sim = Simulator(load_scenario("tour"), speed=20)
    server = SimulatorServer(sim).serve_in_background()
    results: dict[str, Any] = header()
    try:
        results["drain"] = drain(server.url, args.records, args.only.split(",") if args.only else None)
    finally:
        server.stop()
    write_results("forwarding", results)


if __name__ == "__main__":
    main()
