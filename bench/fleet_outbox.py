"""Issue #38's loss case: `forewarn fleet` at 200,000 VMs with a sink that refuses for a minute, then recovers.

The service runs as its own process (`python -m forewarn fleet`, this checkout's src/) with the default outbox
bound (--outbox-max-records 100,000, half the snapshot's records), Resource Graph through the strict TLS
stand-in (tests/peers/arm.py, in this process: 40,000 open events in 50 subscriptions, each on a scale set of
5 VMs, pages of 1000 rows) with the real ManagedIdentityCredential, and two sinks: a file, and a CloudEvents
webhook (the stand-in of tests/peers/notify.py) that answers 503 to every post for `--refuse` seconds (60) from
the service's first query, then takes them. The webhook sink posts one record per request, so it is the slow
one, as a Slack or Teams sink is.

What it reports: whether every VM's `added` record reached both sinks exactly once (by record id; none dropped:
azure_scheduled_events_outbox_dropped_records_total), the outbox's peak (stored records, the database's size with
its write-ahead log, the service's RSS), a record's JSON size, the commits refused, the Resource Graph pages and
snapshots read, and the times from the first query to the first refusal and to the last record at the webhook.

    python bench/fleet_outbox.py [--vms 200000] [--refuse 60] [--max-records 100000]

Results are printed and written to bench/results/fleet-outbox.json. The exit status is 1 (with the counts on
stderr) when any record is missing from a sink or reached one twice.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import requests

from common import BENCH, free_port, header, rss_mib, write_results
from peers.arm import ArmPeer
from peers.notify import NotifyPeer
from peers.pki import Authority

ROOT = BENCH.parent
SUBSCRIPTIONS = [str(uuid.UUID(int=n + 1)) for n in range(50)]
VMS_PER_EVENT = 5
CLIENT_ID = "00000000-0000-0000-0000-00000000c11d"


def rows(events: int) -> list[dict[str, Any]]:
    out = []
    for n in range(events):
        sub = SUBSCRIPTIONS[n % len(SUBSCRIPTIONS)]
        event_id = str(uuid.UUID(int=1_000_000 + n))
        target = (f"/subscriptions/{sub}/resourceGroups/rg-{n % 7}/providers/Microsoft.Compute/"
                  f"virtualMachineScaleSets/ss-{n}")
        out.append({
            "id": f"{target}/providers/Microsoft.Maintenance/scheduledevents/{event_id}", "name": event_id,
            "subscriptionId": sub, "resourceGroup": f"rg-{n % 7}", "location": "westeurope",
            "properties": {"EventId": event_id, "EventType": "Reboot", "EventStatus": "Scheduled",
                           "ResourceType": "VirtualMachineScaleSet", "NotBefore": "Mon, 30 Nov 2026 12:00:00 GMT",
                           "Resources": [f"ss-{n}_{i}" for i in range(VMS_PER_EVENT)], "Description": "",
                           "EventSource": "Platform", "DurationInSeconds": -1}})
    return out


def sample(text: str, family: str) -> float:
    match = re.search(rf"^{family} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else float("nan")


def main() -> int | str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vms", type=int, default=200_000, help="VMs with an open event (5 per scale-set event)")
    parser.add_argument("--refuse", type=float, default=60.0, help="seconds the webhook refuses every post")
    parser.add_argument("--max-records", type=int, default=100_000, help="--outbox-max-records")
    parser.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds")
    args = parser.parse_args()
    events = args.vms // VMS_PER_EVENT
    vms = events * VMS_PER_EVENT

    authority = Authority("fleet-outbox-bench-ca")
    arm = ArmPeer(authority, rows=rows(events))
    endpoint = NotifyPeer("cloudevents")   # tests/peers/notify.py: parses each post with the CloudEvents SDK
    endpoint.received.down = True            # 503 to every post, until the recovery below
    work = Path(tempfile.mkdtemp(prefix="fleet-outbox-"))
    bundle = work / "ca.pem"
    bundle.write_bytes(authority.pem)
    records_file = work / "records.jsonl"
    database = work / "state" / "forewarn.sqlite"
    port = free_port()
    argv = [sys.executable, "-m", "forewarn", "fleet", "--sink", f"file:{records_file}", "--sink", "webhook",
            "--state-dir", str(work / "state"), "--listen-address", f"127.0.0.1:{port}",
            "--outbox-max-records", str(args.max_records), "--arm-endpoint", arm.base, "--arm-client-id", CLIENT_ID,
            "--arm-timeout", "60", "--reconcile-interval", "30",
            *[arg for sub in SUBSCRIPTIONS for arg in ("--subscription", sub)]]
    env = {**os.environ, "REQUESTS_CA_BUNDLE": str(bundle), "AZURE_POD_IDENTITY_AUTHORITY_HOST": arm.base,
           "FOREWARN_WEBHOOK_URL": endpoint.url, "PYTHONPATH": str(ROOT / "src")}
    log = (work / "fleet.log").open("wb")
    started = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log)
    peak = {"stored": 0.0, "database_bytes": 0, "rss_mib": 0.0}
    first_refusal = None
    metrics = ""
    try:
        while not arm.received.queries:
            if proc.poll() is not None or time.monotonic() - started > 60:
                raise SystemExit(f"forewarn fleet did not query Resource Graph: {(work / 'fleet.log').read_text()}")
            time.sleep(0.05)
        first_query = time.monotonic()
        threading.Timer(args.refuse, lambda: setattr(endpoint.received, "down", False)).start()
        print(f"{vms} VMs, {events} events; first query {first_query - started:.1f} s after the start; the webhook "
              f"refuses for {args.refuse:g} s", flush=True)
        while len(endpoint.received.accepted) < vms and time.monotonic() - first_query < args.timeout:
            time.sleep(0.5)
            if proc.poll() is not None:
                raise SystemExit(f"forewarn fleet exited: {(work / 'fleet.log').read_text()[-3000:]}")
            try:
                metrics = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
            except requests.RequestException:
                continue
            stored = sample(metrics, "azure_scheduled_events_outbox_stored_records")
            peak["stored"] = max(peak["stored"], stored)
            size = sum(p.stat().st_size for p in database.parent.glob("forewarn.sqlite*") if p.exists())
            if size > peak["database_bytes"]:
                peak["database_bytes"], peak["stored_then"] = size, stored
            peak["rss_mib"] = max(peak["rss_mib"], rss_mib(proc.pid))
            if first_refusal is None and sample(metrics, "azure_scheduled_events_outbox_refused_commits_total") > 0:
                first_refusal = time.monotonic()
        done = time.monotonic()
        time.sleep(3)  # any repeat would arrive now
        metrics = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        arm.stop()
        endpoint.stop()
    lines = [line for line in records_file.read_text().splitlines() if line.strip()]
    filed = [json.loads(line) for line in lines]
    expected = {(f"ss-{n}_{i}", str(uuid.UUID(int=1_000_000 + n))) for n in range(events)
                for i in range(VMS_PER_EVENT)}
    file_ids = Counter(record["id"] for record in filed)
    hook_ids = Counter(endpoint.received.ids())
    results = {
        **header(),
        "vms": vms, "events": events, "max_records": args.max_records, "refuse_seconds": args.refuse,
        "every_vm_once_in_the_file": {(r["data"]["vm"]["name"], r["subject"]) for r in filed} == expected
        and len(file_ids) == vms and max(file_ids.values()) == 1,
        "every_record_once_at_the_webhook": set(hook_ids) == set(file_ids) and max(hook_ids.values(), default=0) == 1,
        "file_records": len(filed), "webhook_records": sum(hook_ids.values()),
        "webhook_posts_refused": len(endpoint.received.attempts) - len(endpoint.received.accepted_at),
        "dropped": sample(metrics, "azure_scheduled_events_outbox_dropped_records_total"),
        "refused_commits": sample(metrics, "azure_scheduled_events_outbox_refused_commits_total"),
        "resource_graph_pages": len(arm.received.queries),
        "resource_graph_snapshots": round(len(arm.received.queries) / -(-events // 1000), 1),
        "outbox_peak": peak,   # the database's size with its write-ahead log, and the records stored then
        "record_json_bytes": round(sum(len(line) for line in lines) / max(len(lines), 1)),
        "seconds_from_first_query": {
            "first_refusal": None if first_refusal is None else round(first_refusal - first_query, 1),
            "webhook_recovered": args.refuse,
            "last_record_at_the_webhook": round(endpoint.received.accepted_at[-1] - first_query, 1),
            "run": round(done - first_query, 1),
        },
    }
    write_results("fleet-outbox", results)
    missing = len(expected - {(r["data"]["vm"]["name"], r["subject"]) for r in filed})
    repeated = sum(n - 1 for n in file_ids.values()) + sum(n - 1 for n in hook_ids.values())
    at_the_webhook = len(set(file_ids) - set(hook_ids))
    if missing or repeated or at_the_webhook:
        return (f"records lost or repeated: {missing} VM(s) missing from the file, {at_the_webhook} record(s) of "
                f"the file missing at the webhook, {repeated} record(s) repeated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
