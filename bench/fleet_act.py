"""`forewarn fleet` acting from one place (issue "Fleet mode, part 2"), each figure beside a floor from the same run.

- acknowledgement latency: `forewarn fleet --policy` (approve every Reboot; no node actions, so no drain) reads
  Event Grid messages from a queue in Azurite (tests/azurite) and acknowledges through the ARM stand-in (TLS, the
  real ManagedIdentityCredential); N messages paced at 5/s, each a new event on one VM; latency is from the
  message's send to the acknowledge call reaching the stand-in, with --queue-poll-interval 0.5 (the wait after
  an empty receive bounds how soon a message is read). Floor: the same call made by forewarn's
  Acknowledger alone, from this process, on a kept-alive connection.
- failover after SIGKILL of the actor: two replicas under one Lease (the strict Kubernetes API stand-in,
  --lease-seconds L); the active one is killed with SIGKILL and the time until the other reports
  `azure_scheduled_events_fleet_active 1` is measured (/metrics polled every 20 ms), K times, the roles
  alternating. Target: at most L + 2 s.

    python bench/fleet_act.py [--quick]

Results are printed and written to bench/results/fleet_act.json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import requests

from common import free_port, header, summary_ms, write_results
from peers.arm import ArmPeer
from peers.kube_api import KubeApi
from peers.pki import Authority

_queue_tests = importlib.import_module("test_fleet_queue")
samples = importlib.import_module("fleet_samples")
FOREWARN = Path(sys.executable).parent / "forewarn"
CLIENT_ID = "00000000-0000-0000-0000-00000000c11d"
SUB = str(uuid.UUID(int=0xAC << 64 | 1))
#: The queue's wait after an empty receive (forewarn's default is 1 s): the most a message waits to be read,
#: which the latency cannot beat; the acknowledgement follows its commit at once.
POLL = 0.5
POLICY = "rules: [{name: reboots, action: approve, match: {event_type: [Reboot]}}]\n"
LEASE_ROLE = importlib.import_module("test_fleet_service").LEASE_ROLE   # the Role the fleet tests use


def target(n: int) -> str:
    return samples.target_id("vm", f"vm-{n:04d}", sub=SUB, rg="rg-act")


def event_id(n: int) -> str:
    return str(uuid.UUID(int=0xAC << 64 | 0x1000 + n))


def message(n: int) -> str:
    props = samples.properties(event_id=event_id(n), resources=(f"vm-{n:04d}",))
    return json.dumps(samples.event_grid_event(props, target(n), f"act-{n}"))


class Service:
    """`forewarn fleet` as its own process, its metrics on a loopback port."""

    def __init__(self, home: Path, argv: list[str], env: dict[str, str]) -> None:
        home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.log = (home / "fleet.log").open("ab")
        self.proc = subprocess.Popen([str(FOREWARN), "fleet", "--listen-address", f"127.0.0.1:{self.port}",
                                      "--state-dir", str(home / "state"), "--log-level", "warning", *argv],
                                     env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + 60
        while self.metrics() is None:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"forewarn fleet did not start ({home / 'fleet.log'})")
            time.sleep(0.05)

    def metrics(self) -> str | None:
        try:
            return requests.get(f"http://127.0.0.1:{self.port}/metrics", timeout=2).text
        except requests.RequestException:
            return None

    def active(self) -> bool:
        return "azure_scheduled_events_fleet_active 1.0" in (self.metrics() or "")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def acknowledgement_latency(tmp: Path, authority: Authority, bundle: Path, count: int) -> dict[str, Any]:
    from forewarn.fleet.acknowledge import Acknowledger

    azurite = _queue_tests.Azurite(_queue_tests.require_azurite(), tmp / "azurite")
    arm = ArmPeer(authority, rows=[{"id": f"{target(n)}/providers/Microsoft.Maintenance/scheduledevents/"
                                           f"{event_id(n)}", "name": event_id(n), "subscriptionId": SUB}
                                   for n in range(count + 50)])
    queue = azurite.queue()
    policy = tmp / "policy.yaml"
    policy.write_text(POLICY)
    env = {"REQUESTS_CA_BUNDLE": str(bundle), "AZURE_POD_IDENTITY_AUTHORITY_HOST": arm.base,
           "FOREWARN_QUEUE_CONNECTION_STRING": azurite.connection_string}
    service = Service(tmp / "ack", ["--queue-url", f"http://127.0.0.1:{azurite.port}/devstoreaccount1/"
                                    f"{queue.queue_name}", "--policy", str(policy), "--arm-endpoint", arm.base,
                                    "--arm-client-id", CLIENT_ID, "--sink", f"file:{tmp / 'records.jsonl'}",
                                    "--queue-poll-interval", str(POLL)], env)
    try:
        sent: dict[str, float] = {}
        for n in range(count):
            sent[event_id(n)] = time.time()
            queue.send_message(message(n))
            time.sleep(0.2)
        deadline = time.monotonic() + 60
        while len(arm.received.acks) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        with arm.received.lock:
            arrived = {event: at for (_, event, _, _), at in zip(arm.received.acks, arm.received.ack_times,
                                                                    strict=True)}
        latencies = [arrived[event] - at for event, at in sent.items() if event in arrived]
        repeats = len(arm.received.acks) - len(arrived)
    finally:
        service.stop()
    # the floor: the same call from this process, on a kept-alive connection (the token fetched first)
    os.environ["AZURE_POD_IDENTITY_AUTHORITY_HOST"] = arm.base
    os.environ["REQUESTS_CA_BUNDLE"] = str(bundle)
    from azure.identity import ManagedIdentityCredential

    bare = Acknowledger(arm.base, ManagedIdentityCredential(client_id=CLIENT_ID))
    bare.acknowledge(target(count), [event_id(count)])
    floor = []
    for n in range(count + 1, count + 41):
        started = time.perf_counter()
        bare.acknowledge(target(n), [event_id(n)])
        floor.append(time.perf_counter() - started)
    bare.close()
    arm.stop()
    azurite.stop()
    return {"messages": count, "queue_poll_interval_s": POLL, "acknowledged": len(latencies),
            "acknowledged_twice": repeats,
            "latency": summary_ms(latencies), "floor_bare_acknowledge": summary_ms(floor), "target_p99_ms": 1000}


def failover(tmp: Path, rounds: int, lease_seconds: int) -> dict[str, Any]:
    role = tmp / "role.yaml"
    role.write_text(LEASE_ROLE)
    times = []
    with KubeApi(cluster_role=role, namespaces=["forewarn"]) as api:
        def start(name: str) -> Service:
            kubeconfig = api.kubeconfig(tmp / f"kubeconfig-{name}", namespace="forewarn")
            # Event Grid push only: a source that needs no peer, so the figure is the Lease's alone
            return Service(tmp / f"failover-{name}", ["--eventgrid-path", "/eventgrid", "--lease-name",
                                                      "forewarn-fleet", "--lease-seconds", str(lease_seconds),
                                                      "--kubeconfig", str(kubeconfig)],
                           {"FOREWARN_EVENTGRID_SECRET": "0123456789abcdef0123456789abcdef"})
        replicas = [start("a"), start("b")]
        try:
            for round_ in range(rounds):
                deadline = time.monotonic() + 60
                while sum(r.active() for r in replicas) != 1:
                    if time.monotonic() > deadline:
                        raise RuntimeError("no single active replica")
                    time.sleep(0.05)
                leader = next(r for r in replicas if r.active())
                standby = next(r for r in replicas if r is not leader)
                leader.proc.kill()
                killed = time.monotonic()
                leader.proc.wait()
                while not standby.active():
                    if time.monotonic() - killed > lease_seconds + 30:
                        raise RuntimeError("the standby never took over")
                    time.sleep(0.02)
                times.append(time.monotonic() - killed)
                replicas = [standby, start(f"r{round_}")]
        finally:
            for replica in replicas:
                replica.stop()
    return {"rounds": rounds, "lease_seconds": lease_seconds, "takeover_s": [round(t, 2) for t in times],
            "max_s": round(max(times), 2), "target_s": lease_seconds + 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer messages and failovers")
    args = parser.parse_args()
    out: dict[str, Any] = {**header(), "quick": args.quick, "load_average_at_start": os.getloadavg()}
    authority = Authority("fleet-act-bench-ca")
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        bundle = tmp / "ca.pem"
        bundle.write_bytes(authority.pem)
        out["acknowledge"] = acknowledgement_latency(tmp, authority, bundle, 20 if args.quick else 100)
        print("acknowledge:", out["acknowledge"], flush=True)
        out["failover"] = failover(tmp, 2 if args.quick else 5, 15)
        print("failover:", out["failover"], flush=True)
    out["load_average_at_end"] = os.getloadavg()
    write_results("fleet_act", out)


if __name__ == "__main__":
    main()
