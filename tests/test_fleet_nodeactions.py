"""Node actions from fleet mode (forewarn.fleet.nodeactions, through FleetApprover): each VM of a scale-set event
becomes its AKS node by providerID, the rule's cordon and drain run there with the real lightkube client against
the strict API stand-in (RBAC: the ClusterRole of deploy/kubernetes/components/fleet-node-actions), the approval
goes through the real Acknowledger to the ARM stand-in only after the nodes are drained, and what was applied is
undone when the event ends, also by a replica that did not apply it."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from forewarn.approval.policy import parse_policy
from forewarn.fleet.acknowledge import Acknowledger
from forewarn.fleet.approval import FleetApprover
from forewarn.fleet.feed import FleetEvent
from forewarn.fleet.metrics import FleetMetrics
from forewarn.fleet.nodeactions import FleetNodes
from forewarn.fleet.tracker import FleetView
from forewarn.imds.document import Event
from forewarn.node.actions import APPLIED
from forewarn.node.kube import make_client
from forewarn.records import Record
from test_fleet_approval import FixedToken

from conftest import wait_until
from peers.arm import ArmPeer
from peers.kube_api import KubeApi
from peers.pki import Authority

ROOT = Path(__file__).parent.parent
FLEET_NODE_ROLE = ROOT / "deploy" / "kubernetes" / "components" / "fleet-node-actions" / "clusterrole.yaml"
SUB = str(uuid.UUID(int=21))
POOL = (f"/subscriptions/{SUB}/resourceGroups/MC_rg-aks_cluster_westeurope/providers/Microsoft.Compute/"
        "virtualMachineScaleSets/aks-pool-vmss")
POLICY = """
rules:
  - name: pool-reboots
    action: approve
    match: {event_type: [Reboot], scale_set: ["aks-pool-*"]}
    node: [cordon, {drain: {timeout: 60, margin: 1}}]
"""


def scale_set_event(n: int, resources: tuple[str, ...]) -> FleetEvent:
    event_id = str(uuid.UUID(int=80_000 + n))
    not_before = datetime.now(timezone.utc) + timedelta(minutes=10)
    raw = {"EventId": event_id, "EventType": "Reboot", "EventStatus": "Scheduled", "ResourceType": "VirtualMachine",
           "Resources": list(resources), "NotBefore": not_before.strftime("%a, %d %b %Y %H:%M:%S GMT"),
           "Description": "", "EventSource": "Platform", "DurationInSeconds": -1}
    event = Event(event_id, "Reboot", "Scheduled", "VirtualMachine", resources, not_before, "", "Platform", -1, raw=raw)
    # ARM IDs give the node resource group in lower case, providerIDs as MC_ (AKS does both)
    return FleetEvent(POOL.replace("MC_rg", "mc_rg"), SUB, "mc_rg-aks_cluster_westeurope", event, "resourcegraph")


@pytest.fixture
def arm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ArmPeer]:
    authority = Authority("fleet-nodes-ca")
    bundle = tmp_path / "ca.pem"
    bundle.write_bytes(authority.pem)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(bundle))
    peer = ArmPeer(authority, token="ack-token")
    yield peer
    peer.stop()


@pytest.fixture
def api(tmp_path: Path) -> Iterator[KubeApi]:
    with KubeApi(cluster_role=FLEET_NODE_ROLE, namespaces=["forewarn", "shop"]) as server:  # the shipped RBAC
        for instance in (0, 1):
            server.add_node(f"aks-pool-vmss00000{instance}", provider_id=f"azure://{POOL}/virtualMachines/{instance}")
        server.add_pod("shop", "web-0", "aks-pool-vmss000000", owner_kind="ReplicaSet")
        server.add_pod("shop", "web-1", "aks-pool-vmss000001", owner_kind="ReplicaSet")
        server.add_pod("kube-system", "proxy-0", "aks-pool-vmss000000", owner_kind="DaemonSet")
        yield server


class Replica:
    """One active replica's approver, running on its own thread as in a term."""

    def __init__(self, api: KubeApi, arm: ArmPeer, tmp_path: Path, name: str, events: list[FleetEvent],
                 snapshots: int = 1, policy: str = POLICY) -> None:
        kubeconfig = str(api.kubeconfig(tmp_path / f"kubeconfig-{name}", namespace="forewarn"))
        self.records: list[Record] = []
        self.metrics = FleetMetrics(["resourcegraph"])
        self.events = events
        self.snapshots = snapshots             # complete snapshots committed in this term
        self.ended_ids: set[str] = set()       # the tracker's memory of ended events
        self.held: str | None = None           # why every action is held (FleetCommitter.reload_failed)
        nodes = FleetNodes(lambda stop: make_client(kubeconfig, stop=stop), self.records.extend, self.metrics,
                           refresh=0.5, poll=0.05)
        self.approver = FleetApprover(parse_policy(policy, fleet=True), Acknowledger(arm.base, FixedToken()),
                                      self.view, self.records.extend, self.metrics.approvals,
                                      tick=0.05, nodes=nodes, held=self.metrics.undo_held)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.approver.run, args=(self.stop,), daemon=True)
        self.thread.start()

    def view(self) -> FleetView:
        return FleetView(tuple(self.events), self.snapshots, True, lambda event_id: event_id.lower() in self.ended_ids,
                         held=self.held)

    def finish(self, event: FleetEvent) -> None:
        """The event ended (as the committer reports it: out of the open events, into the ended memory)."""
        self.ended_ids.add(event.event.event_id.lower())
        self.events[:] = [e for e in self.events if e.event.event_id != event.event.event_id]
        self.approver.ended([completed(event)])

    def end(self) -> None:
        self.stop.set()
        self.thread.join(5)

    def kinds(self) -> list[tuple[str, str, str]]:
        return [(r.data["node"], r.data.get("action") or r.data.get("phase", ""), r.data.get("result", ""))
                for r in list(self.records) if r.data["change"] in ("node_action", "drain")]


def test_the_event_s_nodes_are_drained_before_its_one_approval_and_released_when_it_ends(
        api: KubeApi, arm: ArmPeer, tmp_path: Path) -> None:
    event = scale_set_event(1, ("aks-pool-vmss_0", "aks-pool-vmss_1", "aks-pool-vmss_7"))  # _7: not in this cluster
    arm.rows = [{"id": f"{POOL}/providers/Microsoft.Maintenance/scheduledevents/{event.event.event_id}",
                 "name": event.event.event_id, "subscriptionId": SUB}]
    replica = Replica(api, arm, tmp_path, "a", [event])
    try:
        wait_until(lambda: len(arm.received.acks) == 1, timeout=30, message="the approval")
        # by the time of the approval, both nodes were cordoned and drained (DaemonSet pods stay)
        for node in ("aks-pool-vmss000000", "aks-pool-vmss000001"):
            assert api.node(node)["spec"].get("unschedulable") is True
            assert ("cordon" in [a for n, a, _ in replica.kinds() if n == node])
        assert sorted(pod["metadata"]["name"] for pod in api.pods()) == ["proxy-0"]
        assert replica.metrics.vms_without_node.value == 1
        approved = wait_until(lambda: [r for r in list(replica.records) if r.data["change"] == "approved"],
                              timeout=10, message="the approved records (written after the call)")
        assert len(approved) == 3 and {r.data["policy_rule"] for r in approved} == {"pool-reboots"}
        time.sleep(0.5)
        assert len(arm.received.acks) == 1, "approved once"
        replica.finish(event)                                    # the event ended
        wait_until(lambda: not any(api.node(n)["spec"].get("unschedulable")
                                   for n in ("aks-pool-vmss000000", "aks-pool-vmss000001")), timeout=20,
                   message="both nodes uncordoned")
        assert all(APPLIED not in (api.node(n)["metadata"].get("annotations") or {})
                   for n in ("aks-pool-vmss000000", "aks-pool-vmss000001"))
    finally:
        replica.end()


def test_a_replica_that_takes_over_undoes_what_its_predecessor_left_only_once_it_knows_the_event_is_over(
        api: KubeApi, arm: ArmPeer, tmp_path: Path) -> None:
    """The first replica cordons and drains two nodes and dies before the events end. Its successor does nothing
    to nodes before its term's first complete snapshot, even when a feed says one event ended; after it, it
    undoes what is known to be over (the event with a final status), holds the other (not open, but absent
    from only one complete snapshot) and says so, and undoes that one at the second complete snapshot."""
    events = [scale_set_event(2, ("aks-pool-vmss_0",)), scale_set_event(3, ("aks-pool-vmss_1",))]
    arm.rows = [{"id": f"{POOL}/providers/Microsoft.Maintenance/scheduledevents/{e.event.event_id}",
                 "name": e.event.event_id, "subscriptionId": SUB} for e in events]
    first = Replica(api, arm, tmp_path, "a", list(events))
    wait_until(lambda: len(arm.received.acks) == 2, timeout=30, message="the first replica's approvals")
    first.end()                                                  # gone without undoing anything
    cordoned = ("aks-pool-vmss000000", "aks-pool-vmss000001")
    assert all(api.node(node)["spec"].get("unschedulable") is True for node in cordoned)
    second = Replica(api, arm, tmp_path, "b", [], snapshots=0)   # its tracker knows no event yet
    try:
        second.finish(events[0])                                 # a feed says the first event is over
        time.sleep(1.5)                                          # three refreshes of the nodes
        assert all(api.node(node)["spec"].get("unschedulable") is True for node in cordoned), "undone too early"
        assert second.metrics.undo_held.waiting.value == 1
        second.snapshots = 1                                     # a complete snapshot: the ended one goes
        wait_until(lambda: not api.node("aks-pool-vmss000000")["spec"].get("unschedulable"), timeout=20,
                   message="the undo of the event that ended")
        wait_until(lambda: ("aks-pool-vmss000001", "undo", "held") in second.kinds(), timeout=20,
                   message="the held undo, recorded")
        assert api.node("aks-pool-vmss000001")["spec"].get("unschedulable") is True
        assert second.metrics.undo_held.entries.labels("not_known_over").value == 1
        second.snapshots = 2                                     # missing from two complete snapshots: over
        wait_until(lambda: not api.node("aks-pool-vmss000001")["spec"].get("unschedulable"), timeout=20,
                   message="the undo of what the ledger holds for an event known to be over")
        assert ("aks-pool-vmss000000", "undo", "ok") in second.kinds()
        assert all(APPLIED not in (api.node(node)["metadata"].get("annotations") or {}) for node in cordoned)
        assert len(arm.received.acks) == 2
    finally:
        second.end()


def test_while_the_open_events_are_not_known_nothing_is_undone_and_the_hold_is_recorded(
        api: KubeApi, arm: ArmPeer, tmp_path: Path) -> None:
    """The saved state could not be read back after a failed commit: the tracker in memory lacks the event whose
    node this replica cordoned, with two complete snapshots in the term. Nothing is undone, the hold is recorded
    (`undo`, `held`) and shown; once the state reads again the undo waits for two complete snapshots as always."""
    event = scale_set_event(5, ("aks-pool-vmss_0",))
    arm.rows = [{"id": f"{POOL}/providers/Microsoft.Maintenance/scheduledevents/{event.event.event_id}",
                 "name": event.event.event_id, "subscriptionId": SUB}]
    replica = Replica(api, arm, tmp_path, "a", [event], snapshots=2)
    node = "aks-pool-vmss000000"
    try:
        wait_until(lambda: len(arm.received.acks) == 1, timeout=30, message="the approval")
        assert api.node(node)["spec"].get("unschedulable") is True
        replica.held = "the saved fleet state cannot be read"
        replica.events[:] = []
        wait_until(lambda: (node, "undo", "held") in replica.kinds(), timeout=20, message="the hold, recorded")
        time.sleep(1.0)                                          # two refreshes of the nodes
        assert api.node(node)["spec"].get("unschedulable") is True, "undone while the open events were not known"
        assert replica.metrics.undo_held.waiting.value == 1
        replica.held, replica.snapshots = None, 0               # read again: the term's snapshots start again
        time.sleep(1.0)
        assert api.node(node)["spec"].get("unschedulable") is True
        replica.snapshots = 2
        wait_until(lambda: not api.node(node)["spec"].get("unschedulable"), timeout=20, message="the undo")
    finally:
        replica.end()


def test_entries_of_another_owner_are_never_undone_and_shared_cordons_stay(
        api: KubeApi, arm: ArmPeer, tmp_path: Path) -> None:
    """Another owner (the per-VM agent, another fleet instance) holds a cordon for an event this instance never
    sees: however many complete snapshots lack it, its entry and cordon stay, and this instance's own undo of a
    shared cordon leaves the node cordoned while the other entry holds it."""
    from forewarn.node.actions import KubeNodeActor
    from forewarn.owner import Owner

    kubeconfig = str(api.kubeconfig(tmp_path / "kubeconfig-agent", namespace="forewarn"))
    event = scale_set_event(4, ("aks-pool-vmss_0",))
    arm.rows = [{"id": f"{POOL}/providers/Microsoft.Maintenance/scheduledevents/{event.event.event_id}",
                 "name": event.event.event_id, "subscriptionId": SUB}]
    agent = KubeNodeActor(make_client(kubeconfig), "aks-pool-vmss000000", owner=Owner())
    other = KubeNodeActor(make_client(kubeconfig), "aks-pool-vmss000001", owner=Owner.fleet("subscription x", "ns/b"))
    from forewarn.approval.policy import NodeAction

    imds_only = scale_set_event(5, ("aks-pool-vmss_0",)).event                 # an event the feeds never list
    assert agent.act([NodeAction("cordon")], imds_only, False, lambda outcome: None)
    assert other.act([NodeAction("cordon")], imds_only, False, lambda outcome: None)
    replica = Replica(api, arm, tmp_path, "a", [event], snapshots=5)
    try:
        wait_until(lambda: len(arm.received.acks) == 1, timeout=30, message="this instance's approval")
        replica.finish(event)
        wait_until(lambda: not [ref for ref in replica_entries(api, "aks-pool-vmss000000")
                                if ref.startswith(event.event.event_id)], timeout=20, message="its own undo")
        time.sleep(1.0)                                                          # two more reads of the nodes
        for node in ("aks-pool-vmss000000", "aks-pool-vmss000001"):
            assert api.node(node)["spec"].get("unschedulable") is True, node
            assert [key.split("@")[0] for key in replica_entries(api, node)] == [imds_only.event_id]
        assert replica.metrics.undo_held.entries.labels("other_owner").value == 2
    finally:
        replica.end()


def replica_entries(api: KubeApi, node: str) -> list[str]:
    import json

    text = (api.node(node)["metadata"].get("annotations") or {}).get(APPLIED)
    return sorted(json.loads(text)) if text else []


GONE_POLICY = """
rules:
  - name: spot
    action: hold
    match: {event_type: [Preempt]}
    node: [cordon]
    after_eviction: {mode}
"""


def preempt_event(n: int, resources: tuple[str, ...]) -> FleetEvent:
    from dataclasses import replace

    event = scale_set_event(n, resources)
    raw = {**event.event.raw, "EventType": "Preempt"}
    return replace(event, event=replace(event.event, event_type="Preempt", raw=raw))


def completed(event: FleetEvent) -> Any:
    from dataclasses import replace

    from forewarn.fleet.tracker import EndedBy, FleetChange
    from forewarn.tracker import ChangeKind, Outcome

    done = replace(event, event=replace(event.event, status="Completed", not_before=None,
                                        raw={**event.event.raw, "EventStatus": "Completed", "NotBefore": ""}))
    return FleetChange(ChangeKind.REMOVED, done, event, Outcome.COMPLETED, EndedBy.STATUS)


def not_ready(api: KubeApi, node: str, ready: str = "False") -> None:
    def change(obj: dict[str, Any]) -> None:
        for condition in obj["status"]["conditions"]:
            if condition["type"] == "Ready":
                condition["status"] = ready
    api.update_node(node, change)


def test_after_a_spot_eviction_the_gone_node_is_taken_out_of_service_until_it_is_ready_again(
        api: KubeApi, arm: ArmPeer, tmp_path: Path) -> None:
    """after_eviction: out_of_service, once the Preempt completed: the node that is not Ready gets the
    out-of-service taint (and forewarn's mark), the one that is Ready is left alone and says so; when the
    tainted node is Ready again, forewarn takes its own taint off. Nothing is acknowledged (a hold rule)."""
    event = preempt_event(5, ("aks-pool-vmss_0", "aks-pool-vmss_1"))
    replica = Replica(api, arm, tmp_path, "a", [event], policy=GONE_POLICY.replace("{mode}", "out_of_service"))
    gone, alive = "aks-pool-vmss000000", "aks-pool-vmss000001"
    try:
        wait_until(lambda: all(api.node(n)["spec"].get("unschedulable") for n in (gone, alive)), timeout=20,
                   message="both nodes cordoned")
        not_ready(api, gone)                                     # the VM was evicted
        replica.finish(event)
        wait_until(lambda: any(t["key"] == "node.kubernetes.io/out-of-service"
                               for t in api.node(gone)["spec"].get("taints") or []), timeout=20,
                   message="the out-of-service taint on the gone node")
        mark = api.node(gone)["metadata"]["annotations"]["forewarn.io/out-of-service"]
        assert mark == f"{event.event.event_id}@{replica.approver.nodes.owner.id}"
        wait_until(lambda: ("aks-pool-vmss000001", "out_of_service", "skipped") in replica.kinds(), timeout=10,
                   message="the Ready node left alone")
        assert not any(t["key"] == "node.kubernetes.io/out-of-service" for t in api.node(alive)["spec"].get("taints")
                       or [])
        not_ready(api, gone, "True")                             # a new VM under the same node, say
        wait_until(lambda: not any(t["key"] == "node.kubernetes.io/out-of-service"
                                   for t in api.node(gone)["spec"].get("taints") or []), timeout=20,
                   message="forewarn's taint off the node that is Ready again")
        assert "forewarn.io/out-of-service" not in (api.node(gone)["metadata"].get("annotations") or {})
        assert arm.received.ack_statuses == []
    finally:
        replica.end()


def test_after_a_terminate_delete_node_deletes_only_the_node_that_is_not_ready(
        api: KubeApi, arm: ArmPeer, tmp_path: Path) -> None:
    from dataclasses import replace

    event = preempt_event(6, ("aks-pool-vmss_0", "aks-pool-vmss_1"))
    event = replace(event, event=replace(event.event, event_type="Terminate"))
    replica = Replica(api, arm, tmp_path, "a", [event],
                      policy=GONE_POLICY.replace("{mode}", "delete_node").replace("Preempt", "Terminate"))
    try:
        wait_until(lambda: api.node("aks-pool-vmss000000")["spec"].get("unschedulable"), timeout=20,
                   message="cordoned")
        not_ready(api, "aks-pool-vmss000000")
        replica.finish(event)
        wait_until(lambda: ("aks-pool-vmss000000", "delete_node", "ok") in replica.kinds(), timeout=20,
                   message="the gone node deleted")
        with pytest.raises(KeyError):
            api.node("aks-pool-vmss000000")
        assert api.node("aks-pool-vmss000001")["metadata"]["name"] == "aks-pool-vmss000001"
        assert ("aks-pool-vmss000001", "delete_node", "skipped") in replica.kinds()
    finally:
        replica.end()
