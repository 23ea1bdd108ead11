"""Node actions, part 2, against the strict API stand-in (tests/peers/kube_api.py) with the real client: the
drain's order by pod priority (tier by tier, critical classes last), the DaemonSet stop by a NoExecute taint
(forewarn's own pod stays), the deadline plan (report or delete), the drain's records and Kubernetes Events,
the node annotation that turns node actions off, and a restart in the middle of each tier.

The approver runs in-process (the Harness of test_node_actions.py); tests wait with wait_until, never a sleep.
"""

from __future__ import annotations

import ast
import logging
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from forewarn.approval.approver import Stage
from forewarn.approval.policy import PolicyError, parse_policy
from forewarn.node.actions import APPLIED
from forewarn.records import Record
from forewarn.sinks.slack import slack_message
from forewarn.sinks.teams import adaptive_card
from test_node_actions import CLUSTER_ROLE, RECORD_SCHEMA, Harness, imds_event

from conftest import agent_ledger, wait_until
from peers.kube_api import KubeApi

DRAIN = """
rules:
  - name: reboot
    match: {event_type: [Reboot]}
    node: [cordon, {drain: {OPTIONS}}]
    action: approve
"""
#: Four tiers, named so that the alphabetical order (the order of the pod list) is the reverse of the
#: priority order: a drain that ignored priorities would evict them a, b, c, d.
TIERS = [("d-low", -10, None), ("c-default", None, None), ("b-high", 1000, "high"),
         ("a-critical", 2000000000, "system-cluster-critical")]


def policy(options: str) -> str:
    return DRAIN.replace("OPTIONS", options)


@pytest.fixture
def api() -> Iterator[KubeApi]:
    server = KubeApi(cluster_role=CLUSTER_ROLE)
    yield server
    server.stop()


@pytest.fixture
def harnesses(tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def make(api: KubeApi, text: str, **kwargs: Any) -> Harness:
        harness = Harness(api, tmp_path, text, **kwargs)
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.close()


def add_tiers(api: KubeApi, grace: int = 30) -> None:
    api.add_node("node-1")
    for name, priority, klass in TIERS:
        api.add_pod("shop", name, "node-1", labels={"app": name}, owner_kind="ReplicaSet", grace=grace,
                    priority=priority, priority_class=klass)


def drain_records(h: Harness, phase: str | None = None) -> list[dict[str, Any]]:
    with h._lock:
        return [r for r in h.records if r["data"]["change"] == "drain" and phase in (None, r["data"]["phase"])]


def ledger(api: KubeApi) -> dict[str, Any]:
    return agent_ledger(api.node("node-1"))


def evicted(api: KubeApi) -> list[str]:
    return [pod for _, pod, _ in api.evictions]


# --- 1. the order ----------------------------------------------------------------------------------

def test_evictions_go_by_priority_tier_by_tier_each_waited_for_critical_last(
        api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    add_tiers(api)
    api.add_pdb("shop", "low", {"app": "d-low"}, max_unavailable=0)   # holds the first tier for a while
    h = harnesses(api, policy("timeout: 60, margin: 1"))
    h.poll(imds_event())
    wait_until(lambda: any(r.status == 429 for r in api.requests), timeout=10, message="the lowest tier blocked")
    time.sleep(0.5)  # several more looks at the pods: none may move on to the next tier
    assert evicted(api) == [], "no later tier starts while the first is blocked and its time is not up"
    assert ledger(api)["E1"]["drain"]["tier"] == [0, -10]
    api.set_pdb_allowed("shop", "low", 1)
    wait_until(lambda: h.approver.stage("E1") is Stage.ACTED, timeout=20, message="the drain")
    assert evicted(api) == ["d-low", "c-default", "b-high", "a-critical"]
    assert h.actions() == [("cordon", "ok"), ("drain", "ok")]


def test_a_tier_whose_time_is_up_lets_the_next_start_and_report_fails_at_the_deadline_naming_pods_and_budget(
        api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    api.add_node("node-1")
    api.add_pod("shop", "b-low", "node-1", labels={"app": "low"}, owner_kind="ReplicaSet", priority=-5)
    api.add_pod("shop", "a-high", "node-1", labels={"app": "high"}, owner_kind="ReplicaSet", priority=100)
    api.add_pdb("shop", "keep-low", {"app": "low"}, max_unavailable=0)   # never allows it
    h = harnesses(api, policy("timeout: 3, margin: 1"))   # two tiers: 1.5 s each, then the deadline
    h.poll(imds_event())
    wait_until(lambda: h.approver.stage("E1") is Stage.ACT_FAILED, timeout=15, message="the deadline")
    assert evicted(api) == ["a-high"], "the next tier went once the blocked tier's share was up"
    detail = h.detail("drain")
    assert "drain deadline passed" in detail and "shop/b-low by keep-low" in detail
    (failed,) = drain_records(h, "failed")
    assert failed["data"]["blocked"] == [{"pod": "shop/b-low", "budget": "keep-low"}]
    assert failed["data"]["evicted_count"] == 1 and "deadline" in failed["data"]["reason"]
    assert api.pod("shop", "b-low") is not None and api.deletions == [], "report never deletes"
    h.poll(imds_event())
    h.settle()
    assert h.starts.posts == []  # on_failure: hold
    assert h.scrape("azure_scheduled_events_node_drain_blocked_since_timestamp_seconds") == 0


def test_order_none_evicts_every_pod_at_once_and_the_policy_shows_the_order(
        api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    add_tiers(api)
    h = harnesses(api, policy("order: none, timeout: 60"))
    h.poll(imds_event())
    wait_until(lambda: h.approver.stage("E1") is Stage.ACTED, timeout=10)
    assert evicted(api) == ["a-critical", "b-high", "c-default", "d-low"]   # the list's order
    described = parse_policy(policy("timeout: 60, last: [batch-critical]")).rules[0].node[1].describe()
    assert "by pod priority, lowest first, each tier waited for; batch-critical last" in described
    assert "every pod at once" in parse_policy(policy("order: none")).rules[0].node[1].describe()


def test_a_class_named_in_last_goes_after_higher_priorities(api: KubeApi,
                                                            harnesses: Callable[..., Harness]) -> None:
    api.add_node("node-1")
    api.add_pod("shop", "a-batch", "node-1", owner_kind="ReplicaSet", priority=5, priority_class="batch-critical")
    api.add_pod("shop", "b-web", "node-1", owner_kind="ReplicaSet", priority=1000)
    h = harnesses(api, policy("timeout: 60, last: [batch-critical]"))
    h.poll(imds_event())
    wait_until(lambda: h.approver.stage("E1") is Stage.ACTED, timeout=10)
    assert evicted(api) == ["b-web", "a-batch"]


def test_bad_drain_options_are_refused_with_their_position() -> None:
    bad = {
        "order: random": "p.yaml:5: rules[0].node[1].drain.order: 'random' is not valid; valid: priority, none",
        "at_deadline: kill": "p.yaml:5: rules[0].node[1].drain.at_deadline: 'kill' is not valid; valid: report, delete",
        "last: [Not_A_Name]": "p.yaml:5: rules[0].node[1].drain.last[0]: 'Not_A_Name' is not a PriorityClass name",
        "stop_daemonsets: yes please": "p.yaml:5: rules[0].node[1].drain.stop_daemonsets: 'yes please' is not of type",
        "stop_daemonsets: true, selector: app=web": "p.yaml:5: rule reboot: rules[0].node[1].drain.stop_daemonsets: "
        "stop_daemonsets taints the whole node NoExecute",
    }
    for options, message in bad.items():
        with pytest.raises(PolicyError) as info:
            parse_policy(policy(options), "p.yaml")
        assert str(info.value).startswith(message), str(info.value)


# --- restart in the middle of each tier ----------------------------------------------------------------

@pytest.mark.parametrize("blocked", [0, 1, 2, 3])
def test_a_restart_in_the_middle_of_a_tier_resumes_that_tier(
        blocked: int, api: KubeApi, harnesses: Callable[..., Harness], caplog: pytest.LogCaptureFixture) -> None:
    add_tiers(api)
    name = TIERS[blocked][0]
    api.add_pdb("shop", "hold", {"app": name}, max_unavailable=0)
    first = harnesses(api, policy("timeout: 120, margin: 1"))
    first.poll(imds_event())
    wait_until(lambda: any(r.status == 429 for r in api.requests), timeout=10, message=f"{name} blocked")
    before = ledger(api)["E1"]["drain"]
    assert evicted(api) == [pod for pod, _, _ in TIERS[:blocked]]
    first.close()   # stopped mid-tier: not a failure
    first.settle()
    assert ("drain", "failed") not in first.actions()
    second = harnesses(api, policy("timeout: 120, margin: 1"))
    with caplog.at_level(logging.WARNING, logger="forewarn.node.drain"):
        second.poll(imds_event())
        wait_until(lambda: "resuming the drain" in caplog.text, timeout=10)
    wait_until(lambda: sum(r.status == 429 for r in api.requests) >= 2, timeout=10, message="blocked again")
    resumed = ledger(api)["E1"]["drain"]
    assert (resumed["tier"], resumed["tier_until"], resumed["deadline"]) == (
        before["tier"], before["tier_until"], before["deadline"]), "the same tier, its same share of time"
    assert evicted(api) == [pod for pod, _, _ in TIERS[:blocked]], "no later tier started after the restart"
    api.set_pdb_allowed("shop", "hold", 1)
    wait_until(lambda: second.approver.stage("E1") is Stage.ACTED, timeout=20, message="the drain")
    assert evicted(api) == ["d-low", "c-default", "b-high", "a-critical"]  # in order, each once
    assert ledger(api)["E1"]["drain"]["done"] is True
    assert drain_records(second, "started")[0]["data"]["resumed"] is True


# --- 2. DaemonSets stop after the drain; forewarn stays ----------------------------------------------

def test_stop_daemonsets_taints_noexecute_so_other_daemonsets_stop_and_forewarn_stays(
        harnesses: Callable[..., Harness]) -> None:
    api = KubeApi(cluster_role=CLUSTER_ROLE, grace_scale=0.05)
    try:
        api.add_node("node-1")
        api.add_pod("shop", "web-1", "node-1", owner_kind="ReplicaSet", grace=4)
        api.add_pod("logging", "fluent-bit-x1", "node-1", owner_kind="DaemonSet", grace=10)
        api.add_pod("monitoring", "forewarn-a1", "node-1", owner_kind="DaemonSet",
                    tolerations=[{"key": "forewarn.io/drained", "operator": "Exists", "effect": "NoExecute"}])
        api.add_pod("kube-system", "etcd-node-1", "node-1", mirror=True)
        h = harnesses(api, policy("timeout: 60, stop_daemonsets: true"))
        h.actor.own_pod = ("monitoring", "forewarn-a1")   # in a cluster: the service account's namespace, hostname
        h.poll(imds_event())
        wait_until(lambda: h.approver.stage("E1") is Stage.ACTED, timeout=15, message="the drain and the stop")
        assert api.pod("logging", "fluent-bit-x1") is None, "the log shipper stopped"
        assert api.taint_evictions == [("logging", "fluent-bit-x1")]
        assert evicted(api) == ["web-1"], "DaemonSet pods are never evicted, they stop by the taint"
        assert api.pod("monitoring", "forewarn-a1") is not None and api.pod("kube-system", "etcd-node-1")
        taints = api.node("node-1")["spec"]["taints"]
        assert {"key": "forewarn.io/drained", "value": "Reboot", "effect": "NoExecute"} in taints
        detail = h.detail("drain")
        assert "its DaemonSet pods stopped, 1 tolerate the taint and stay (monitoring/forewarn-a1)" in detail
        h.poll(imds_event(status="Started"))
        h.poll()   # the event is over: the taint goes with the cordon
        h.settle()
        node = api.node("node-1")
        assert not node["spec"].get("taints") and not node["spec"].get("unschedulable")
    finally:
        api.stop()


def test_stop_daemonsets_refuses_to_taint_when_forewarns_own_pod_would_be_stopped(
        api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    api.add_node("node-1")
    api.add_pod("monitoring", "forewarn-a1", "node-1", owner_kind="DaemonSet")   # no toleration
    h = harnesses(api, policy("timeout: 60, stop_daemonsets: true"))
    h.actor.own_pod = ("monitoring", "forewarn-a1")
    h.poll(imds_event())
    wait_until(lambda: h.approver.stage("E1") is Stage.ACT_FAILED, timeout=10)
    assert "forewarn's own pod monitoring/forewarn-a1 does not tolerate it" in h.detail("drain")
    assert not api.node("node-1")["spec"].get("taints") and api.pod("monitoring", "forewarn-a1") is not None
    assert [r["data"]["phase"] for r in drain_records(h)] == ["started", "failed"]


def test_dry_run_says_which_daemonset_pods_would_stop(api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    api.add_node("node-1")
    api.add_pod("logging", "fluent-bit-x1", "node-1", owner_kind="DaemonSet")
    api.add_pod("monitoring", "forewarn-a1", "node-1", owner_kind="DaemonSet", tolerations=[{"operator": "Exists"}])
    h = harnesses(api, policy("stop_daemonsets: true"), dry_run=True)
    h.poll(imds_event())
    wait_until(lambda: h.approver.stage("E1") is Stage.ACTED, timeout=10)
    assert ("1 DaemonSet pod(s) would stop (logging/fluent-bit-x1), 1 tolerate it and stay "
            "(monitoring/forewarn-a1)") in h.detail("drain")
    assert [r for r in api.requests if r.method not in ("GET", "HEAD")] == []


# --- 3. the deadline plan ------------------------------------------------------------------------------

def test_at_deadline_delete_deletes_the_pods_left_with_the_grace_left_and_records_each(
        api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    api.add_node("node-1")
    api.add_pod("shop", "web-1", "node-1", labels={"app": "web"}, owner_kind="ReplicaSet", grace=120)
    api.add_pod("shop", "api-1", "node-1", owner_kind="ReplicaSet")
    api.add_pod("logging", "fluent-bit-x1", "node-1", owner_kind="DaemonSet")
    api.add_pod("kube-system", "etcd-node-1", "node-1", mirror=True)
    api.add_pdb("shop", "web", {"app": "web"}, max_unavailable=0)
    h = harnesses(api, policy("margin: 5, at_deadline: delete"))
    h.poll(imds_event(notice=9))   # the deadline is NotBefore - 5 s: about 4 s away
    wait_until(lambda: h.approver.stage("E1") is Stage.ACTED, timeout=20, message="the drain")
    deadline = ledger(api)["E1"]["drain"]["deadline"]
    (deletion,) = api.deletions
    assert deletion[:2] == ("shop", "web-1") and deletion[2] is not None and 1 <= deletion[2] <= 5, deletion
    (deleted,) = drain_records(h, "deleted")
    assert deleted["data"]["pod"] == "shop/web-1" and deleted["data"]["budget"] == "web"
    moment = deleted["time"].replace("Z", "+00:00")
    assert datetime.fromisoformat(moment).timestamp() >= deadline - 0.001, "never before the deadline"
    assert evicted(api) == ["api-1"]
    assert api.pod("kube-system", "etcd-node-1") and api.pod("logging", "fluent-bit-x1"), "mirror and DaemonSet stay"
    assert h.actions()[-1] == ("drain", "ok") and "deleted 1 at the deadline (shop/web-1)" in h.detail("drain")
    assert h.scrape("azure_scheduled_events_node_drain_pods_total", outcome="deleted") == 1
    assert h.scrape("azure_scheduled_events_node_drain_pods_total", outcome="evicted") == 1
    (pod_event,) = [e for e in api.events() if e["reason"] == "DeletedAtDeadline"]
    assert pod_event["regarding"]["name"] == "web-1" and pod_event["metadata"]["namespace"] == "shop"


# --- 4. records and Kubernetes Events of a drain blocked, then freed -------------------------------------

def test_a_drain_blocked_then_freed_is_followed_by_records_and_events(
        api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    api.add_node("node-1")
    api.add_pod("shop", "web-1", "node-1", labels={"app": "web"}, owner_kind="ReplicaSet")
    api.add_pdb("shop", "web", {"app": "web"}, max_unavailable=0)
    h = harnesses(api, policy("timeout: 60"))
    event = imds_event()
    h.poll(event)
    wait_until(lambda: drain_records(h, "blocked"), timeout=10, message="the blocked record")
    since = h.scrape("azure_scheduled_events_node_drain_blocked_since_timestamp_seconds")
    assert since is not None and abs(since - time.time()) < 30
    time.sleep(1.0)   # 20 more looks, every one blocked: still one record (at most one a minute)
    assert len(drain_records(h, "blocked")) == 1
    api.set_pdb_allowed("shop", "web", 1)
    wait_until(lambda: h.approver.stage("E1") is Stage.ACTED, timeout=15)
    assert h.scrape("azure_scheduled_events_node_drain_blocked_since_timestamp_seconds") == 0
    phases = [r["data"]["phase"] for r in drain_records(h)]
    assert phases == ["started", "blocked", "done"]
    started, blocked, done = drain_records(h)
    assert blocked["data"]["blocked"] == [{"pod": "shop/web-1", "budget": "web"}]
    assert done["data"]["evicted"] == ["shop/web-1"] and done["data"]["evicted_count"] == 1
    assert done["data"]["seconds"] >= 1.0 and started["data"]["at_deadline"] == "report"
    for record in drain_records(h):
        jsonschema.validate(record, RECORD_SCHEMA)
        assert record["type"] == "io.github.forewarn.scheduled_event.drain" and record["subject"] == "E1"
        assert record["data"]["policy_rule"] == "reboot" and record["data"]["node"] == "node-1"
    assert len({r["id"] for r in drain_records(h)}) == 3
    # Kubernetes Events: on the node for each step, on the pod evicted; each names the event and NotBefore.
    events = api.events()
    on_node = [e["reason"] for e in events if e["regarding"]["kind"] == "Node"]
    assert sorted(on_node) == ["DrainBlocked", "DrainDone", "DrainStarted"]
    (on_pod,) = [e for e in events if e["regarding"]["kind"] == "Pod"]
    assert (on_pod["reason"], on_pod["regarding"]["name"], on_pod["metadata"]["namespace"]) == (
        "EvictedForMaintenance", "web-1", "shop")
    for kube_event in events:
        assert "Azure scheduled event E1 (Reboot)" in kube_event["note"]
        assert f"NotBefore {event['NotBefore']}" in kube_event["note"]
    # Slack and Teams render them readably.
    record = Record.from_dict(blocked)
    message = slack_message(record, time.time(), None)
    assert message["blocks"][0]["text"]["text"] == "Reboot: drain of node node-1 blocked by a PodDisruptionBudget"
    fields = [f["text"] for f in message["blocks"][1]["fields"]]
    assert "*Blocked*\nshop/web-1 (PDB web)" in fields and "*Node*\nnode-1" in fields
    card = adaptive_card(Record.from_dict(done), time.time(), None)["attachments"][0]["content"]
    assert card["body"][0]["text"] == "Reboot: drain of node node-1 done"
    facts = {f["title"]: f["value"] for f in card["body"][1]["facts"]}
    assert facts["Drain"] == "done" and facts["Evicted"].startswith("1 pod(s) in ")


# --- 5. the node annotation ----------------------------------------------------------------------------

def test_a_node_annotated_disabled_is_left_alone_recorded_and_counted(
        api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    api.add_node("node-1", annotations={"forewarn.io/node-actions": "disabled"})
    api.add_node("node-2")
    api.add_pod("shop", "web-1", "node-1", owner_kind="ReplicaSet")
    api.add_pod("shop", "web-2", "node-2", owner_kind="ReplicaSet")
    off = harnesses(api, policy("timeout: 60"))
    on = harnesses(api, policy("timeout: 60"), node="node-2", vm="vm-2")
    off.poll(imds_event(resources=("vm-1", "vm-2")))
    on.poll(imds_event(resources=("vm-1", "vm-2")))
    wait_until(lambda: off.approver.stage("E1") is Stage.ACT_FAILED, timeout=10)
    wait_until(lambda: on.approver.stage("E1") is Stage.ACTED, timeout=10)
    assert off.actions() == [("cordon", "skipped"), ("drain", "skipped")]
    assert "forewarn.io/node-actions=disabled" in off.detail("drain")
    assert off.counter("cordon", "skipped") == 1 and off.counter("drain", "skipped") == 1
    node = api.node("node-1")
    assert not node["spec"].get("unschedulable") and APPLIED not in node["metadata"]["annotations"]
    assert api.pod("shop", "web-1") is not None and evicted(api) == ["web-2"]
    assert api.node("node-2")["spec"]["unschedulable"] is True
    off.poll(imds_event(resources=("vm-1", "vm-2")))
    off.settle()
    assert off.starts.posts == []   # on_failure: hold, as for a failed action
    for record in off.records:
        jsonschema.validate(record, RECORD_SCHEMA)


# --- 6. one direction of use ----------------------------------------------------------------------------

def test_node_modules_import_in_one_direction_only() -> None:
    # actions -> drain -> (daemonsets -> drainrun, slots) -> pods -> nodeapi -> kube: nothing imports back up,
    # not even for type checking.
    folder = Path(__file__).parent.parent / "src" / "forewarn" / "node"

    def imported(module: str) -> set[str]:
        tree = ast.parse((folder / f"{module}.py").read_text())
        return ({node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
                | {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names})

    assert "forewarn.node.drain" in imported("actions") and "forewarn.node.nodeapi" in imported("drain")
    assert not imported("drain") & {"forewarn.node.actions", "forewarn.node"}
    for lower in ("daemonsets", "drainrun", "pods", "slots", "nodeapi"):
        assert not imported(lower) & {"forewarn.node.actions", "forewarn.node.drain", "forewarn.node"}, lower
