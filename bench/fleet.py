"""`forewarn fleet` at the size of issue "Fleet mode, part 1", each figure beside a floor measured in the same run.

The service runs as its own process, as deployed (`python -m forewarn fleet`), from a venv that holds what the
container image installs and nothing else (`.cache/bench-venv-fleet`: `pip install .[<the Dockerfile's
EXTRAS>]`, made on first use and again when pyproject.toml changes; the code run is this checkout's src/, first
on PYTHONPATH). A test venv has more (the `kubernetes` test dependency brings aiohttp, which
azure-storage-queue then imports: +9 MiB that the image never has). It runs with the real ManagedIdentityCredential
against the ARM stand-in over TLS (tests/peers/arm.py, in this process) and the real azure-storage-queue
client against Azurite (tests/azurite, its own node process); records go to a file sink, which this process
tails every 5 ms.

- snapshot: 2,000 open events in 50 subscriptions, each on a scale set of 5 VMs (10,000 VMs), served in
  pages of 1000 rows. The service's own `azure_scheduled_events_reconcile_duration_seconds`, and the time
  from the first query reaching the stand-in (and from the process start) to the 10,000th record in the
  file. Floor: the same paging read by a bare http.client loop over TLS with json.loads, nothing else.
- RSS: VmRSS and VmHWM of the service after the first snapshot (before any scrape has rendered its series),
  after the first scrape that does, after the scrapes below, and while the stream below runs (VmHWM reset
  when it starts). Baseline: the per-VM agent idle (`forewarn run --simulate quiet`, file sink).
- /metrics: sequential scrapes on one kept-alive connection with the 2,000 events (10,000 VM series) open.
  Floor: prometheus_client's own server exposing the same series from a list built in advance.
- latency: a paced stream into the same service's queue (50 messages/s for 30 s, one new event on one VM
  each), the send time in the event's Description; arrival is when the record shows in the file.
- throughput: N messages preloaded (one distinct event each), a fresh service with no Resource Graph
  source; from its start until every record is in the file and the queue is empty. CPU seconds per message of
  the service and of Azurite (utime+stime from /proc/PID/stat across the run), and the rate each would allow
  with a core of its own. Floor: a bare azure-storage-queue receive (32 a page) + delete loop over the same
  N messages on the same Azurite, with the same CPU readings.
- steady stream: a fresh queue-only service while producers keep at most `--depth` (200) messages queued,
  because Azurite slows as its queue deepens (its scans are O(n)): the rate and the CPU per message of both
  processes (Azurite's share includes the sends, whose cost the preload measures alone).

- sizes (`--vms N [N ...]`, only this): the first snapshot at each size, `--runs` times (3; sizes interleaved,
  the median reported), 5 VMs per scale-set event in 50 subscriptions, Resource Graph only, default options unless
  `--metrics-max-vms` is given: the service's Resource Graph read (its reconcile duration metric) and the bare paging
  read of the same pages as floors; first query to the last record in the file; the service's CPU from the first
  query to the last record; RSS before and after the first scrape; the first scrape's time and body (gzip as sent,
  and inflated); then scrapes back to back for 30 s while reconciles every 10 s overlap them, RSS and VmHWM after.

    python bench/fleet.py [--quick]
    python bench/fleet.py --vms 10000 50000 100000 [--runs 3] [--metrics-max-vms N]

Results are printed and written to bench/results/fleet.json (sizes: bench/results/fleet-sizes.json).
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import importlib
import json
import os
import resource
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import requests

from common import (
    BENCH,
    free_port,
    header,
    peak_rss_mib,
    reset_peak_rss,
    rss_mib,
    summary_ms,
    write_results,
)
from peers.arm import ArmPeer
from peers.pki import Authority

# Azurite as the queue tests run it (tests/ is on sys.path through common).
_queue_tests = importlib.import_module("test_fleet_queue")
AZURITE, TestAzurite, count_messages = _queue_tests.AZURITE, _queue_tests.Azurite, _queue_tests.count

#: The payload builders of the fleet tests, importable once common has put tests/ on the path.
samples = importlib.import_module("fleet_samples")
ROOT = BENCH.parent
SERVICE_VENV = ROOT / ".cache" / "bench-venv-fleet"
CLIENT_ID = "00000000-0000-0000-0000-00000000c11d"
RECONCILE_METRIC = "azure_scheduled_events_reconcile_duration_seconds"
SENT = "bench-sent="

SUBSCRIPTIONS = 50
EVENTS = 2000
VMS_PER_EVENT = 5
PAGE_ROWS = 1000


# --- the fleet's data --------------------------------------------------------------------------------------

def subscription(n: int) -> str:
    return str(uuid.UUID(int=0x5B5 << 64 | n))


def snapshot_rows(subscriptions: int, events: int, vms_per_event: int) -> list[dict[str, Any]]:
    """Open events on scale sets, spread evenly over the subscriptions, each acting on `vms_per_event` VMs."""
    rows = []
    for n in range(events):
        sub, rg, name = subscription(n % subscriptions), f"rg-{n % 7}", f"ss-{n:05d}"
        props = samples.properties(event_id=str(uuid.UUID(int=0xE7 << 64 | n)), event_type=("Reboot", "Redeploy",
                           "Freeze")[n % 3], resources=[f"{name}_{k}" for k in range(vms_per_event)])
        info = samples.resource_info(props, samples.target_id("vmss", name, sub=sub, rg=rg))
        rows.append({"id": info["id"], "name": info["name"], "subscriptionId": sub, "resourceGroup": rg,
                     "location": "westeurope", "properties": props})
    return rows


def stream_message(n: int, sent: float, prefix: str) -> str:
    """One Event Grid delivery of a new event on one VM; the send time rides in the Description."""
    name = f"{prefix}-{n:05d}"
    props = samples.properties(event_id=str(uuid.uuid4()), resources=(name,), Description=f"{SENT}{sent:.6f}")
    target = samples.target_id("vm", name, sub=subscription(999), rg="rg-stream")
    return json.dumps(samples.event_grid_event(props, target, f"{prefix}-{n}"))


# --- the service's venv --------------------------------------------------------------------------------------

def image_extras() -> str:
    """The extras the container image installs: the Dockerfile's `ARG EXTRAS=` default."""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("ARG EXTRAS="):
            return line.split("=", 1)[1].strip()
    raise SystemExit("no `ARG EXTRAS=` in the Dockerfile")


def service_venv() -> dict[str, Any]:
    """A venv with forewarn's runtime dependencies as the image installs them, made once per pyproject.toml
    and extras; returns its python and how its packages differ from the benchmark's own interpreter."""
    extras = image_extras()
    key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + extras.encode()).hexdigest()[:16]
    python = SERVICE_VENV / "bin" / "python"
    stamp = SERVICE_VENV / "bench-key"
    if not python.exists() or not stamp.exists() or stamp.read_text() != key:
        shutil.rmtree(SERVICE_VENV, ignore_errors=True)
        print(f"making {SERVICE_VENV} with .[{extras}] (as the image)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(SERVICE_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        f".[{extras}]"], check=True, cwd=ROOT)
        stamp.write_text(key)

    def packages(interpreter: str) -> set[str]:
        listing = subprocess.run([interpreter, "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
                                 check=True, capture_output=True, text=True).stdout
        return {f"{p['name'].lower()}=={p['version']}" for p in json.loads(listing)}

    service, here = packages(str(python)), packages(sys.executable)
    return {"python": str(python), "extras": extras, "packages": len(service),
            "only_in_bench_interpreter": sorted(p.split("==")[0] for p in here - service
                                                if p.split("==")[0] not in {q.split("==")[0] for q in service}),
            "version_differs": sorted(p for p in service - here
                                      if p.split("==")[0] in {q.split("==")[0] for q in here})}


def service_argv(*args: str) -> list[str]:
    return [str(SERVICE_VENV / "bin" / "python"), "-m", "forewarn", *args]


def service_env(**extra: str) -> dict[str, str]:
    """The environment of a service process: this checkout's src/ first, whatever PYTHONPATH said."""
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), **extra}


def proc_cpu(pid: int) -> float:
    """utime + stime of `pid` in seconds (/proc/PID/stat: every thread, ended ones included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def per_message(cpu: float, messages: int) -> dict[str, Any]:
    """CPU per message in ms, and the messages a second that one core of it would allow."""
    if messages <= 0 or cpu <= 0:
        return {"cpu_s": round(cpu, 2), "cpu_ms_per_message": None, "ceiling_per_core_per_s": None}
    return {"cpu_s": round(cpu, 2), "cpu_ms_per_message": round(cpu / messages * 1000, 2),
            "ceiling_per_core_per_s": round(messages / cpu)}


# --- peers and the service ---------------------------------------------------------------------------------

class Azurite(TestAzurite):
    """azurite-queue on a loopback port, started and stopped as tests/test_fleet_queue.py does; queues with the
    benchmark's longer read timeout, and existing ones opened without creating them again."""

    def __init__(self, location: Path) -> None:
        node = shutil.which("node")
        if node is None or not AZURITE.is_file():
            raise SystemExit("Azurite is needed: install Node.js and run `npm ci --prefix tests/azurite`")
        super().__init__(node, location)

    def queue(self, name: str | None = None, create: bool = True) -> Any:
        from azure.storage.queue import QueueClient

        client = QueueClient.from_connection_string(self.connection_string, name or "q" + uuid.uuid4().hex[:12],
                                                    connection_timeout=5, read_timeout=10)
        if name is None and create:
            client.create_queue()
        return client

    def count(self, queue: Any) -> int:
        return count_messages(queue)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


def preload(azurite: Azurite, queue_name: str, total: int, prefix: str) -> dict[str, Any]:
    """`total` messages into the queue from 8 threads: the seconds it took, and Azurite's CPU per send."""
    started, azurite_cpu = time.monotonic(), proc_cpu(azurite.pid)

    def send(part: int) -> None:
        client = azurite.queue(queue_name)
        for n in range(part, total, 8):
            client.send_message(stream_message(n, 0.0, prefix))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(send, range(8)))
    return {"seconds": round(time.monotonic() - started, 1),
            "azurite": per_message(proc_cpu(azurite.pid) - azurite_cpu, total)}


class Tail:
    """The sink's file, read every 5 ms: each complete line with the time it was first seen."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: list[tuple[float, bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tail", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        offset, partial = 0, b""
        while not self._stop.wait(0.005):
            try:
                with self.path.open("rb") as file:
                    file.seek(offset)
                    chunk = file.read()
            except FileNotFoundError:
                continue
            if not chunk:
                continue
            now = time.time()
            offset += len(chunk)
            *complete, partial = (partial + chunk).split(b"\n")
            self.lines.extend((now, line) for line in complete if line.strip())

    def wait_for(self, count: int, timeout: float) -> float | None:
        """The time the `count`th line was seen, or None after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.lines) >= count:
                return self.lines[count - 1][0]
            time.sleep(0.01)
        return None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)


class Fleet:
    """`forewarn fleet` as its own process, with a file sink and its metrics on a loopback port."""

    def __init__(self, tmp: Path, arm: ArmPeer | None, authority: Authority, azurite: Azurite | None,
                 queue_name: str, subscriptions: list[str], reconcile_interval: float,
                 options: tuple[str, ...] = (), on_start: Callable[[int], None] = lambda pid: None) -> None:
        bundle = tmp / "ca.pem"
        bundle.write_bytes(authority.pem)
        self.records_file = tmp / "records.jsonl"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.log = tmp / "fleet.log"
        argv = service_argv("fleet", *[arg for sub in subscriptions for arg in ("--subscription", sub)],
                            "--sink", f"file:{self.records_file}", "--state-dir", str(tmp / "state"),
                            "--listen-address", f"127.0.0.1:{self.port}", "--log-level", "warning", *options)
        env = service_env(REQUESTS_CA_BUNDLE=str(bundle))
        if azurite is not None:  # no queue: the snapshot sizes (Resource Graph only)
            argv += ["--queue-url", f"http://127.0.0.1:{azurite.port}/devstoreaccount1/{queue_name}"]
            env["FOREWARN_QUEUE_CONNECTION_STRING"] = azurite.connection_string
        if arm is not None:
            argv += ["--arm-endpoint", arm.base, "--arm-client-id", CLIENT_ID,
                     "--reconcile-interval", str(reconcile_interval)]
            env["AZURE_POD_IDENTITY_AUTHORITY_HOST"] = arm.base
        self.tail = Tail(self.records_file)
        self.started = time.time()
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log)
        on_start(self.proc.pid)
        self.session = requests.Session()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"forewarn fleet exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                if self.session.get(self.url, timeout=2).status_code == 200:
                    self.ready = time.time()
                    return
            except requests.RequestException:
                time.sleep(0.05)
        raise RuntimeError("forewarn fleet did not serve /metrics within 60 s")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def metric(self, name: str, text: str | None = None) -> float | None:
        text = text if text is not None else self.session.get(self.url, timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return None

    def stop(self) -> int:
        self.tail.stop()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


# --- floors ------------------------------------------------------------------------------------------------

def paging_floor(arm: ArmPeer, authority: Authority, subscriptions: list[str], reads: int) -> dict[str, Any]:
    """The stand-in's full paging read by a bare http.client loop over TLS (one kept-alive connection, the
    query forewarn sends, $skipToken followed, each page through json.loads): the least a snapshot costs."""
    from forewarn.fleet.resourcegraph import DEFAULT_QUERY

    context = ssl.create_default_context(cadata=authority.pem.decode())
    host = urlsplit(arm.base)
    headers = {"Authorization": f"Bearer {arm.token}", "Content-Type": "application/json"}
    path = f"/providers/Microsoft.ResourceGraph/resources?api-version={arm.api_version}"
    times, rows, size = [], 0, 0
    for _ in range(reads):
        started = time.perf_counter()
        conn = http.client.HTTPSConnection(host.hostname or "127.0.0.1", host.port, context=context, timeout=30)
        token, rows, size = None, 0, 0
        for _page in range(100):  # bounded: 2,000 rows are 2 pages
            options: dict[str, Any] = {"$top": PAGE_ROWS, "resultFormat": "objectArray"}
            if token:
                options["$skipToken"] = token
            conn.request("POST", path, json.dumps({"subscriptions": subscriptions, "query": DEFAULT_QUERY,
                                                   "options": options}), headers)
            body = conn.getresponse().read()
            size += len(body)
            page = json.loads(body)
            rows += len(page["data"])
            token = page.get("$skipToken")
            if not token:
                break
        conn.close()
        times.append(time.perf_counter() - started)
    return {"reads": reads, "rows": rows, "bytes": size, "median_s": round(statistics.median(times), 3),
            "min_s": round(min(times), 3), "max_s": round(max(times), 3)}


def queue_floor(azurite: Azurite, total: int, threads: int = 1) -> dict[str, Any]:
    """A bare azure-storage-queue loop over `total` preloaded messages: receive 32 (one page, one request),
    delete each (one after another, or `threads` at once, each thread with its own client); nothing parsed,
    nothing written. The client's CPU is this process's (nothing else runs in it meanwhile)."""
    queue = azurite.queue()
    loaded = preload(azurite, queue.queue_name, total, "floor")
    clients = [azurite.queue(queue.queue_name) for _ in range(threads)]
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    done, started = 0, time.monotonic()
    client_cpu, azurite_cpu = _own_cpu(), proc_cpu(azurite.pid)
    deadline = started + 600
    while done < total and time.monotonic() < deadline:
        page = list(next(queue.receive_messages(messages_per_page=32, max_messages=32,
                                                visibility_timeout=60).by_page(), []))
        if pool is None:
            for message in page:
                queue.delete_message(message)
        else:
            list(pool.map(lambda n, page=page: [clients[n].delete_message(m) for m in page[n::threads]],
                          range(threads)))
        done += len(page)
    seconds = time.monotonic() - started
    client_cpu, azurite_cpu = _own_cpu() - client_cpu, proc_cpu(azurite.pid) - azurite_cpu
    if pool is not None:
        pool.shutdown()
    left = azurite.count(queue)
    queue.delete_queue()
    return {"messages": done, "seconds": round(seconds, 2), "messages_per_s": round(done / seconds, 1),
            "left_in_queue": left, "preload": loaded, "delete_threads": threads,
            "client": per_message(client_cpu, done), "azurite": per_message(azurite_cpu, done)}


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def serve_metrics_floor(port: int, rows_file: str) -> None:
    """(Run as a child.) prometheus_client's own HTTP server with the fleet's two per-VM families built from
    the same rows, label values computed in advance: the exposition cost without forewarn's view."""
    from prometheus_client import start_http_server
    from prometheus_client.core import REGISTRY, GaugeMetricFamily

    scope = ["vm", "vm_scale_set", "resource_group", "subscription_id"]
    info_rows, nb_rows = [], []
    for row in json.loads(Path(rows_file).read_text()):
        props = row["properties"]
        scale_set = row["id"].split("/virtualMachineScaleSets/")[1].split("/")[0]
        for vm in props["Resources"]:
            where = [vm, scale_set, row["resourceGroup"], row["subscriptionId"]]
            info_rows.append([props["EventId"], props["EventType"], props["EventStatus"], props["EventSource"],
                              props["ResourceType"], "true", props["Description"], *where])
            nb_rows.append([props["EventId"], props["EventType"], *where])

    class Collector:
        def collect(self) -> Any:
            info = GaugeMetricFamily("azure_scheduled_event_info", "A scheduled event open for a VM (1).",
                                     labels=["event_id", "event_type", "event_status", "event_source",
                                             "resource_type", "affects_this_vm", "description", *scope])
            not_before = GaugeMetricFamily("azure_scheduled_event_not_before_timestamp_seconds", "NotBefore.",
                                           labels=["event_id", "event_type", *scope])
            for labels in info_rows:
                info.add_metric(labels, 1)
            for labels in nb_rows:
                not_before.add_metric(labels, 1760434200.0)
            yield info
            yield not_before

    REGISTRY.register(Collector())
    start_http_server(port, addr="127.0.0.1")
    signal.sigwait({signal.SIGTERM, signal.SIGINT})


def scrape(url: str, scrapes: int, max_seconds: float,
           keep: Callable[[str], Any] = lambda text: None) -> tuple[dict[str, Any], list[Any]]:
    """`scrapes` sequential scrapes on one kept-alive connection, or as many as fit in `max_seconds`, taking
    gzip as Prometheus does (requests asks for it and inflates, inside the time measured). `keep(text)` of
    each scrape is returned, read after its time is taken; the texts are not kept (11 MB each)."""
    session = requests.Session()
    latencies, kept = [], []
    deadline = time.monotonic() + max_seconds
    series = 0
    for _ in range(scrapes):
        if time.monotonic() > deadline:
            break
        started = time.perf_counter()
        response = session.get(url, timeout=10)
        response.raise_for_status()
        text = response.text
        latencies.append(time.perf_counter() - started)
        kept.append(keep(text))
        series = text.count("\nazure_scheduled_event_info{")
        del text
    return summary_ms(latencies) | {"bytes": len(response.content),
                                    "bytes_sent": int(response.headers.get("Content-Length", len(response.content))),
                                    "content_encoding": response.headers.get("Content-Encoding", ""),
                                    "series": series}, kept


def metrics_floor(rows: list[dict[str, Any]], scrapes: int, max_seconds: float, tmp: Path) -> dict[str, Any]:
    rows_file = tmp / "rows.json"
    rows_file.write_text(json.dumps(rows))
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve-metrics-floor", str(port), str(rows_file)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
                break
            except requests.RequestException:
                time.sleep(0.1)
        result, _ = scrape(f"http://127.0.0.1:{port}/metrics", scrapes, max_seconds)
        return result
    finally:
        proc.terminate()
        proc.wait(10)


def agent_idle_rss(tmp: Path, settle: float) -> dict[str, Any]:
    """The per-VM agent idle, as bench/cost.py and bench/image.py measure it: quiet simulator, file sink."""
    state = tmp / "agent"
    proc = subprocess.Popen(service_argv("run", "--simulate", "quiet", "--listen-address",
                                         f"127.0.0.1:{free_port()}", "--state-dir", str(state), "--sink",
                                         f"file:{state}/records.jsonl"), env=service_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(settle)
        readings = []
        for _ in range(5):
            readings.append(rss_mib(proc.pid))
            time.sleep(1)
        return {"rss_mib": round(statistics.median(readings), 1), "hwm_mib": round(peak_rss_mib(proc.pid), 1),
                "settle_s": settle}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


# --- the measurements --------------------------------------------------------------------------------------

def snapshot_and_stream(tmp: Path, authority: Authority, azurite: Azurite, args: argparse.Namespace,
                        out: dict[str, Any]) -> None:
    subs = [subscription(n) for n in range(SUBSCRIPTIONS)]
    rows = snapshot_rows(SUBSCRIPTIONS, EVENTS, VMS_PER_EVENT)
    vms = EVENTS * VMS_PER_EVENT
    arm = ArmPeer(authority, rows=rows)
    queue = azurite.queue()
    (tmp / "fleet").mkdir()
    fleet = Fleet(tmp / "fleet", arm, authority, azurite, queue.queue_name, subs, args.reconcile_interval)
    try:
        # -- the first snapshot
        last = fleet.tail.wait_for(vms, timeout=120)
        if last is None:
            raise RuntimeError(f"only {len(fleet.tail.lines)} of {vms} records after 120 s")
        with arm.received.lock:
            first_query = arm.received.times[0]
        first_query_wall = time.time() - (time.monotonic() - first_query)
        # RSS once the snapshot has settled, before any scrape has rendered its 10,000 VMs' series, then after
        # the first such scrape (the one that reads the gauge below).
        time.sleep(args.settle)
        before_scrape = (rss_mib(fleet.pid), peak_rss_mib(fleet.pid))
        reconcile = None
        for _ in range(100):  # the gauge is set just after the commit that wrote the records
            reconcile = fleet.metric(RECONCILE_METRIC)
            if reconcile is not None:
                break
            time.sleep(0.05)
        time.sleep(1.0)
        out["snapshot"] = {
            "subscriptions": SUBSCRIPTIONS, "events": EVENTS, "vms": vms, "page_rows": PAGE_ROWS,
            "records": len(fleet.tail.lines), "pages": len(arm.received.times),
            "reconcile_metric_s": reconcile,
            "first_query_to_last_record_s": round(last - first_query_wall, 3),
            "start_to_last_record_s": round(last - fleet.started, 3),
            "start_to_ready_s": round(fleet.ready - fleet.started, 3),
            "reconcile_interval_s": args.reconcile_interval,
        }
        out["rss"] = {"after_snapshot_mib": round(before_scrape[0], 1),
                      "hwm_after_snapshot_mib": round(before_scrape[1], 1),
                      "after_first_scrape_mib": round(rss_mib(fleet.pid), 1),
                      "hwm_after_first_scrape_mib": round(peak_rss_mib(fleet.pid), 1), "settle_s": args.settle}
        print("snapshot:", out["snapshot"], out["rss"], flush=True)

        # -- /metrics with the events open; the gauge read from every scrape gives the later reconciles too
        summary, gauges = scrape(fleet.url, args.scrapes, args.scrape_seconds,
                                 keep=lambda text: fleet.metric(RECONCILE_METRIC, text))
        values = [reconcile]  # each later snapshot shows as a new value of the gauge
        for value in gauges:
            if value is not None and value != values[-1]:
                values.append(value)
        out["metrics"] = summary
        out["rss"]["after_scrapes_mib"] = round(rss_mib(fleet.pid), 1)
        out["rss"]["hwm_after_scrapes_mib"] = round(peak_rss_mib(fleet.pid), 1)
        out["snapshot"]["reconcile_metric_values_s"] = values
        print("metrics:", summary, flush=True)

        # -- the paced stream, RSS sampled meanwhile
        before = len(fleet.tail.lines)
        reset = reset_peak_rss(fleet.pid)
        rss_samples: list[float] = []
        sent: dict[str, float] = {}
        total = int(args.rate * args.stream_seconds)
        start = time.monotonic() + 0.5
        sender = azurite.queue(queue.queue_name)
        for n in range(total):
            due = start + n / args.rate
            while (wait := due - time.monotonic()) > 0:
                time.sleep(min(wait, 0.01))
            stamp = time.time()
            sender.send_message(stream_message(n, stamp, "st"))
            sent[f"{stamp:.6f}"] = stamp
            if n % max(1, int(args.rate / 4)) == 0:
                rss_samples.append(rss_mib(fleet.pid))
        stream_end = time.monotonic()
        # Every stream event's "added" record, each matched by its stamp (other lines arrive too: later
        # snapshots end the stream's events, which they do not list, with "removed" records).
        latencies, arrivals = [], []
        seen, deadline = before, stream_end + args.drain_seconds
        while sent and time.monotonic() < deadline:
            lines = fleet.tail.lines[seen:]
            seen += len(lines)
            for arrived, line in lines:
                if SENT.encode() not in line:
                    continue
                record = json.loads(line)
                stamp = record["data"]["event"]["Description"][len(SENT):]
                if record["data"]["change"] == "added" and stamp in sent:
                    latencies.append(arrived - sent.pop(stamp))
                    arrivals.append(arrived)
            time.sleep(0.05)
        if not latencies:
            raise RuntimeError(f"no stream record within {args.drain_seconds:g} s")
        out["latency"] = summary_ms(latencies) | {
            "rate_per_s": args.rate, "seconds": args.stream_seconds, "sent": total, "missing": len(sent),
            "waited_up_to_s": args.drain_seconds,
            "records_per_s": round((len(arrivals) - 1) / (max(arrivals) - min(arrivals)), 1)
            if len(arrivals) > 1 else None,
            "sending_took_s": round(stream_end - start, 2)}
        out["rss"] |= {"stream_max_rss_mib": round(max(rss_samples), 1), "stream_samples": len(rss_samples),
                       "stream_hwm_mib": round(peak_rss_mib(fleet.pid), 1) if reset else None,
                       "rss_after_stream_mib": round(rss_mib(fleet.pid), 1)}
        print("latency:", out["latency"], out["rss"], flush=True)
        out["snapshot"]["last_reconcile_metric_s"] = fleet.metric(RECONCILE_METRIC)
    finally:
        code = fleet.stop()
        out["exit_code_fleet"] = code
        arm.stop()
    # floors, on the same stand-in data, after the service is gone
    arm = ArmPeer(authority, rows=rows)
    try:
        out["snapshot"]["floor"] = paging_floor(arm, authority, subs, args.floor_reads)
    finally:
        arm.stop()
    print("paging floor:", out["snapshot"]["floor"], flush=True)
    out["metrics"]["floor"] = metrics_floor(rows, args.scrapes, args.scrape_seconds, tmp)
    print("metrics floor:", out["metrics"]["floor"], flush=True)


# --- the snapshot at several sizes (--vms) -------------------------------------------------------------------

METRICS_COMMIT = "azure_scheduled_events_reconcile_commit_duration_seconds"


class CpuAtFirstQuery:
    """The service's CPU seconds when the first Resource Graph query reaches the stand-in (read every 2 ms
    from the process's start): what the service spent before its snapshot began."""

    def __init__(self, arm: ArmPeer) -> None:
        self.arm = arm
        self.cpu: float | None = None
        self._thread: threading.Thread | None = None

    def start(self, pid: int) -> None:
        def watch() -> None:
            deadline = time.monotonic() + 120
            last = 0.0
            while time.monotonic() < deadline:
                with self.arm.received.lock:
                    queried = bool(self.arm.received.times)
                if queried:
                    self.cpu = last
                    return
                try:
                    last = proc_cpu(pid)
                except OSError:
                    return
                time.sleep(0.002)

        self._thread = threading.Thread(target=watch, name="cpu-at-first-query", daemon=True)
        self._thread.start()


def sample_count(text: str) -> int:
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def snapshot_at_size(tmp: Path, authority: Authority, vms: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run at `vms` VMs (scale-set events of VMS_PER_EVENT VMs over SUBSCRIPTIONS subscriptions): the first
    snapshot's cost beside the Resource Graph read of the same run, the first scrape, and the memory while
    scrapes go on and at least one further reconcile overlaps them."""
    events = vms // VMS_PER_EVENT
    subs = [subscription(n) for n in range(SUBSCRIPTIONS)]
    rows = snapshot_rows(SUBSCRIPTIONS, events, VMS_PER_EVENT)
    arm = ArmPeer(authority, rows=rows)
    cpu = CpuAtFirstQuery(arm)
    tmp.mkdir()
    options = ("--metrics-max-vms", str(args.metrics_max_vms)) if args.metrics_max_vms is not None else ()
    fleet = Fleet(tmp, arm, authority, None, "", subs, args.size_reconcile_interval, options, on_start=cpu.start)
    out: dict[str, Any] = {"vms": vms, "events": events, "subscriptions": SUBSCRIPTIONS,
                           "load_average_at_start": os.getloadavg()}
    try:
        last = fleet.tail.wait_for(vms, timeout=120 + vms / 500)
        cpu_end = proc_cpu(fleet.pid)
        if last is None:
            raise RuntimeError(f"only {len(fleet.tail.lines)} of {vms} records")
        with arm.received.lock:
            first_query = arm.received.times[0]
        first_query_wall = time.time() - (time.monotonic() - first_query)
        out["first_query_to_last_record_s"] = round(last - first_query_wall, 3)
        out["service_cpu_snapshot_s"] = round(cpu_end - cpu.cpu, 2) if cpu.cpu is not None else None
        time.sleep(args.settle)
        out["rss_before_scrape_mib"] = round(rss_mib(fleet.pid), 1)
        # the first scrape that renders the open events: as Prometheus asks (gzip)
        session = requests.Session()
        started = time.perf_counter()
        response = session.get(fleet.url, timeout=120)
        text = response.text
        out["first_scrape_s"] = round(time.perf_counter() - started, 3)
        out["metrics_bytes_gzip"] = int(response.headers.get("Content-Length", 0))
        out["metrics_bytes_plain"] = len(response.content)
        out["metrics_samples"] = sample_count(text)
        out["reconcile_metric_s"] = fleet.metric(RECONCILE_METRIC, text)
        out["reconcile_commit_metric_s"] = fleet.metric(METRICS_COMMIT, text)
        out["per_vm_left_out_vms"] = next((float(line.split()[-1]) for line in text.splitlines()
                                           if line.startswith('azure_scheduled_events_per_vm_left_out{unit="vms"}')),
                                          None)
        del text, response
        out["rss_after_first_scrape_mib"] = round(rss_mib(fleet.pid), 1)
        out["hwm_after_first_scrape_mib"] = round(peak_rss_mib(fleet.pid), 1)
        # scrapes back to back while the next reconciles run
        values, scrapes, deadline = {out["reconcile_metric_s"]}, 0, time.monotonic() + args.size_scrape_seconds
        while time.monotonic() < deadline:
            body = session.get(fleet.url, timeout=120).text
            values.add(fleet.metric(RECONCILE_METRIC, body))
            scrapes += 1
            del body
        out["scrapes_after_first"] = scrapes
        out["reconciles_during_scrapes"] = len(values) - 1
        out["rss_after_scrapes_mib"] = round(rss_mib(fleet.pid), 1)
        out["hwm_mib"] = round(peak_rss_mib(fleet.pid), 1)
        out["ratio_to_read"] = round(out["first_query_to_last_record_s"] / out["reconcile_metric_s"], 2) \
            if out["reconcile_metric_s"] else None
    finally:
        out["exit_code"] = fleet.stop()
        arm.stop()
    arm = ArmPeer(authority, rows=rows)
    try:
        out["paging_floor"] = paging_floor(arm, authority, subs, args.floor_reads)
    finally:
        arm.stop()
    out["load_average_at_end"] = os.getloadavg()
    print(f"{vms} VMs:", out, flush=True)
    return out


def sizes(tmp: Path, authority: Authority, args: argparse.Namespace) -> dict[str, Any]:
    """Every size of --vms, --runs times each (sizes interleaved, so a burst of load lands on all of them), and
    the median of each figure per size."""
    runs: dict[int, list[dict[str, Any]]] = {vms: [] for vms in args.vms}
    for run in range(args.runs):
        for vms in args.vms:
            runs[vms].append(snapshot_at_size(tmp / f"size-{vms}-{run}", authority, vms, args))
    result: dict[str, Any] = {}
    for vms, measured in runs.items():
        median: dict[str, Any] = {}
        for key, value in measured[0].items():
            numbers = [m[key] for m in measured if isinstance(m.get(key), (int, float))]
            if numbers and len(numbers) == len(measured) and not isinstance(value, bool):
                median[key] = round(statistics.median(numbers), 3)
        median["paging_floor_median_s"] = round(statistics.median(m["paging_floor"]["median_s"] for m in measured), 3)
        result[str(vms)] = {"median": median, "runs": measured}
    smallest, largest = str(min(args.vms)), str(max(args.vms))
    if smallest != largest:
        low, high = result[smallest]["median"], result[largest]["median"]
        result["growth"] = {key: round(high[key] / low[key], 2) for key in (
            "reconcile_metric_s", "paging_floor_median_s", "first_query_to_last_record_s", "service_cpu_snapshot_s",
            "first_scrape_s", "metrics_bytes_plain", "metrics_bytes_gzip") if low.get(key) and high.get(key)}
    return result


def throughput(tmp: Path, authority: Authority, azurite: Azurite, args: argparse.Namespace) -> dict[str, Any]:
    queue = azurite.queue()
    loaded = preload(azurite, queue.queue_name, args.messages, "tp")
    (tmp / "throughput").mkdir()
    fleet = Fleet(tmp / "throughput", None, authority, azurite, queue.queue_name, [], 0)
    # From ready (nothing read yet: the first receive waits for the ready check's first answer at most) to done.
    service_cpu, azurite_cpu = proc_cpu(fleet.pid), proc_cpu(azurite.pid)
    try:
        last = fleet.tail.wait_for(args.messages, timeout=args.throughput_seconds)
        empty = None
        for _ in range(600 if last is not None else 0):  # the last delete follows the last commit
            if azurite.count(queue) == 0:
                empty = time.time()
                break
            time.sleep(0.05)
        service_cpu, azurite_cpu = proc_cpu(fleet.pid) - service_cpu, proc_cpu(azurite.pid) - azurite_cpu
        lines = list(fleet.tail.lines)
        first = lines[0][0]
        done = max(last, empty or last) if last is not None else time.time()
        # records per second in slices of a fifth of the messages: the rate as the tracker's state grows
        step = max(1, args.messages // 5)
        slices = [round(step / (lines[end - 1][0] - lines[end - step][0]), 1)
                  for end in range(step, len(lines) + 1, step) if lines[end - 1][0] > lines[end - step][0]]
        result = {
            "messages": args.messages, "records": len(lines), "finished": last is not None,
            "queue_empty": empty is not None, "bounded_at_s": args.throughput_seconds,
            "start_to_done_s": round(done - fleet.started, 2), "ready_to_done_s": round(done - fleet.ready, 2),
            "first_to_last_record_s": round(lines[-1][0] - first, 2),
            "messages_per_s": round(len(lines) / (done - fleet.ready), 1),
            "records_per_s_by_fifth": slices, "left_in_queue": azurite.count(queue),
            "service": per_message(service_cpu, len(lines)), "azurite": per_message(azurite_cpu, len(lines)),
            "rss_mib": round(rss_mib(fleet.pid), 1), "hwm_mib": round(peak_rss_mib(fleet.pid), 1),
            "preload": loaded,
        }
    finally:
        result_code = fleet.stop()
    result["exit_code"] = result_code
    print("throughput:", result, flush=True)
    result["floor"] = queue_floor(azurite, args.messages)
    print("queue floor:", result["floor"], flush=True)
    result["floor_parallel"] = queue_floor(azurite, args.messages, threads=8)
    print("queue floor, 8 deletes at once:", result["floor_parallel"], flush=True)
    return result


def steady(tmp: Path, authority: Authority, azurite: Azurite, args: argparse.Namespace) -> dict[str, Any]:
    """A fresh queue-only service fed by 4 producers that keep at most `args.depth` messages queued (sent and
    not yet seen as a record: a record is written before its message is deleted, so the queue holds at most
    that many). The rate and CPU are taken from the 10th to the last percent of the records."""
    queue = azurite.queue()
    (tmp / "steady").mkdir()
    fleet = Fleet(tmp / "steady", None, authority, azurite, queue.queue_name, [], 0)
    total, sent, lock = args.steady_messages, [0], threading.Lock()
    depths: list[int] = []

    def produce() -> None:
        client = azurite.queue(queue.queue_name)
        while True:
            with lock:
                if sent[0] >= total:
                    return
                if sent[0] - len(fleet.tail.lines) >= args.depth:
                    n = None
                else:
                    n = sent[0]
                    sent[0] += 1
            if n is None:
                time.sleep(0.002)
                continue
            client.send_message(stream_message(n, 0.0, "sd"))

    try:
        with ThreadPoolExecutor(4) as pool:
            producers = [pool.submit(produce) for _ in range(4)]
            marks: dict[str, tuple[float, float, float, int]] = {}
            deadline = time.monotonic() + args.throughput_seconds
            while len(fleet.tail.lines) < total and time.monotonic() < deadline:
                seen = len(fleet.tail.lines)
                depths.append(sent[0] - seen)
                for name, at in (("from", total // 10), ("to", total * 9 // 10)):
                    if name not in marks and seen >= at:
                        marks[name] = (time.time(), proc_cpu(fleet.pid), proc_cpu(azurite.pid), seen)
                time.sleep(0.02)
            for producer in producers:
                producer.result(timeout=60)
        lines = list(fleet.tail.lines)
        if "from" not in marks or "to" not in marks:
            return {"messages": total, "records": len(lines), "finished": False}
        (t0, s0, a0, n0), (t1, s1, a1, n1) = marks["from"], marks["to"]
        messages = n1 - n0
        return {"messages": total, "records": len(lines), "finished": len(lines) >= total, "depth_limit": args.depth,
                "depth_max": max(depths), "depth_median": round(statistics.median(depths)),
                "measured_records": messages, "messages_per_s": round(messages / (t1 - t0), 1),
                "service": per_message(s1 - s0, messages),
                "azurite_with_sends": per_message(a1 - a0, messages)}
    finally:
        fleet.stop()


def _commit() -> str:
    described = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    return described.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer scrapes and messages")
    parser.add_argument("--vms", type=int, nargs="+", metavar="N",
                        help="only the first snapshot, its scrapes and memory, at each of these sizes (VMs; scale-set "
                             f"events of {VMS_PER_EVENT} VMs in {SUBSCRIPTIONS} subscriptions); results in "
                             "bench/results/fleet-sizes.json")
    parser.add_argument("--runs", type=int, default=3, help="with --vms: runs of each size (the median is reported)")
    parser.add_argument("--metrics-max-vms", type=int, default=None,
                        help="with --vms: the service's --metrics-max-vms (default: the service's default)")
    parser.add_argument("--serve-metrics-floor", nargs=2, metavar=("PORT", "ROWS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_metrics_floor:
        serve_metrics_floor(int(args.serve_metrics_floor[0]), args.serve_metrics_floor[1])
        return
    args.scrapes = 60 if args.quick else 300
    args.scrape_seconds = 60.0 if args.quick else 150.0
    args.drain_seconds = 90.0 if args.quick else 300.0
    args.throughput_seconds = 120.0 if args.quick else 300.0
    args.rate = 50.0
    args.stream_seconds = 8.0 if args.quick else 30.0
    args.messages = 1000 if args.quick else 5000
    args.steady_messages = 1000 if args.quick else 4000
    args.depth = 200
    args.floor_reads = 3 if args.quick else 10
    args.settle = 2.0 if args.quick else 5.0
    args.reconcile_interval = 30.0
    out: dict[str, Any] = {**header(), "quick": args.quick, "load_average_at_start": os.getloadavg(),
                           "commit": _commit()}
    out["service_venv"] = service_venv()
    print("service venv:", out["service_venv"], flush=True)
    authority = Authority("fleet-bench-ca")
    if args.vms:
        if any(vms < VMS_PER_EVENT or vms % VMS_PER_EVENT for vms in args.vms) or args.runs < 1:
            raise SystemExit(f"--vms: multiples of {VMS_PER_EVENT}; --runs: at least 1")
        args.size_reconcile_interval = 10.0
        args.size_scrape_seconds = 30.0
        args.floor_reads = 3
        args.settle = 2.0
        out |= {"runs": args.runs, "metrics_max_vms": args.metrics_max_vms,
                "reconcile_interval_s": args.size_reconcile_interval, "scrape_seconds": args.size_scrape_seconds}
        with tempfile.TemporaryDirectory() as scratch:
            out["sizes"] = sizes(Path(scratch), authority, args)
        out["load_average_at_end"] = os.getloadavg()
        write_results("fleet-sizes", out)
        return
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        azurite = Azurite(tmp / "azurite")
        try:
            snapshot_and_stream(tmp, authority, azurite, args, out)
            out["throughput"] = throughput(tmp, authority, azurite, args)
            out["load_average_before_steady"] = os.getloadavg()
            out["steady"] = steady(tmp, authority, azurite, args)
            print("steady stream:", out["steady"], flush=True)
        finally:
            azurite.stop()
        out["rss"]["per_vm_agent_idle"] = agent_idle_rss(tmp, 5.0 if args.quick else 15.0)
    out["load_average_at_end"] = os.getloadavg()
    write_results("fleet", out)


if __name__ == "__main__":
    main()
