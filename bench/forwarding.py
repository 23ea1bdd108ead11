"""Forwarding benchmark: backlog drain rate per sink, beside each peer's own ceiling (the memory the sinks add
is in bench/cost.py).

- drain: 100,000 records already waiting in the outbox of a stopped collector; `forewarn run` starts
  and its delivery worker drains them to the sink's local peer (OTLP gRPC, OTLP HTTP, the AMQP 1.0 peer,
  the CloudEvents webhook receiver, the file sink). Rate = records that arrived after the first one /
  seconds from the first to the last record the peer received.
- ceiling: the same peer, fresh, fed the same records by a bare client in its own process, sending
  batches built before the clock starts as fast as the peer takes them (the same client library where
  there is one: grpc with the OTLP request, requests, azure-eventhub's producer with EventDataBatches, raw
  HTTP for the webhook, and for the file its write and fsync per batch). Measured the same way, so
  "forewarn / ceiling" says how much of the drain is forewarn and how much the peer.

    python bench/forwarding.py [--records 100000] [--only webhook,file] [--collector-src DIR]

`--collector-src` runs the collector from another source tree (e.g. `git archive` of an older commit's
src/) under the same harness, for a same-run comparison with the code before a change.

Results are printed and written to bench/results/forwarding.json. The peers run in this process,
the collector and the bare clients each in their own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from forewarn.imds.document import parse_document
from forewarn.imds.instance import VmInfo
from forewarn.outbox.outbox import Outbox
from forewarn.records import JsonRecords, to_record
from forewarn.simulator import Simulator, SimulatorServer, load_scenario
from forewarn.tracker import diff_documents

# common also puts tests/ (the peers) on sys.path
from common import Collector, cpu_seconds, header, peak_rss_mib, rss_mib, write_results
from peers.amqp import AmqpPeer
from peers.notify import NotifyPeer
from peers.otlp import GrpcReceiver, HttpReceiverServer

VM = VmInfo(name="vm-0", vm_id="4d1824cf-fdc0-5660-b82f-b2a54105ac90", location="westeurope",
            resource_id="/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/vm-0")
CASES = ("otlp-grpc", "otlp-http", "eventhubs", "webhook", "file")
#: The records per batch of each sink (what its bare client sends at once too); the webhook posts one.
BATCHES = {"otlp-grpc": 500, "otlp-http": 500, "eventhubs": 500, "webhook": 1, "file": 2000}


def record_texts(count: int) -> list[str]:
    """`count` records as the outbox stores them: one `added` record per new event, each its own document."""
    texts = []
    now = datetime.now(timezone.utc)
    for i in range(count):
        document = parse_document({"DocumentIncarnation": i + 1, "Events": [{
            "EventId": f"BENCH-{i:06d}", "EventType": "Reboot", "ResourceType": "VirtualMachine",
            "Resources": ["vm-0", "vm-1"], "EventStatus": "Scheduled", "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT",
            "Description": "Host server is undergoing maintenance.", "EventSource": "Platform",
            "DurationInSeconds": -1}]})
        (change,) = diff_documents(None, document)
        texts.append(to_record(change, VM, now).to_json())
    return texts


def backlog(state_dir: Path, sink: str, texts: Sequence[str]) -> None:
    outbox = Outbox(state_dir, [sink], max_records=max(len(texts), 100_000))
    outbox.append(JsonRecords(texts))
    outbox.close()


def wait_count(count_fn: Callable[[], int], target: int, timeout: float,
               on_first: Callable[[], None] = lambda: None) -> tuple[float, int, float]:
    """Time (monotonic) of the first records seen, how many those were, and the time of the target count;
    `on_first` is called when the first records are seen."""
    first: float | None = None
    first_count = 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = count_fn()
        if n and first is None:
            first, first_count = time.monotonic(), n
            on_first()
        if n >= target:
            return first or time.monotonic(), first_count, time.monotonic()
        time.sleep(0.005)
    raise RuntimeError(f"only {count_fn()} of {target} records arrived")


def rate(records: int, first: float, first_count: int, last: float) -> float:
    """Records per second after the first arrival (those that came with it took time before the clock)."""
    return (records - first_count) / max(last - first, 1e-9)


class FileCounter:
    """Lines in a growing file, read incrementally (re-reading 100 MB every 5 ms would load the machine)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.lines = 0

    def __call__(self) -> int:
        if not self.path.exists():
            return 0
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        self.offset += len(data)
        self.lines += data.count(b"\n")
        return self.lines


def peer_for(name: str, tmp: Path) -> tuple[Any, str, dict[str, str], str, Callable[[], int]]:
    """A fresh peer for the case: the peer, the sink spec, the collector's environment, the bare client's
    target, and the count of records the peer received."""
    if name.startswith("otlp"):
        peer: Any = GrpcReceiver() if name == "otlp-grpc" else HttpReceiverServer()
        env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc" if name == "otlp-grpc" else "http/protobuf",
               "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": peer.endpoint}

        def count_logs(p: Any = peer) -> int:
            with p.received.lock:
                requests = list(p.received.requests)
            return sum(len(sl.log_records) for r in requests for rl in r.resource_logs for sl in rl.scope_logs)
        return peer, "otlp", env, peer.endpoint, count_logs
    if name == "eventhubs":
        peer = AmqpPeer()

        def count_messages(p: Any = peer) -> int:
            with p.received.lock:
                return len(p.received.messages)
        return (peer, "eventhubs", {"FOREWARN_EVENTHUBS_CONNECTION_STRING": peer.connection_string},
                peer.connection_string, count_messages)
    if name == "webhook":  # one CloudEvent per POST, parsed by the SDK in the receiver
        peer = NotifyPeer("cloudevents")

        def count_accepted(p: Any = peer) -> int:
            with p.received.lock:
                return len(p.received.accepted)
        return peer, "webhook", {"FOREWARN_WEBHOOK_URL": peer.url}, peer.url, count_accepted
    out = tmp / f"records-{time.monotonic_ns()}.jsonl"
    return None, f"file:{out}", {}, str(out), FileCounter(out)


def stop_peer(peer: Any) -> None:
    if peer is not None:
        peer.stop()


def drain_case(name: str, sim_url: str, texts: Sequence[str], tmp: Path, collector_src: str | None) -> dict[str, Any]:
    state = tmp / f"state-{name}"
    state.mkdir()
    peer, sink, env, _, count = peer_for(name, tmp)
    try:
        backlog(state, sink, texts)
        started = time.monotonic()
        if collector_src:
            env = {**env, "PYTHONPATH": collector_src}
        collector = Collector(sim_url, state, sinks=[sink], env=env, wait=False,
                              extra=["--outbox-max-records", str(max(len(texts), 100_000))])
        try:
            cpu_at_first: list[float] = []
            first, first_count, last = wait_count(count, len(texts), timeout=900,
                                                  on_first=lambda: cpu_at_first.append(cpu_seconds(collector.pid)))
            # The agent's CPU per record while it drained (all its threads), and its memory with this sink:
            # at its most (during the drain) and just after it.
            cpu = cpu_seconds(collector.pid) - cpu_at_first[0]
            rss = {"cpu_us_per_record": round(cpu / max(len(texts) - first_count, 1) * 1e6, 1),
                   "rss_after_drain_mib": round(rss_mib(collector.pid), 1),
                   "peak_rss_mib": round(peak_rss_mib(collector.pid), 1)}
        finally:
            collector.stop()
    finally:
        stop_peer(peer)
    return {"records": len(texts), "records_per_s": rate(len(texts), first, first_count, last),
            "seconds_from_start": last - started, **rss}


def ceiling_case(name: str, texts_file: Path, records: int, tmp: Path) -> float:
    """The peer's own ceiling: a bare client in its own process sends the records as fast as it takes them."""
    peer, _, _, target, count = peer_for(name, tmp)
    try:
        client = subprocess.Popen([sys.executable, __file__, "--bare-client", name, "--target", target,
                                   "--input", str(texts_file), "--batch", str(BATCHES[name])])
        try:
            first, first_count, last = wait_count(count, records, timeout=900)
        finally:
            if client.wait(60) != 0:
                raise RuntimeError(f"the bare {name} client failed ({client.returncode})")
    finally:
        stop_peer(peer)
    return rate(records, first, first_count, last)


def drain(sim_url: str, records: int, only: list[str] | None = None,
          collector_src: str | None = None) -> dict[str, Any]:
    results: dict[str, Any] = {}
    texts = record_texts(records)
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        texts_file = tmp / "records.jsonl"
        texts_file.write_text("".join(text + "\n" for text in texts))
        for name in CASES:
            if only and name not in only:
                continue
            results[name] = drain_case(name, sim_url, texts, tmp, collector_src)
            results[name]["peer_ceiling_per_s"] = ceiling_case(name, texts_file, records, tmp)
            results[name]["batch"] = BATCHES[name]
            print(name, json.dumps(results[name]), flush=True)
    return results


# --- the bare clients (each run in its own process by ceiling_case) ---------------------------------------
def batches(texts: Sequence[str], size: int) -> list[Sequence[str]]:
    return [texts[i:i + size] for i in range(0, len(texts), size)]


def bare_client(name: str, target: str, texts: list[str], size: int) -> None:
    records = JsonRecords(texts)
    if name.startswith("otlp"):
        from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

        from forewarn.sinks.otlp import _SCOPE, _log_fields, resource_for
        from forewarn.sinks.otlpwire import encode_request

        resource = resource_for(dict(records[0].data["vm"]))
        # the request objects a client of the generated stub sends (the collector sends the same bytes as bytes)
        requests_ = [ExportLogsServiceRequest.FromString(encode_request(
            [(resource, [_log_fields(records[i]) for i in range(start, start + len(part))])], _SCOPE))
            for start, part in zip(range(0, len(texts), size), batches(texts, size), strict=True)]
        if name == "otlp-grpc":
            import grpc
            from opentelemetry.proto.collector.logs.v1.logs_service_pb2_grpc import LogsServiceStub

            stub = LogsServiceStub(grpc.insecure_channel(target.removeprefix("http://")))
            for request in requests_:
                stub.Export(request, timeout=30)
            return
        import requests

        bodies = [request.SerializeToString() for request in requests_]
        with requests.Session() as session:
            for body in bodies:
                session.post(target, data=body, headers={"Content-Type": "application/x-protobuf"},
                             timeout=30).raise_for_status()
        return
    if name == "eventhubs":
        from azure.eventhub import EventHubProducerClient

        from forewarn.sinks.eventhubs import partition_key, to_event

        client = EventHubProducerClient.from_connection_string(target)
        built = []
        for start in range(0, len(texts), size):
            batch = client.create_batch(partition_key=partition_key(records[start]))
            for i in range(start, min(start + size, len(texts))):
                batch.add(to_event(records[i]))
            built.append(batch)
        for batch in built:
            client.send_batch(batch)
        client.close()
        return
    if name == "webhook":
        import http.client
        from urllib.parse import urlsplit

        url = urlsplit(target)
        path = url.path + (f"?{url.query}" if url.query else "")
        connection = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port)
        bodies = [text.encode() for text in texts]
        for body in bodies:
            connection.request("POST", path, body=body,
                               headers={"Content-Type": "application/cloudevents+json; charset=utf-8"})
            response = connection.getresponse()
            response.read()
            if response.status >= 300:
                raise RuntimeError(f"webhook peer answered {response.status}")
        return
    data = [("".join(text + "\n" for text in part)).encode() for part in batches(texts, size)]
    for chunk in data:  # as the file sink writes: open, append, fsync, per batch
        with open(target, "ab") as handle:
            handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--only", help="comma-separated cases to run (default: all)")
    parser.add_argument("--collector-src", help="run the collector from this source tree (a same-run baseline)")
    parser.add_argument("--bare-client", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--input", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_client:
        bare_client(args.bare_client, args.target, Path(args.input).read_text().splitlines(), args.batch)
        return
    sim = Simulator(load_scenario("tour"), speed=20)
    server = SimulatorServer(sim).serve_in_background()
    results: dict[str, Any] = header()
    try:
        results["drain"] = drain(server.url, args.records, args.only.split(",") if args.only else None,
                                 args.collector_src)
        if args.collector_src:
            results["collector_src"] = args.collector_src
    finally:
        server.stop()
    write_results("forwarding-baseline" if args.collector_src else "forwarding", results)


if __name__ == "__main__":
    main()
