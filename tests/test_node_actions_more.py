"""More Kubernetes node actions against the strict API stand-in (tests/peers/kube_api.py): the options beyond
their defaults, the drain deadline, the cap's Lease taken over after its holder died, undo retried after a
transient API error, `policy explain`, where the client configuration comes from, and a SIGHUP reload that
adds node actions to a run without --node-name.

The approver runs in-process (the Harness of test_node_actions.py), so tests wait with wait_until.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from forewarn.approval.approver import Stage
from test_node_actions import CLUSTER_ROLE, Harness, imds_event

from conftest import wait_until
from peers.kube_api import KubeApi

RELOAD_OK = "azure_scheduled_events_policy_last_reload_successful"


@pytest.fixture
def api() -> Iterator[KubeApi]:
    server = KubeApi(cluster_role=CLUSTER_ROLE)
    yield server
    server.stop()


@pytest.fixture
def harnesses(tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def make(api: KubeApi, policy: str, **kwargs: object) -> Harness:
        harness = Harness(api, tmp_path, policy, **kwargs)  # type: ignore[arg-type]
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.close()


def ledger(api: KubeApi, node: str = "node-1") -> dict[str, object]:
    text = api.node(node)["metadata"].get("annotations", {}).get("forewarn.io/applied")
    return json.loads(text) if text else {}


# --- 1. options beyond their defaults ---------------------------------------------------------------

def test_custom_taint_label_and_event_are_applied_as_configured_and_undone(
        api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    api.add_node("node-1", labels={"kubernetes.io/hostname": "node-1"})
    h = harnesses(api, """
rules:
  - name: reboot
    match: {event_type: [Reboot]}
    node:
      - {taint: {key: example.com/maintenance, value: soon, effect: NoExecute}}
      - {label: {key: example.com/draining, value: "yes"}}
      - {event: {reason: NodeMaintenanceAhead, type: Normal}}
    action: hold
""")
    event = imds_event()
    event["Description"] = "Host update"
    h.poll(event)
    wait_until(lambda: h.approver.stage("E1") is Stage.ACTED, timeout=10, message="the actions")
    node = api.node("node-1")
    assert node["spec"]["taints"] == [{"key": "example.com/maintenance", "value": "soon", "effect": "NoExecute"}]
    assert node["metadata"]["labels"]["example.com/draining"] == "yes"
    assert not node["spec"].get("unschedulable")  # no cordon was asked for
    (kube_event,) = api.events()
    assert (kube_event["reason"], kube_event["type"], kube_event["action"]) == ("NodeMaintenanceAhead", "Normal",
                                                                                "Reboot")
    assert "E1" in kube_event["note"] and event["NotBefore"] in kube_event["note"]
    assert "Host update" in kube_event["note"]
    assert h.actions() == [("taint", "ok"), ("label", "ok"), ("event", "ok")]
    assert "example.com/maintenance=soon:NoExecute" in h.detail("taint")
    assert h.counter("taint", "ok") == 1 and h.counter("label", "ok") == 1 and h.counter("event", "ok") == 1
    assert ledger(api)["E1"] == {"taints": [["example.com/maintenance", "NoExecute"]],
                                 "labels": ["example.com/draining"]}

    h.poll()  # cancelled: the taint and label go, the node's own label stays
    h.settle()
    node = api.node("node-1")
    assert not node["spec"].get("taints")
    assert node["metadata"]["labels"] == {"kubernetes.io/hostname": "node-1"}
    assert ledger(api) == {} and h.actions()[-1] == ("undo", "ok")


def test_the_label_value_defaults_to_the_event_type(api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    api.add_node("node-1")
    h = harnesses(api, """
rules:
  - name: freeze
    match: {event_type: [Freeze]}
    node: [{label: {key: example.com/event}}]
    action: hold
""")
    h.poll(imds_event(event_type="Freeze"))
    wait_until(lambda: h.approver.stage("E1") is Stage.ACTED, timeout=10)
    assert api.node("node-1")["metadata"]["labels"]["example.com/event"] == "Freeze"


DRAIN_LOCAL = """
rules:
  - name: reboot
    match: {event_type: [Reboot]}
    node: [cordon, {drain: {timeout: 30, margin: 1, delete_local_data: DELETE}}]
    action: hold
"""


def test_pods_with_local_storage_stay_and_fail_the_drain_unless_delete_local_data(
        api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    api.add_node("node-1")
    api.add_pod("shop", "cache-1", "node-1", owner_kind="ReplicaSet", local_storage=True)
    api.add_pod("shop", "web-1", "node-1", owner_kind="ReplicaSet")
    h = harnesses(api, DRAIN_LOCAL.replace("DELETE", "false"))
    h.poll(imds_event())
    wait_until(lambda: h.approver.stage("E1") is Stage.ACT_FAILED, timeout=10, message="the failed drain")
    assert [pod for _, pod, _ in api.evictions] == ["web-1"]
    assert [p["metadata"]["name"] for p in api.pods()] == ["cache-1"]
    detail = h.detail("drain")
    assert "shop/cache-1" in detail and "delete_local_data: true" in detail
    assert h.counter("drain", "failed") == 1


def test_delete_local_data_evicts_pods_with_an_empty_dir(api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    api.add_node("node-1")
    api.add_pod("shop", "cache-1", "node-1", owner_kind="ReplicaSet", local_storage=True)
    api.add_pod("shop", "web-1", "node-1", owner_kind="ReplicaSet")
    h = harnesses(api, DRAIN_LOCAL.replace("DELETE", "true"))
    h.poll(imds_event())
    wait_until(lambda: h.approver.stage("E1") is Stage.ACTED, timeout=10, message="the drain")
    assert sorted(pod for _, pod, _ in api.evictions) == ["cache-1", "web-1"]
    assert api.pods() == [] and h.counter("drain", "ok") == 1


DRAIN_TIMEOUT = """
rules:
  - name: reboot
    match: {event_type: [Reboot]}
    node: [cordon, {drain: {timeout: 1.5, margin: 1}}]
    action: approve
    on_failure: ON_FAILURE
"""


@pytest.mark.parametrize("on_failure", ["hold", "approve"])
def test_a_drain_a_pdb_never_allows_fails_at_its_deadline_and_on_failure_decides(
        on_failure: str, api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    api.add_node("node-1")
    api.add_pod("shop", "web-1", "node-1", labels={"app": "web"}, owner_kind="ReplicaSet")
    api.add_pdb("shop", "web", {"app": "web"}, max_unavailable=0)
    h = harnesses(api, DRAIN_TIMEOUT.replace("ON_FAILURE", on_failure))
    h.poll(imds_event())
    wait_until(lambda: h.approver.stage("E1") is not Stage.ACTING, timeout=10, message="the drain deadline")
    assert h.approver.stage("E1") is Stage.ACT_FAILED
    blocked = [r for r in api.requests if r.path.endswith("/eviction")]
    assert blocked and all(r.status == 429 for r in blocked), "tried again and again until the deadline"
    assert "drain deadline passed" in h.detail("drain") and "shop/web-1" in h.detail("drain")
    assert h.counter("drain", "failed") == 1 and h.counter("drain", "ok") == 0
    assert h.scrape("azure_scheduled_events_node_drains_in_progress") == 0
    (lease,) = api.leases()
    assert not lease["spec"].get("holderIdentity"), "a failed drain frees its slot"
    h.poll(imds_event())
    h.settle()
    if on_failure == "hold":
        assert h.starts.posts == [] and h.approver.stage("E1") is Stage.ACT_FAILED
    else:
        wait_until(lambda: h.starts.posts == [["E1"]], timeout=5, message="the approval despite the failure")
        assert h.approver.stage("E1") is Stage.APPROVED
    assert api.pods() and api.node("node-1")["spec"]["unschedulable"] is True
