"""Steady-state cost and scrape cost, each beside the baseline polling loop (bench/baseline.py).

- steady state: CPU per IMDS poll (every thread of the process, from /proc schedstat) and resident
  memory, with nothing but polling, at 1 and 5 polls/s; forewarn with Prometheus only, with the file
  sink, and with every sink configured (file, stdout, OTLP gRPC to a local receiver, Event Hubs to the
  local AMQP 1.0 peer); the baseline at the same rates. Polls are counted at the simulator.
- changing document: the same, with the file sink and the baseline, when every poll brings a new document
  (an event appears at one poll and is gone at the next, so each poll is one change: a record spooled,
  delivered to the file and acknowledged; for the baseline, the events printed).
- scrape: /metrics latency with 0, 10, 100 and 1,000 events (sequential scrapes on one kept-alive
  connection, as Prometheus scrapes, by a raw-socket client whose own cost is small: `requests` added about
  1 ms to each, and reading into a buffer it keeps saved 50-80 µs of its own), beside a floor measured by
  the same client in the same run: a bare single-threaded server answering the same 100-event exposition
  from memory; then the collector and the floor in turns, scrape by scrape, so that both see the same
  moments of the machine. Each series starts once the change that
  brought its events is delivered (every sink's outbox empty), so it times scrapes, not scrapes sharing
  the collector with the spooling and delivery of a hundred records. Then 50 scrapers with
  100 events, each scraping once a second and all at the same moment (50 requests at once, every
  second), while the poll cadence is measured at the simulator (jitter = how far each gap between
  polls is from the interval).

    python bench/cost.py [--quick] [--only steady|changing|scrape]

Results are printed and written to bench/results/cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests

from forewarn.simulator import Simulator, SimulatorServer, load_scenario

from common import BENCH, Collector, cpu_seconds, header, percentile, rss_mib, summary_ms, write_results
from peers.amqp import AmqpPeer
from peers.otlp import GrpcReceiver

WARMUP = 5.0
#: With network sinks, measure once they have gone quiet (their workers release idle connections after
#: 30 s), which is how a VM spends nearly all of its time.
SINK_WARMUP = 40.0


def polls_by(sim: Simulator, prefix: str) -> int:
    with sim._lock:
        return sum(len(stamps) for caller, stamps in sim.request_times.items() if caller.startswith(prefix))


def measure(sim: Simulator, pid: int, prefix: str, seconds: float, warmup: float = WARMUP) -> dict[str, Any]:
    time.sleep(warmup)
    cpu0, polls0 = cpu_seconds(pid), polls_by(sim, prefix)
    time.sleep(seconds)
    cpu1, polls1 = cpu_seconds(pid), polls_by(sim, prefix)
    polls = polls1 - polls0
    return {"polls": polls, "polls_per_s": round(polls / seconds, 2),
            "cpu_ms_per_poll": round((cpu1 - cpu0) * 1000 / max(polls, 1), 3),
            "cpu_percent_of_a_core": round((cpu1 - cpu0) * 100 / seconds, 3), "rss_mib": round(rss_mib(pid), 1)}


def steady(interval: float, seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cases = {"prometheus_only": [], "file_sink": ["file"], "every_sink": ["file", "stdout", "otlp", "eventhubs"]}
    for name, kinds in cases.items():
        sim = Simulator(load_scenario("quiet"))
        server = SimulatorServer(sim).serve_in_background()
        otlp, amqp = GrpcReceiver(), AmqpPeer()
        with tempfile.TemporaryDirectory() as tmp:
            sinks = [f"file:{tmp}/records.jsonl" if kind == "file" else kind for kind in kinds]
            env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": otlp.endpoint,
                   "FOREWARN_EVENTHUBS_CONNECTION_STRING": amqp.connection_string}
            collector = Collector(server.url, Path(tmp) / "state", interval, sinks=sinks, env=env)
            try:
                out[name] = measure(sim, collector.pid, "forewarn/", seconds,
                                    SINK_WARMUP if "otlp" in kinds else WARMUP)
            finally:
                collector.stop()
                otlp.stop()
                amqp.stop()
                server.stop()
        print(f"{interval:g} s {name}: {out[name]}", flush=True)
    out["baseline"] = baseline(Simulator(load_scenario("quiet")), interval, seconds)
    print(f"{interval:g} s baseline: {out['baseline']}", flush=True)
    base = out["baseline"]["cpu_ms_per_poll"]
    for name in cases:
        out[name]["cpu_vs_baseline"] = round(out[name]["cpu_ms_per_poll"] / base, 3)
    return out


def baseline(sim: Simulator, interval: float, seconds: float) -> dict[str, Any]:
    """The documented polling loop (bench/baseline.py) against `sim`: CPU per poll and RSS."""
    server = SimulatorServer(sim).serve_in_background()
    proc = subprocess.Popen([sys.executable, str(BENCH / "baseline.py"), server.url, "--interval", str(interval)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return measure(sim, proc.pid, "python-requests/", seconds)
    finally:
        proc.kill()
        proc.wait()
        server.stop()


class ChangingSimulator(Simulator):
    """Every Scheduled Events reply a new document: an event is added for one reply and gone at the next
    (removed while Scheduled: cancelled), so each poll brings exactly one change."""

    def __init__(self) -> None:
        super().__init__(load_scenario("quiet"))
        self._open: str | None = None

    def document(self, api_version: str) -> dict[str, Any]:
        with self._lock:
            if self._open is None:
                self._open = self.inject({"type": "Reboot", "notice": 900,
                                          "description": "Host server is undergoing maintenance."})
            else:
                self.remove(self._open)
                self._open = None
            return super().document(api_version)


def changing(interval: float, seconds: float) -> dict[str, Any]:
    """CPU per poll when every poll changes the document: forewarn with the file sink, and the baseline."""
    out: dict[str, Any] = {}
    sim = ChangingSimulator()
    server = SimulatorServer(sim).serve_in_background()
    with tempfile.TemporaryDirectory() as tmp:
        collector = Collector(server.url, Path(tmp) / "state", interval, sinks=[f"file:{tmp}/records.jsonl"])
        try:
            out["file_sink"] = measure(sim, collector.pid, "forewarn/", seconds)
        finally:
            collector.stop()
            server.stop()
        with open(f"{tmp}/records.jsonl", "rb") as records:
            out["file_sink"]["records"] = sum(1 for _ in records)
    print(f"{interval:g} s changing, file sink: {out['file_sink']}", flush=True)
    out["baseline"] = baseline(ChangingSimulator(), interval, seconds)
    print(f"{interval:g} s changing, baseline: {out['baseline']}", flush=True)
    ours, base = out["file_sink"], out["baseline"]
    ours["cpu_vs_baseline"] = round(ours["cpu_ms_per_poll"] / base["cpu_ms_per_poll"], 3)
    return out


def fill(sim: Simulator, collector: Collector, events: int) -> None:
    for event in sim.current()[1]:
        sim.remove(event["EventId"])
    for i in range(events):
        sim.inject({"id": f"SCRAPE-{events}-{i:04d}", "type": random.choice(["Reboot", "Redeploy", "Freeze"]),
                    "notice": 900, "description": "Host server is undergoing maintenance."})
    deadline = time.monotonic() + 20
    while True:
        text = requests.get(collector.url + "/metrics").text
        # Visible, and their records (and those of the events removed) delivered: timed from then on, a
        # scrape does not share the collector with the change's spooling and delivery.
        if text.count("azure_scheduled_event_info{") == events and not any(
                float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("azure_scheduled_events_outbox_records{")):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{events} events not visible, or their records not delivered")
        time.sleep(0.1)
    time.sleep(0.5)  # the delivery worker's last steps after the acknowledgement (the sink told it is idle)


class KeptAlive:
    """GET /metrics again and again on one connection: the time from sending the request to the last byte
    of the body. The client's own cost is kept small, and out of the time where it can be: replies are read
    into one buffer it keeps (`recv(1 << 20)` allocated and trimmed a megabyte at every read), and the body
    is copied out after the time is taken."""

    def __init__(self, port: int) -> None:
        self._sock = socket.create_connection(("127.0.0.1", port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._request = f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAccept: text/plain\r\n\r\n".encode()
        self._buffer = bytearray(1 << 20)
        self._filled = 0  # bytes read into the buffer and not yet taken

    def get(self) -> tuple[float, bytes]:
        started = time.perf_counter()
        self._sock.sendall(self._request)
        while (end := self._buffer.find(b"\r\n\r\n", 0, self._filled)) < 0:
            self._receive(self._filled + 1)
        head = bytes(self._buffer[:end]).decode("latin-1").lower()
        length = int(head.split("content-length:", 1)[1].split("\r\n", 1)[0])
        total = end + 4 + length
        while self._filled < total:
            self._receive(total)
        seconds = time.perf_counter() - started
        body = bytes(self._buffer[end + 4:total])
        rest = self._filled - total  # nothing, unless the server sent more than asked for
        self._buffer[:rest] = self._buffer[total:self._filled]
        self._filled = rest
        return seconds, body

    def _receive(self, need: int) -> None:
        if len(self._buffer) < need:
            self._buffer.extend(bytes(need - len(self._buffer)))
        if len(self._buffer) - self._filled < 65536:
            self._buffer.extend(bytes(65536))
        with memoryview(self._buffer) as view:
            received = self._sock.recv_into(view[self._filled:])
        if not received:
            raise ConnectionError("the server closed the connection")
        self._filled += received

    def close(self) -> None:
        self._sock.close()


def sequential(port: int, scrapes: int) -> dict[str, Any]:
    client = KeptAlive(port)
    try:
        latencies = []
        body = b""
        for _ in range(scrapes):
            seconds, body = client.get()
            latencies.append(seconds)
    finally:
        client.close()
    return summary_ms(latencies) | {"bytes": len(body)}


def serve_floor(port_file: str, body_file: str) -> None:
    """(Run as a child.) The floor: one thread, one connection at a time, the same reply from memory."""
    body = Path(body_file).read_bytes()
    head = f"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {len(body)}\r\n\r\n"
    reply = head.encode() + body
    listener = socket.create_server(("127.0.0.1", 0))
    Path(port_file).write_text(str(listener.getsockname()[1]))
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pending = b""
        while data := conn.recv(65536):
            pending += data
            while b"\r\n\r\n" in pending:
                pending = pending.split(b"\r\n\r\n", 1)[1]
                conn.sendall(reply)
        conn.close()


@contextlib.contextmanager
def floor_server(body: bytes) -> Iterator[int]:
    """The floor server (serve_floor) as a child answering `body`; yields its port."""
    with tempfile.TemporaryDirectory() as tmp:
        body_file, port_file = Path(tmp) / "body", Path(tmp) / "port"
        body_file.write_bytes(body)
        child = subprocess.Popen([sys.executable, __file__, "--serve-floor", str(port_file), str(body_file)])
        try:
            deadline = time.monotonic() + 10
            while not port_file.exists() or not port_file.read_text():
                if time.monotonic() > deadline:
                    raise RuntimeError("the floor server did not start")
                time.sleep(0.02)
            yield int(port_file.read_text())
        finally:
            child.kill()
            child.wait()


def floor(body: bytes, scrapes: int) -> dict[str, Any]:
    with floor_server(body) as port:
        return sequential(port, scrapes)


def alternating(port: int, floor_port: int, scrapes: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Scrapes of the collector and of the floor in turns, one each, on a kept-alive connection each: both
    series see the same moments of the machine, which a 2-vCPU VM makes slower now and then for tens of ms."""
    ours, bare = KeptAlive(port), KeptAlive(floor_port)
    try:
        mine: list[float] = []
        theirs: list[float] = []
        body = b""
        for _ in range(scrapes):
            seconds, body = ours.get()
            mine.append(seconds)
            theirs.append(bare.get()[0])
    finally:
        ours.close()
        bare.close()
    return summary_ms(mine) | {"bytes": len(body)}, summary_ms(theirs)


async def _scraper(host: str, port: int, rounds: int, latencies: list[float]) -> None:
    """One Prometheus-like scraper on its own kept-alive connection, scraping at the start of every second
    (all scrapers in phase: the worst alignment for the collector)."""
    reader, writer = await asyncio.open_connection(host, port)
    request = f"GET /metrics HTTP/1.1\r\nHost: {host}:{port}\r\nAccept: text/plain\r\n\r\n".encode()
    try:
        for _ in range(rounds):
            await asyncio.sleep(1 - time.time() % 1)
            started = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            await reader.readexactly(length)
            latencies.append(time.perf_counter() - started)
    finally:
        writer.close()


def concurrent(collector: Collector, scrapers: int, seconds: float) -> list[float]:
    latencies: list[float] = []

    async def run() -> None:
        rounds = int(seconds)
        await asyncio.gather(*(_scraper("127.0.0.1", collector.port, rounds, latencies) for _ in range(scrapers)))

    asyncio.run(run())
    return latencies


def jitter(sim: Simulator, since: float, interval: float) -> dict[str, Any]:
    with sim._lock:
        stamps = sorted(t for caller, times in sim.request_times.items() if caller.startswith("forewarn/")
                        for t in times if t >= since)
    gaps = [abs((b - a) - interval) for a, b in itertools.pairwise(stamps)]
    return {"polls": len(stamps), "p50_ms": round(percentile(gaps, 50) * 1000, 2),
            "p99_ms": round(percentile(gaps, 99) * 1000, 2), "max_ms": round(max(gaps) * 1000, 2)}


def scrape(scrapes: int, seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    sim = Simulator(load_scenario("quiet"))
    server = SimulatorServer(sim).serve_in_background()
    with tempfile.TemporaryDirectory() as tmp:
        collector = Collector(server.url, Path(tmp) / "state", 1.0, sinks=[f"file:{tmp}/records.jsonl"])
        try:
            for events in (0, 10, 100, 1000):
                fill(sim, collector, events)
                out[f"{events}_events"] = sequential(collector.port, scrapes)
                print(f"scrape, {events} events: {out[f'{events}_events']}", flush=True)
            fill(sim, collector, 100)
            _, body = KeptAlive(collector.port).get()
            out["floor_100_events"] = floor(body, scrapes)
            out["100_events_again"] = sequential(collector.port, scrapes)  # after the floor: the same moment
            print(f"floor: {out['floor_100_events']}; 100 events again: {out['100_events_again']}", flush=True)
            with floor_server(body) as floor_port:
                ours, bare = alternating(collector.port, floor_port, scrapes)
            out["100_events_alternating_with_the_floor"] = ours
            out["floor_alternating"] = bare
            print(f"100 events, alternating with the floor: {ours}; the floor: {bare}", flush=True)
            time.sleep(2)
            quiet_from = time.time()
            time.sleep(seconds)
            out["poll_jitter_without_scrapes"] = jitter(sim, quiet_from, 1.0)
            busy_from = time.time()
            latencies = concurrent(collector, 50, seconds)
            out["50_scrapers_100_events"] = summary_ms(latencies) | {
                "scrapers": 50, "rounds": int(seconds)}
            out["poll_jitter_under_50_scrapers"] = jitter(sim, busy_from, 1.0)
            print(f"50 scrapers: {out['50_scrapers_100_events']}, jitter {out['poll_jitter_under_50_scrapers']}",
                  flush=True)
        finally:
            collector.stop()
            server.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter runs, for a smoke check")
    parser.add_argument("--serve-floor", nargs=2, metavar=("PORT_FILE", "BODY_FILE"), help=argparse.SUPPRESS)
    parser.add_argument("--only", choices=["steady", "changing", "scrape"],
                        help="run one part (steady: CPU per poll and RSS; changing: CPU per poll when every poll "
                             "changes the document; scrape: /metrics and cadence)")
    args = parser.parse_args()
    if args.serve_floor:
        serve_floor(*args.serve_floor)
        return
    random.seed(5)
    seconds, scrapes, busy = (10.0, 200, 8.0) if args.quick else (60.0, 2000, 30.0)
    results: dict[str, Any] = header()
    if args.only in (None, "steady"):
        results["steady_1_poll_per_s"] = steady(1.0, seconds)
        results["steady_5_polls_per_s"] = steady(0.2, seconds / 2)
    if args.only in (None, "changing"):
        results["changing_1_poll_per_s"] = changing(1.0, seconds)
    if args.only in (None, "scrape"):
        results["scrape"] = scrape(scrapes, busy)
    # a partial run gets its own file, so that report.py never reads half a result as the whole
    write_results("cost" if args.only is None else f"cost-{args.only}", results)


if __name__ == "__main__":
    main()
