"""`forewarn fleet` end to end, as deployed: its own process, Resource Graph through the strict TLS stand-in with
the real azure-identity ManagedIdentityCredential (token from the stand-in's IMDS endpoint), Event Grid deliveries
through a Storage queue in Azurite with the real azure-storage-queue client, records to a file sink.

Events for three subscriptions arrive by queue and by snapshot, out of order and repeated: one record per
change per VM, schema-valid, and the metrics say so; a SIGKILL at any moment loses no queue message and, after
the restart, reports no change under a second id."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import requests

from fleet_samples import as_base64, cloud_event, event_grid_event, properties, target_id
from test_fleet_queue import Azurite, count, require_azurite

from conftest import free_port, wait_until
from peers.arm import ArmPeer
from peers.pki import Authority

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parent.parent
SCHEMA = json.loads((ROOT / "src/forewarn/schemas/record.schema.json").read_text())
SUBS = [str(uuid.UUID(int=n + 1)) for n in range(3)]
CLIENT_ID = "00000000-0000-0000-0000-00000000c11d"
PUSH_SECRET = "0123456789abcdef0123456789abcdef"


def eid(n: int) -> str:
    return str(uuid.UUID(int=50_000 + n))


def row(sub: str, n: int, status: str = "Scheduled") -> dict[str, Any]:
    target = target_id("vm", f"vm-{n}", sub=sub, rg="rg-a")
    props = properties(event_id=eid(n), status=status, resources=(f"vm-{n}",))
    return {"id": f"{target}/providers/Microsoft.Maintenance/scheduledevents/{eid(n)}", "name": eid(n),
            "subscriptionId": sub, "resourceGroup": "rg-a", "location": "westeurope", "properties": props}


def grid(sub: str, n: int, status: str, delivery: str, cloud: bool = False) -> dict[str, Any]:
    target = target_id("vm", f"vm-{n}", sub=sub, rg="rg-a")
    props = properties(event_id=eid(n), status=status, resources=(f"vm-{n}",))
    return (cloud_event if cloud else event_grid_event)(props, target, delivery)


@pytest.fixture(scope="module")
def authority() -> Authority:
    return Authority("fleet-test-ca")


@pytest.fixture(scope="module")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    peer = Azurite(require_azurite(), tmp_path_factory.mktemp("azurite"))
    yield peer
    peer.stop()


class Fleet:
    """`forewarn fleet` as a process, restartable on the same state dir and port."""

    def __init__(self, tmp_path: Path, arm: ArmPeer | None, authority: Authority, azurite: Azurite | None,
                 queue: str | None, resource_graph: bool = True, extra: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        bundle = tmp_path / "ca.pem"
        bundle.write_bytes(authority.pem)
        self.records_file = tmp_path / "records.jsonl"
        self.port = free_port()
        self.log = tmp_path / "fleet.log"
        self.argv = [str(Path(sys.executable).parent / "forewarn"), "fleet", "--sink", f"file:{self.records_file}",
                     "--state-dir", str(tmp_path / "state"), "--listen-address", f"127.0.0.1:{self.port}",
                     "--drain-timeout", "2", *extra]
        self.env = {**os.environ, "REQUESTS_CA_BUNDLE": str(bundle), **(env or {})}
        if arm is not None and resource_graph:
            self.argv += [*[arg for sub in SUBS for arg in ("--subscription", sub)], "--arm-endpoint", arm.base,
                          "--arm-client-id", CLIENT_ID, "--arm-timeout", "30", "--reconcile-interval", "1"]
            self.env["AZURE_POD_IDENTITY_AUTHORITY_HOST"] = arm.base
        if azurite is not None and queue is not None:
            self.argv += ["--queue-url", f"http://127.0.0.1:{azurite.port}/devstoreaccount1/{queue}",
                          "--queue-visibility-timeout", "2"]
            self.env["FOREWARN_QUEUE_CONNECTION_STRING"] = azurite.connection_string
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Fleet:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=subprocess.DEVNULL, stderr=log)
        wait_until(lambda: self.metrics() is not None, timeout=30, message="forewarn fleet to serve /metrics")
        return self

    def metrics(self) -> str | None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"forewarn fleet exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
        try:
            return requests.get(f"http://127.0.0.1:{self.port}/metrics", timeout=2).text
        except requests.RequestException:
            return None

    def records(self) -> list[dict[str, Any]]:
        if not self.records_file.exists():
            return []
        return [json.loads(line) for line in self.records_file.read_text().splitlines() if line.strip()]

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(10)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)


def changes(records: list[dict[str, Any]]) -> Counter[tuple[str, str, str]]:
    """(VM, EventId, change) -> how many distinct record ids say it (1 means: reported once)."""
    ids: dict[tuple[str, str, str], set[str]] = {}
    for record in records:
        ids.setdefault((record["data"]["vm"]["name"], record["subject"], record["data"]["change"]), set()).add(
            record["id"])
    return Counter({key: len(found) for key, found in ids.items()})


def test_queue_push_and_snapshot_news_out_of_order_and_repeated_give_one_record_per_change(
        tmp_path: Path, authority: Authority, azurite: Azurite) -> None:
    """Three subscriptions, three feeds. Resource Graph lists the three open events; the queue brings vm-0's
    again, vm-2's twice (Event Grid's repeat), vm-1's start (CloudEvents schema) and a late Scheduled of vm-1
    (base64); vm-1's Scheduled came by no message (lost on the way), so only the snapshot brings it; the push
    brings vm-0's start, twice, and vm-2's end."""
    arm = ArmPeer(authority, rows=[row(SUBS[0], 0), row(SUBS[1], 1), row(SUBS[2], 2)])
    queue = azurite.queue()
    for message in (
        grid(SUBS[0], 0, "Scheduled", "d-0"),                     # what the snapshot also says
        grid(SUBS[2], 2, "Scheduled", "d-2"),
        grid(SUBS[2], 2, "Scheduled", "d-2"),                     # Event Grid's repeat
        grid(SUBS[1], 1, "Started", "d-1s", cloud=True),          # CloudEvents schema
    ):
        queue.send_message(json.dumps(message))
    queue.send_message(as_base64([grid(SUBS[1], 1, "Scheduled", "d-1")]))  # late, and base64: changes nothing
    fleet = Fleet(tmp_path, arm, authority, azurite, queue.queue_name, extra=("--eventgrid-path", "/eventgrid"),
                  env={"FOREWARN_EVENTGRID_SECRET": PUSH_SECRET}).start()

    def push(*events: dict[str, Any]) -> None:
        answer = requests.post(f"http://127.0.0.1:{fleet.port}/eventgrid", params={"code": PUSH_SECRET},
                               json=list(events), timeout=10)
        assert answer.status_code == 200, answer.text

    try:
        wait_until(lambda: count(queue) == 0 and len(fleet.records()) >= 3, timeout=60,
                   message="every message read and deleted, and the records written")
        push(grid(SUBS[0], 0, "Started", "p-0s"))
        push(grid(SUBS[0], 0, "Started", "p-0s"))                 # pushed twice
        push(grid(SUBS[2], 2, "Completed", "p-2c"))
        wait_until(lambda: any(r["data"]["change"] == "removed" for r in fleet.records()), timeout=30,
                   message="the Completed event's record")
        text = fleet.metrics() or ""
        records = fleet.records()
    finally:
        assert fleet.stop() == 0, fleet.log.read_text()[-3000:]
        arm.stop()
    for record in records:
        jsonschema.validate(record, SCHEMA)
    expected = {("vm-0", eid(0), "added"): 1, ("vm-0", eid(0), "updated"): 1, ("vm-1", eid(1), "added"): 1,
                ("vm-2", eid(2), "added"): 1, ("vm-2", eid(2), "removed"): 1}
    # vm-1 starts either as the snapshot's Scheduled (then the queue's Started updates it) or as the queue's
    # Started (then the snapshot's Scheduled is late news): whichever came first
    assert changes(records) in (expected, {**expected, ("vm-1", eid(1), "updated"): 1}), changes(records)
    assert f"records left in the outbox at stop: file:{fleet.records_file} 0\n" in fleet.log.read_text()
    feeds = {(r["data"]["vm"]["name"], r["data"]["change"]): r["data"]["feed"] for r in records}
    assert feeds[("vm-0", "updated")] == feeds[("vm-2", "removed")] == "eventgrid"  # the push's news
    removed = next(r for r in records if r["data"]["change"] == "removed")
    assert (removed["data"]["outcome"], removed["data"]["ended_by"]) == ("completed", "status")
    assert removed["source"].endswith("/resourceGroups/rg-a/providers/Microsoft.Compute/virtualMachines/vm-2")
    # the metrics: the open events per VM with their scope, the sources up, the queue's counts
    assert f'event_id="{eid(0)}"' in text and 'vm="vm-0"' in text and f'subscription_id="{SUBS[0]}"' in text
    assert f'event_id="{eid(2)}"' not in text.split("# HELP azure_scheduled_event_not_before")[0], "ended: gone"
    assert 'azure_scheduled_events_source_up{source="resourcegraph"} 1.0' in text
    assert 'azure_scheduled_events_source_up{source="queue"} 1.0' in text
    assert 'azure_scheduled_events_queue_messages_total{result="deleted"} 5.0' in text
    assert 'azure_scheduled_events_eventgrid_push_requests_total{result="accepted"} 3.0' in text
    # every snapshot asked for the three subscriptions, with the token of the managed identity
    assert arm.received.tokens_issued >= 1 and not arm.received.errors, arm.received.errors
    assert all(sorted(query["subscriptions"]) == sorted(SUBS) for query in arm.received.queries)
    assert arm.received.ack_statuses == [], "without a policy nothing is acknowledged"


def test_a_sigkill_loses_no_message_and_a_restart_reports_nothing_under_a_second_id(
        tmp_path: Path, authority: Authority, azurite: Azurite) -> None:
    arm = ArmPeer(authority, rows=[])
    queue = azurite.queue()
    total = 30
    for n in range(total):
        queue.send_message(json.dumps(grid(SUBS[n % 3], 100 + n, "Scheduled", f"k-{n}")))
    fleet = Fleet(tmp_path, arm, authority, azurite, queue.queue_name, resource_graph=False).start()
    try:
        wait_until(lambda: len(fleet.records()) >= 1, timeout=60, message="the first record")
        fleet.kill()                                                   # mid-way: some committed, some not
        fleet.start()
        wait_until(lambda: count(queue) == 0 and len(changes(fleet.records())) == total, timeout=90,
                   message="every message's change, after the restart")
    finally:
        assert fleet.stop() == 0, fleet.log.read_text()[-3000:]
        arm.stop()
    reported = changes(fleet.records())
    assert set(reported) == {(f"vm-{100 + n}", eid(100 + n), "added") for n in range(total)}
    assert set(reported.values()) == {1}, "a record written twice (at least once) keeps its id"



def test_event_grid_push_is_committed_before_it_is_answered_and_strangers_are_refused(
        tmp_path: Path, authority: Authority) -> None:
    fleet = Fleet(tmp_path, None, authority, None, None, extra=("--eventgrid-path", "/eventgrid"),
                  env={"FOREWARN_EVENTGRID_SECRET": PUSH_SECRET}).start()
    url = f"http://127.0.0.1:{fleet.port}/eventgrid"
    try:
        handshake = [{"id": "v-1", "topic": "/subscriptions/x", "subject": "", "eventTime": "2026-11-24T10:00:00Z",
                      "eventType": "Microsoft.EventGrid.SubscriptionValidationEvent", "dataVersion": "1",
                      "data": {"validationCode": "512d38b6-c7b8-40c8-89fe-f46f9e9622b6"}}]
        answer = requests.post(url, params={"code": PUSH_SECRET}, json=handshake, timeout=5)
        assert answer.status_code == 200
        assert answer.json() == {"validationResponse": "512d38b6-c7b8-40c8-89fe-f46f9e9622b6"}
        stranger = requests.post(url, params={"code": "f" * 32}, json=[grid(SUBS[0], 7, "Scheduled", "p-0")],
                                 timeout=5)
        assert stranger.status_code == 401 and fleet.records() == []
        pushed = requests.post(url, params={"code": PUSH_SECRET}, json=[grid(SUBS[0], 7, "Scheduled", "p-1")],
                               timeout=5)
        assert pushed.status_code == 200
        wait_until(lambda: fleet.records(), timeout=10, message="the pushed event's record")
        text = fleet.metrics() or ""
    finally:
        assert fleet.stop() == 0, fleet.log.read_text()[-3000:]
    (record,) = fleet.records()
    assert record["subject"] == eid(7) and record["data"]["feed"] == "eventgrid"
    assert 'azure_scheduled_events_eventgrid_push_requests_total{result="accepted"} 1.0' in text
    assert 'azure_scheduled_events_eventgrid_push_requests_total{result="unauthorized"} 1.0' in text
    assert 'azure_scheduled_events_source_up{source="eventgrid"} 1.0' in text
    assert PUSH_SECRET not in fleet.log.read_text()


LEASE_ROLE = """\
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: forewarn-fleet-lease, namespace: forewarn}
rules:
- {apiGroups: [coordination.k8s.io], resources: [leases], verbs: [create]}
- {apiGroups: [coordination.k8s.io], resources: [leases], resourceNames: [forewarn-fleet], verbs: [get, update]}
"""


def test_two_replicas_one_active_and_a_takeover_after_sigkill_loses_nothing(
        tmp_path: Path, authority: Authority, azurite: Azurite) -> None:
    """Two replicas on one queue under one Lease: only the holder reads and publishes; SIGKILL it, and the other
    takes over within the lease time and delivers what came since. Nothing is lost; the records of both name
    each change under one id."""
    from peers.kube_api import KubeApi

    role = tmp_path / "role.yaml"
    role.write_text(LEASE_ROLE)
    queue = azurite.queue()
    with KubeApi(cluster_role=role, namespaces=["forewarn"]) as api:
        replicas = []
        for name in ("a", "b"):
            kubeconfig = api.kubeconfig(tmp_path / f"kubeconfig-{name}", namespace="forewarn")
            home = tmp_path / name
            home.mkdir()
            replicas.append(Fleet(home, None, authority, azurite, queue.queue_name,
                                  extra=("--lease-name", "forewarn-fleet", "--lease-seconds", "3",
                                         "--kubeconfig", str(kubeconfig))).start())
        try:
            def active() -> list[Fleet]:
                return [r for r in replicas if "azure_scheduled_events_fleet_active 1.0" in (r.metrics() or "")]

            wait_until(lambda: len(active()) == 1, timeout=20, message="one active replica")
            (leader,) = active()
            (standby,) = [r for r in replicas if r is not leader]
            for n in range(5):
                queue.send_message(json.dumps(grid(SUBS[0], 200 + n, "Scheduled", f"t-{n}")))
            wait_until(lambda: count(queue) == 0 and len(leader.records()) == 5, timeout=30,
                       message="the first messages, by the active replica")
            assert standby.records() == []
            leader.kill()
            killed_at = time.monotonic()
            for n in range(5, 10):
                queue.send_message(json.dumps(grid(SUBS[0], 200 + n, "Scheduled", f"t-{n}")))
            wait_until(lambda: "azure_scheduled_events_fleet_active 1.0" in (standby.metrics() or ""), timeout=20,
                       message="the standby to take over")
            took = time.monotonic() - killed_at
            wait_until(lambda: count(queue) == 0 and len(standby.records()) >= 5, timeout=30,
                       message="the later messages, by the new active replica")
        finally:
            for replica in replicas:
                if replica.proc is not None and replica.proc.poll() is None:
                    assert replica.stop() == 0, replica.log.read_text()[-3000:]
    assert took <= 3 + 5, f"takeover took {took:.1f} s with a 3 s lease (bound: the lease, plus a margin for load)"
    reported = changes(leader.records() + standby.records())
    assert set(reported) == {(f"vm-{200 + n}", eid(200 + n), "added") for n in range(10)}
    assert set(reported.values()) == {1}


def test_a_takeover_announces_only_what_the_killed_replica_had_not(tmp_path: Path, authority: Authority) -> None:
    """Two replicas reading Resource Graph under one Lease, each with its own state dir (an emptyDir): the
    active one announces the open events and hands over what reached its sink in the Lease; SIGKILL it, and the
    replica that takes over announces what changed and what is new since, not the events announced already."""
    from forewarn.fleet.handover import ANNOTATION, APPROVED_ANNOTATION, decode

    from peers.kube_api import KubeApi

    role = tmp_path / "role.yaml"
    role.write_text(LEASE_ROLE)
    policy = tmp_path / "policy.yaml"   # approves the Reboots: each once, whichever replica holds the Lease
    policy.write_text("rules: [{name: reboots, action: approve, match: {event_type: [Reboot]}}]\n")
    arm = ArmPeer(authority, rows=[row(SUBS[n % 3], 300 + n) for n in range(6)])
    with KubeApi(cluster_role=role, namespaces=["forewarn"]) as api:
        replicas = []
        for name in ("a", "b"):
            kubeconfig = api.kubeconfig(tmp_path / f"kubeconfig-{name}", namespace="forewarn")
            home = tmp_path / name
            home.mkdir()
            replicas.append(Fleet(home, arm, authority, None, None,
                                  extra=("--lease-name", "forewarn-fleet", "--lease-seconds", "3",
                                         "--kubeconfig", str(kubeconfig), "--policy", str(policy))).start())
        try:
            def active() -> list[Fleet]:
                return [r for r in replicas if "azure_scheduled_events_fleet_active 1.0" in (r.metrics() or "")]

            def handed_over() -> int:
                annotations = (api.leases() or [{}])[0].get("metadata", {}).get("annotations") or {}
                return len(decode(annotations.get(ANNOTATION)))

            def approved() -> int:
                annotations = (api.leases() or [{}])[0].get("metadata", {}).get("annotations") or {}
                return len(decode(annotations.get(APPROVED_ANNOTATION)))

            wait_until(lambda: len(active()) == 1, timeout=20, message="one active replica")
            (leader,) = active()
            (standby,) = [r for r in replicas if r is not leader]
            wait_until(lambda: len(leader.records()) == 12 and handed_over() == 6 and approved() == 6, timeout=30,
                       message="the six open events announced, approved and handed over in the Lease")
            leader.kill()
            arm.rows = [row(SUBS[0], 300, "Started"), *arm.rows[1:], row(SUBS[1], 399)]
            wait_until(lambda: "azure_scheduled_events_fleet_active 1.0" in (standby.metrics() or ""), timeout=20,
                       message="the standby to take over")
            wait_until(lambda: len(standby.records()) >= 3, timeout=30, message="the news since, by the new one")
            time.sleep(2.5)  # two more snapshots: nothing else may come
            text = standby.metrics() or ""
            late = standby.records()
        finally:
            for replica in replicas:
                if replica.proc is not None and replica.proc.poll() is None:
                    assert replica.stop() == 0, replica.log.read_text()[-3000:]
            arm.stop()
    assert sorted((r["data"]["vm"]["name"], r["data"]["change"], r["data"]["event"]["EventStatus"]) for r in late) == [
        ("vm-300", "added", "Started"), ("vm-399", "added", "Scheduled"), ("vm-399", "approved", "Scheduled")]
    assert "azure_scheduled_events_handover_skipped_total 5.0" in text
    ids = [r["id"] for r in leader.records() + late]
    assert len(ids) == len(set(ids)) == 15
    # each event acknowledged once across both replicas: the six by the first, the new one by its successor
    assert sorted(event for _, event, _, _ in arm.received.acks) == sorted(eid(n) for n in [*range(300, 306), 399])


def test_a_queued_event_is_recorded_then_acknowledged_once_by_policy_through_arm(
        tmp_path: Path, authority: Authority, azurite: Azurite) -> None:
    """Event Grid message in the queue -> record -> the policy approves it -> one acknowledge call to ARM (with
    the managed identity's token) -> an `approved` record naming the rule; the event then Started changes
    nothing more; a Freeze no rule matches is held."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"rules:\n  - name: reboots-in-rg-a\n    action: approve\n"
                      f"    match: {{event_type: [Reboot], resource_group: [RG-A], subscription: [{SUBS[0]}]}}\n")
    arm = ArmPeer(authority, rows=[row(SUBS[0], 500), row(SUBS[0], 501)])
    arm.rows[1]["properties"]["EventType"] = "Freeze"
    queue = azurite.queue()
    queue.send_message(json.dumps(grid(SUBS[0], 500, "Scheduled", "q-500")))
    fleet = Fleet(tmp_path, arm, authority, azurite, queue.queue_name, extra=("--policy", str(policy))).start()
    try:
        wait_until(lambda: any(r["type"].endswith(".approved") for r in fleet.records()), timeout=30,
                   message="the approved record")
        queue.send_message(json.dumps(grid(SUBS[0], 500, "Started", "q-500s")))
        wait_until(lambda: count(queue) == 0 and len(fleet.records()) >= 4, timeout=30,
                   message="the Started update read")
        time.sleep(2.5)  # two more snapshots and approver ticks: nothing is acknowledged again
        text = fleet.metrics() or ""
        records = fleet.records()
    finally:
        assert fleet.stop() == 0, fleet.log.read_text()[-3000:]
        arm.stop()
    target = row(SUBS[0], 500)["id"].split("/providers/Microsoft.Maintenance")[0]
    assert arm.received.acks == [(target.lower(), eid(500), "single", "2025-10-01-preview")]
    approved = [r for r in records if r["type"].endswith(".approved")]
    assert [(r["subject"], r["data"]["policy_rule"], r["data"]["dry_run"]) for r in approved] == [
        (eid(500), "reboots-in-rg-a", False)]
    for record in records:
        jsonschema.validate(record, SCHEMA)
    assert 'azure_scheduled_events_approvals_total{event_type="Reboot",result="approved"} 1.0' in text
    assert 'azure_scheduled_events_approvals_total{event_type="Freeze",result="approved"} 0.0' in text


def test_end_to_end_a_queued_scale_set_event_drains_its_nodes_is_acknowledged_and_released_when_completed(
        tmp_path: Path, authority: Authority, azurite: Azurite) -> None:
    """The whole flow from one place: an Event Grid message in the queue -> its record -> the policy's node
    actions on the two AKS nodes of the event's VMs (found by providerID; the third VM is no node here) -> one
    acknowledge call through ARM -> the event's Completed, by the queue -> both nodes released."""
    from datetime import datetime, timedelta, timezone

    from forewarn.imds.document import format_not_before

    from peers.kube_api import KubeApi

    group, pool = "MC_rg-aks_cluster_westeurope", "aks-pool-vmss"
    target = target_id("vmss", pool, sub=SUBS[0], rg=group.lower())            # ARM IDs: the group in lower case
    provider = f"azure://{target_id('vmss', pool, sub=SUBS[0], rg=group)}"      # providerIDs: as MC_...
    not_before = format_not_before(datetime.now(timezone.utc) + timedelta(minutes=10))
    resources = (f"{pool}_0", f"{pool}_1", f"{pool}_9")

    def message(status: str, delivery: str) -> str:
        props = properties(event_id=eid(700), status=status, resources=resources,
                           not_before=not_before if status == "Scheduled" else "")
        return json.dumps(event_grid_event(props, target, delivery))

    policy = tmp_path / "policy.yaml"
    policy.write_text("rules:\n  - name: pool\n    action: approve\n    match: {scale_set: [aks-pool-*]}\n"
                      "    node: [cordon, {drain: {timeout: 60, margin: 1}}]\n")
    arm = ArmPeer(authority, rows=[{"id": f"{target}/providers/Microsoft.Maintenance/scheduledevents/{eid(700)}",
                                    "name": eid(700), "subscriptionId": SUBS[0]}])
    queue = azurite.queue()
    role = ROOT / "deploy" / "kubernetes" / "components" / "fleet-node-actions" / "clusterrole.yaml"
    nodes = (f"{pool}000000", f"{pool}000001")
    with KubeApi(cluster_role=role, namespaces=["forewarn", "shop"]) as api:
        for instance, node in enumerate(nodes):
            api.add_node(node, provider_id=f"{provider}/virtualMachines/{instance}")
            api.add_pod("shop", f"web-{instance}", node, owner_kind="ReplicaSet")
        kubeconfig = api.kubeconfig(tmp_path / "kubeconfig", namespace="forewarn")
        fleet = Fleet(tmp_path, arm, authority, azurite, queue.queue_name, resource_graph=False,
                      extra=("--policy", str(policy), "--kubeconfig", str(kubeconfig), "--arm-endpoint", arm.base,
                             "--arm-client-id", CLIENT_ID),
                      env={"AZURE_POD_IDENTITY_AUTHORITY_HOST": arm.base}).start()
        try:
            queue.send_message(message("Scheduled", "m-1"))
            wait_until(lambda: len(arm.received.acks) == 1, timeout=60, message="the acknowledgement")
            cordoned = [api.node(node)["spec"].get("unschedulable") for node in nodes]
            pods_left = [pod["metadata"]["name"] for pod in api.pods()]
            queue.send_message(message("Completed", "m-2"))
            wait_until(lambda: not any(api.node(node)["spec"].get("unschedulable") for node in nodes), timeout=30,
                       message="both nodes released after Completed")
            # each undo's record follows its patch, and the file sink follows the outbox: wait for both
            wait_until(lambda: sum(r["data"].get("action") == "undo" for r in fleet.records()) == 2, timeout=30,
                       message="the undo records in the file")
            text = fleet.metrics() or ""
            records = fleet.records()
        finally:
            assert fleet.stop() == 0, fleet.log.read_text()[-3000:]
            arm.stop()
    assert cordoned == [True, True] and pods_left == [], "drained before the approval"
    assert arm.received.acks == [(target.lower(), eid(700), "single", "2025-10-01-preview")]
    changes_seen = [(r["data"]["change"], r["data"]["vm"]["name"]) for r in records
                    if r["data"]["change"] in ("added", "approved", "removed")]
    assert changes_seen.count(("approved", f"{pool}_0")) == 1 and len(changes_seen) == 9  # 3 VMs x 3 changes
    actions = sorted((r["data"]["node"], r["data"]["action"], r["data"]["result"]) for r in records
                     if r["data"]["change"] == "node_action")
    assert actions == sorted([(node, action, "ok") for node in nodes for action in ("cordon", "drain", "undo")])
    for record in records:
        jsonschema.validate(record, SCHEMA)
    assert "azure_scheduled_events_fleet_vms_without_node_total 1.0" in text


def test_two_replicas_the_actor_killed_mid_drain_one_approval_the_drain_finished_and_the_node_released(
        tmp_path: Path, authority: Authority) -> None:
    """Two replicas under one Lease, node actions by policy. The active one cordons the node and starts a
    drain that a PodDisruptionBudget blocks; SIGKILL it. The other takes over, resumes the drain from the
    node's ledger, which finishes once the budget allows; the event is acknowledged once in all; when it is
    over the node is released, and every record id stands for one change."""
    from datetime import datetime, timedelta, timezone

    from forewarn.imds.document import format_not_before

    from peers.kube_api import KubeApi

    pool, group = "aks-pool-vmss", "MC_rg-aks_c_westeurope"
    target = target_id("vmss", pool, sub=SUBS[0], rg=group.lower())
    props = properties(event_id=eid(800), resources=(f"{pool}_0",),
                       not_before=format_not_before(datetime.now(timezone.utc) + timedelta(minutes=10)))
    arm = ArmPeer(authority, rows=[{"id": f"{target}/providers/Microsoft.Maintenance/scheduledevents/{eid(800)}",
                                    "name": eid(800), "subscriptionId": SUBS[0], "resourceGroup": group.lower(),
                                    "location": "westeurope", "properties": props}])
    policy = tmp_path / "policy.yaml"
    policy.write_text("rules:\n  - name: pool\n    action: approve\n    match: {scale_set: [aks-pool-*]}\n"
                      "    node: [cordon, {drain: {timeout: 120, margin: 1}}]\n")
    roles = tmp_path / "roles"
    roles.mkdir()
    (roles / "lease.yaml").write_text(LEASE_ROLE)
    (roles / "nodes.yaml").write_text((ROOT / "deploy" / "kubernetes" / "components" / "fleet-node-actions" /
                                       "clusterrole.yaml").read_text())
    node = f"{pool}000000"
    with KubeApi(cluster_role=roles, namespaces=["forewarn", "shop"]) as api:
        api.add_node(node, provider_id=f"azure://{target_id('vmss', pool, sub=SUBS[0], rg=group)}/virtualMachines/0")
        api.add_pod("shop", "web-0", node, labels={"app": "web"}, owner_kind="ReplicaSet")
        api.add_pdb("shop", "web", {"app": "web"}, max_unavailable=0)      # the drain is blocked until freed
        replicas = []
        for name in ("a", "b"):
            kubeconfig = api.kubeconfig(tmp_path / f"kubeconfig-{name}", namespace="forewarn")
            home = tmp_path / name
            home.mkdir()
            replicas.append(Fleet(home, arm, authority, None, None,
                                  extra=("--lease-name", "forewarn-fleet", "--lease-seconds", "3", "--kubeconfig",
                                         str(kubeconfig), "--policy", str(policy))).start())

        def active() -> list[Fleet]:
            return [r for r in replicas if "azure_scheduled_events_fleet_active 1.0" in (r.metrics() or "")]

        try:
            wait_until(lambda: len(active()) == 1, timeout=20, message="one active replica")
            (leader,) = active()
            (standby,) = [r for r in replicas if r is not leader]
            wait_until(lambda: any(r["data"]["change"] == "drain" and r["data"]["phase"] == "blocked"
                                   for r in leader.records()), timeout=30, message="the drain blocked")
            assert api.node(node)["spec"].get("unschedulable") is True
            leader.kill()                                                 # mid-drain
            wait_until(lambda: "azure_scheduled_events_fleet_active 1.0" in (standby.metrics() or ""), timeout=20,
                       message="the standby to take over")
            wait_until(lambda: any(r["data"]["change"] == "drain" for r in standby.records()), timeout=30,
                       message="the drain resumed by the new actor")
            assert arm.received.acks == [], "not approved while the drain is blocked"
            api.set_pdb_allowed("shop", "web", 1)                         # the budget lets the pod go
            wait_until(lambda: len(arm.received.acks) == 1, timeout=60, message="the approval after the drain")
            assert [pod["metadata"]["name"] for pod in api.pods()] == []
            arm.rows = []                                                  # the event is over
            wait_until(lambda: not api.node(node)["spec"].get("unschedulable"), timeout=30,
                       message="the node released")
            time.sleep(1.5)
        finally:
            for replica in replicas:
                if replica.proc is not None and replica.proc.poll() is None:
                    assert replica.stop() == 0, replica.log.read_text()[-3000:]
            arm.stop()
        assert len(arm.received.acks) == 1
        annotations = api.node(node)["metadata"].get("annotations") or {}
        assert "forewarn.io/applied" not in annotations and not api.node(node)["spec"].get("taints")
    records = leader.records() + standby.records()
    meaning: dict[str, set[tuple[str, ...]]] = {}
    for record in records:
        data = record["data"]
        meaning.setdefault(record["id"], set()).add((data["change"], data.get("action", ""), data.get("result", ""),
                                                     data.get("phase", ""), data["vm"]["name"]))
    assert all(len(kinds) == 1 for kinds in meaning.values()), "a record id stands for one change"
    approved = [r for r in records if r["data"]["change"] == "approved"]
    assert len(approved) == 1 and approved[0] in standby.records(), "approved once, by the replica that finished"
