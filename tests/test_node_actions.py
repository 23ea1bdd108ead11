"""Kubernetes node actions with the REAL client (lightkube) against the strict API stand-in (tests/peers/kube_api.py),
which answers 403 by the ClusterRole shipped in deploy/kubernetes/components/node-actions.

The approver runs in-process, fed documents as the poll loop feeds it (one test polls the IMDS simulator);
its node actions run on its pool, so tests wait for outcomes with wait_until, never a sleep.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from forewarn.approval.approver import Approver, Stage
from forewarn.approval.policy import PolicyError, parse_policy
from forewarn.approval.starter import StartError
from forewarn.imds.client import ImdsClient
from forewarn.imds.document import format_not_before, parse_document
from forewarn.imds.instance import VmInfo
from forewarn.metrics import Metrics
from forewarn.node import KubeNodeActor
from forewarn.node.actions import APPLIED
from forewarn.node.kube import make_client
from forewarn.records import Record
from forewarn.tracker import Tracker

from conftest import SimulatorHandle, agent_ledger, parse_metrics, sample, wait_until
from peers.kube_api import KubeApi

ROOT = Path(__file__).parent.parent
CLUSTER_ROLE = ROOT / "deploy" / "kubernetes" / "components" / "node-actions" / "clusterrole.yaml"
RECORD_SCHEMA = json.loads((ROOT / "src" / "forewarn" / "schemas" / "record.schema.json").read_text())
CONDITION = "ForewarnScheduledEvent"

REBOOT_POLICY = """
rules:
  - name: reboot
    match: {event_type: [Reboot]}
    node: [cordon, condition, event, {drain: {timeout: 60, margin: 1}}]
    action: approve
"""


class Starts:
    def __init__(self) -> None:
        self.posts: list[list[str]] = []

    def start(self, event_ids: Sequence[str]) -> None:
        self.posts.append(list(event_ids))


class Failing:
    def start(self, event_ids: Sequence[str]) -> None:
        raise StartError("not expected")


def imds_event(event_id: str = "E1", *, event_type: str = "Reboot", status: str = "Scheduled", notice: float = 600,
               resources: Sequence[str] = ("vm-1",)) -> dict[str, Any]:
    not_before = datetime.fromtimestamp(time.time() + notice, tz=timezone.utc)
    return {"EventId": event_id, "EventType": event_type, "ResourceType": "VirtualMachine",
            "Resources": list(resources), "EventStatus": status, "EventSource": "Platform", "DurationInSeconds": -1,
            "Description": "", "NotBefore": format_not_before(not_before) if status == "Scheduled" else ""}


class Harness:
    """One forewarn instance: an approver with a real KubeNodeActor for `node`, fed documents by `poll`."""

    def __init__(self, api: KubeApi, tmp_path: Path, policy: str, node: str = "node-1", vm: str = "vm-1",
                 dry_run: bool = False) -> None:
        self.api = api
        self.node = node
        self.vm = VmInfo(name=vm)
        self.metrics = Metrics()
        self.records: list[dict[str, Any]] = []
        self.tracker = Tracker()
        self.incarnation = 0
        self.starts = Starts()
        kubeconfig = api.kubeconfig(tmp_path / f"kubeconfig-{node}", namespace="forewarn")
        self.actor = KubeNodeActor(make_client(str(kubeconfig)), node, poll=0.05,
                                   draining=self.metrics.node_drains.set,
                                   blocked=self.metrics.node_drain_blocked_since.set)
        self.approver = Approver(parse_policy(policy), self.starts, self.metrics, self._spool, dry_run=dry_run,
                                 workers=2, actor=self.actor)
        self._lock = threading.Lock()

    def _spool(self, records: Sequence[Record]) -> None:
        with self._lock:
            self.records.extend(record.to_dict() for record in records)

    def poll(self, *events: dict[str, Any]) -> None:
        current = self.tracker.current
        if current is None or [dict(e.raw) for e in current.events] != list(events):
            self.incarnation += 1
        document = parse_document({"DocumentIncarnation": self.incarnation, "Events": list(events)})
        self.approver.on_changes(document, self.tracker.apply(document), self.vm)

    def settle(self) -> None:
        assert self.approver.idle(timeout=60), "the approver's work did not finish"

    def actions(self) -> list[tuple[str, str]]:
        with self._lock:
            return [(r["data"]["action"], r["data"]["result"]) for r in self.records
                    if r["data"]["change"] == "node_action"]

    def detail(self, action: str) -> str:
        with self._lock:
            return next(r["data"]["detail"] for r in self.records
                        if r["data"]["change"] == "node_action" and r["data"]["action"] == action)

    def scrape(self, name: str, **labels: str) -> float | None:
        return sample(parse_metrics(self.metrics.render()[0].decode()), name, **labels)

    def counter(self, action: str, result: str) -> float | None:
        return self.scrape("azure_scheduled_events_node_actions_total", action=action, result=result)

    def close(self) -> None:
        self.approver.close()


@pytest.fixture
def api() -> Iterator[KubeApi]:
    server = KubeApi(cluster_role=CLUSTER_ROLE)
    yield server
    server.stop()


@pytest.fixture
def harnesses(tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def make(api: KubeApi, policy: str, **kwargs: Any) -> Harness:
        harness = Harness(api, tmp_path, policy, **kwargs)
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.close()


def conditions(node: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in node["status"]["conditions"]}


def writes(api: KubeApi) -> list[str]:
    return [f"{r.method} {r.path}" for r in api.requests if r.method not in ("GET", "HEAD")]


# --- policy -------------------------------------------------------------------------------------

def test_policy_compiles_node_actions_and_refuses_mistakes_with_their_position() -> None:
    policy = parse_policy(REBOOT_POLICY)
    assert [a.kind for a in policy.rules[0].node] == ["cordon", "condition", "event", "drain"]
    assert policy.uses_node_actions and not parse_policy("rules: [{name: a, action: hold}]").uses_node_actions
    drain = policy.rules[0].node[3]
    assert (drain.timeout, drain.margin, drain.max_nodes, drain.delete_local_data) == (60.0, 1.0, 1, False)
    bad = {
        "node: [reboot]": "p.yaml:4: rules[0].node[0]: 'reboot' is not a node action; valid: cordon, taint",
        "node: [{condition: {type: VMEventScheduled}}]": "p.yaml:4: rules[0].node[0].condition.type: "
        "'VMEventScheduled' must start with Forewarn",
        "node: [{drain: {timeout: 0}}]": "p.yaml:4: rules[0].node[0].drain.timeout: 0 is out of range",
        "node: [{taint: {key: 'a b'}}]": "p.yaml:4: rules[0].node[0].taint.key: 'a b' is not a valid Kubernetes key",
        "on_failure: approve": "p.yaml:4: rules[0].on_failure: on_failure applies to the rule's node actions",
    }
    for text, message in bad.items():
        with pytest.raises(PolicyError) as info:
            parse_policy(f"rules:\n  - name: r\n    action: approve\n    {text}\n", "p.yaml")
        assert str(info.value).startswith(message), str(info.value)


# --- the scenarios --------------------------------------------------------------------------------

def test_reboot_drains_through_a_pdb_that_blocks_then_allows_approves_and_undoes(
        api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    api.add_node("node-1")
    api.add_node("node-2")
    api.add_pod("shop", "web-1", "node-1", labels={"app": "web"}, owner_kind="ReplicaSet")
    api.add_pod("shop", "web-2", "node-2", labels={"app": "web"}, owner_kind="ReplicaSet")
    api.add_pod("kube-system", "proxy-1", "node-1", owner_kind="DaemonSet")
    api.add_pod("kube-system", "etcd-node-1", "node-1", mirror=True)
    api.add_pdb("shop", "web", {"app": "web"}, max_unavailable=0)
    h = harnesses(api, REBOOT_POLICY)
    h.poll(imds_event())
    wait_until(lambda: any(r.status == 429 for r in api.requests), timeout=10, message="a 429 from the PDB")
    h.poll(imds_event())
    assert h.approver.stage("E1") is Stage.ACTING and h.starts.posts == []
    assert h.scrape("azure_scheduled_events_node_drains_in_progress") == 1
    api.set_pdb_allowed("shop", "web", 1)
    wait_until(lambda: h.approver.stage("E1") is Stage.ACTED, timeout=15, message="the drain to finish")
    h.poll(imds_event())
    h.settle()
    assert h.starts.posts == [["E1"]]
    assert [(ns, pod) for ns, pod, _ in api.evictions] == [("shop", "web-1")]
    assert {p["metadata"]["name"] for p in api.pods()} == {"web-2", "proxy-1", "etcd-node-1"}
    node = api.node("node-1")
    assert node["spec"]["unschedulable"] is True
    assert conditions(node)[CONDITION]["status"] == "True" and "E1" in conditions(node)[CONDITION]["message"]
    (kube_event,) = [e for e in api.events() if e["reason"] == "ScheduledEvent"]  # the drain posts its own too
    assert kube_event["regarding"]["name"] == "node-1" and kube_event["reportingController"] == "forewarn.io/forewarn"
    assert h.actions() == [("cordon", "ok"), ("condition", "ok"), ("event", "ok"), ("drain", "ok")]
    assert h.counter("drain", "ok") == 1 and h.counter("drain", "failed") == 0
    assert h.scrape("azure_scheduled_events_node_drains_in_progress") == 0

    h.poll(imds_event(status="Started"))
    h.poll()  # completed: forewarn takes back what it applied
    h.settle()
    node = api.node("node-1")
    assert not node["spec"].get("unschedulable") and APPLIED not in node["metadata"].get("annotations", {})
    assert CONDITION not in conditions(node) and conditions(node)["Ready"]["status"] == "True"
    assert h.actions()[-1] == ("undo", "ok") and h.counter("undo", "ok") == 1
    for record in h.records:
        jsonschema.validate(record, RECORD_SCHEMA)


def test_a_node_cordoned_and_tainted_by_someone_else_stays_so_after_the_event(
        api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    remediator = {"key": "remediator.kubernetes.azure.com/unschedulable", "value": "true", "effect": "NoSchedule"}
    api.add_node("node-1", unschedulable=True, taints=[remediator],
                 labels={"kubernetes.io/hostname": "node-1", "forewarn.io/scheduled-event": "mine"})
    h = harnesses(api, """
rules:
  - name: reboot
    match: {event_type: [Reboot]}
    node: [cordon, taint, {taint: {key: remediator.kubernetes.azure.com/unschedulable}}, label]
    action: hold
""")
    h.poll(imds_event())
    wait_until(lambda: h.approver.stage("E1") is Stage.ACTED, timeout=10)
    node = api.node("node-1")
    assert {(t["key"], t["effect"]) for t in node["spec"]["taints"]} == {
        ("remediator.kubernetes.azure.com/unschedulable", "NoSchedule"), ("forewarn.io/scheduled-event", "NoSchedule")}
    assert "someone else" in h.detail("cordon") and "someone else" in h.detail("label")
    h.poll()  # cancelled
    h.settle()
    node = api.node("node-1")
    assert node["spec"]["unschedulable"] is True, "an administrator's cordon is never lifted by forewarn"
    assert node["spec"]["taints"] == [remediator]
    assert node["metadata"]["labels"]["forewarn.io/scheduled-event"] == "mine"
    assert APPLIED not in node["metadata"].get("annotations", {})


def test_spot_eviction_with_25_s_notice_clamps_grace_and_drains_before_not_before(
        simulator: Callable[..., SimulatorHandle], tmp_path: Path, harnesses: Callable[..., Harness]) -> None:
    # 25 s of scenario time at 5x speed: 5 s of real notice, so 30 s grace periods must be clamped.
    sim = simulator({"vms": ["vm-1"], "events": [{"at": 0, "type": "Preempt", "notice": 25, "duration": None,
                                                  "run_for": 30, "id": "SPOT"}]}, speed=5)
    api = KubeApi(cluster_role=CLUSTER_ROLE, grace_scale=0.1)
    try:
        api.add_node("node-1")
        for index in range(3):
            api.add_pod("batch", f"job-{index}", "node-1", owner_kind="Job", grace=30)
        h = harnesses(api, """
rules:
  - name: spot
    match: {event_type: [Preempt]}
    node: [cordon, {drain: {margin: 1}}]
    action: hold
""")
        client = ImdsClient(sim.url)
        try:
            document = wait_until(lambda: (d := client.get_scheduled_events()).events and d, timeout=5)
            h.approver.on_changes(document, h.tracker.apply(document), h.vm)
            not_before = document.events[0].not_before
            assert not_before is not None
            wait_until(lambda: h.approver.stage("SPOT") is Stage.ACTED, timeout=10, message="the drain")
            finished = time.time()
        finally:
            client.close()
        assert finished < not_before.timestamp() - 0.5, "the drain ended before NotBefore (minus the margin)"
        graces = [grace for _, _, grace in api.evictions]
        assert len(graces) == 3 and all(grace is not None and 1 <= grace <= 4 for grace in graces), graces
        assert api.pods() == []
        assert h.actions() == [("cordon", "ok"), ("drain", "ok")] and h.starts.posts == []
    finally:
        api.stop()


def test_a_restart_in_the_middle_of_a_drain_resumes_it(api: KubeApi, harnesses: Callable[..., Harness],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    api.add_node("node-1")
    api.add_pod("shop", "web-1", "node-1", labels={"app": "web"}, owner_kind="ReplicaSet")
    api.add_pod("shop", "api-1", "node-1", owner_kind="ReplicaSet")
    api.add_pdb("shop", "web", {"app": "web"}, max_unavailable=0)
    first = harnesses(api, REBOOT_POLICY)
    first.poll(imds_event())
    wait_until(lambda: any(r.status == 429 for r in api.requests), timeout=10)
    deadline = agent_ledger(api.node("node-1"))["E1"]["drain"]["deadline"]
    first.close()  # stopped mid-drain: not a failure, and the lease stays this node's
    first.settle()
    assert ("drain", "failed") not in first.actions()
    second = harnesses(api, REBOOT_POLICY)
    with caplog.at_level(logging.WARNING, logger="forewarn.node.drain"):
        second.poll(imds_event())
        wait_until(lambda: "resuming the drain" in caplog.text, timeout=10)
    api.set_pdb_allowed("shop", "web", 1)
    wait_until(lambda: second.approver.stage("E1") is Stage.ACTED, timeout=15)
    assert sorted(pod for _, pod, _ in api.evictions) == ["api-1", "web-1"]  # each evicted once
    ledger = agent_ledger(api.node("node-1"))["E1"]
    assert ledger["drain"]["done"] is True and ledger["drain"]["deadline"] == deadline
    (lease,) = api.leases()
    assert not lease["spec"].get("holderIdentity")  # released once done


def test_dry_run_decides_and_records_but_writes_nothing(api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    api.add_node("node-1")
    api.add_pod("shop", "web-1", "node-1", owner_kind="ReplicaSet")
    h = harnesses(api, REBOOT_POLICY.replace("[cordon,", "[cordon, taint, label,"), dry_run=True)
    h.poll(imds_event())
    wait_until(lambda: h.approver.stage("E1") is Stage.ACTED, timeout=10)
    h.poll(imds_event())
    h.poll()
    h.settle()
    assert writes(api) == []
    assert [a for a in h.actions()] == [(kind, "dry_run") for kind in
                                        ("cordon", "taint", "label", "condition", "event", "drain")]
    assert "would drain node node-1: evict 1 pod(s) (shop/web-1)" in h.detail("drain")
    assert h.counter("cordon", "dry_run") == 1 and h.counter("cordon", "ok") == 0
    assert h.starts.posts == [] and api.pods() and not api.node("node-1")["spec"].get("unschedulable")


def test_a_403_gives_a_clear_error_a_metric_and_holds_without_crashing(
        tmp_path: Path, harnesses: Callable[..., Harness]) -> None:
    role = yaml.safe_load(CLUSTER_ROLE.read_text())
    role["rules"] = [rule for rule in role["rules"] if rule["resources"] != ["pods/eviction"]]
    (tmp_path / "role.yaml").write_text(yaml.safe_dump(role))
    api = KubeApi(cluster_role=tmp_path / "role.yaml")
    try:
        api.add_node("node-1")
        api.add_pod("shop", "web-1", "node-1", owner_kind="ReplicaSet")
        h = harnesses(api, REBOOT_POLICY)
        h.poll(imds_event())
        wait_until(lambda: h.approver.stage("E1") is Stage.ACT_FAILED, timeout=10)
        h.poll(imds_event())
        h.settle()
        detail = h.detail("drain")
        assert "evict pod shop/web-1: forbidden (403)" in detail and "ClusterRole" in detail
        assert h.counter("drain", "failed") == 1 and h.starts.posts == []  # on_failure: hold
        assert api.pods() and api.node("node-1")["spec"]["unschedulable"] is True
        h.poll()  # the event ends: the undo still works
        h.settle()
        assert not api.node("node-1")["spec"].get("unschedulable")
    finally:
        api.stop()


def test_the_cluster_wide_cap_holds_with_three_instances_on_three_nodes(
        harnesses: Callable[..., Harness]) -> None:
    api = KubeApi(cluster_role=CLUSTER_ROLE, grace_scale=0.2)
    try:
        policy = REBOOT_POLICY.replace("margin: 1}", "margin: 1, max_nodes: 1}")
        instances = []
        for index in (1, 2, 3):
            api.add_node(f"node-{index}")
            api.add_pod("shop", f"web-{index}", f"node-{index}", owner_kind="ReplicaSet", grace=2)
            instances.append(harnesses(api, policy, node=f"node-{index}", vm=f"vm-{index}"))
        draining: list[int] = []
        stop = threading.Event()

        def watch() -> None:  # which nodes have a pod terminating at each moment
            while not stop.is_set():
                going = {p["spec"]["nodeName"] for p in api.pods() if p["metadata"].get("deletionTimestamp")}
                draining.append(len(going))
                stop.wait(0.02)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            one_event = imds_event(resources=("vm-1", "vm-2", "vm-3"))
            for h in instances:
                h.poll(one_event)
            wait_until(lambda: all(h.approver.stage("E1") is Stage.ACTED for h in instances), timeout=30)
        finally:
            stop.set()
            watcher.join()
        assert max(draining) == 1 and len(api.evictions) == 3
        assert all(h.actions()[-1] == ("drain", "ok") for h in instances)
        (lease,) = api.leases()
        assert lease["metadata"]["name"] == "forewarn-drain-0" and lease["metadata"]["namespace"] == "forewarn"
    finally:
        api.stop()


def test_forewarn_run_without_node_actions_never_imports_the_kubernetes_client(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("rules: [{name: a, action: hold}]\n")
    probe = f"""
import sys
from forewarn.config import resolve
from forewarn.cli import build_parser
from forewarn.agent import build_approver
settings = resolve(build_parser().parse_args(["run", "--policy", {str(policy)!r}]), environ={{}})
build_approver(settings, None, None, __import__("forewarn.metrics", fromlist=["Metrics"]).Metrics())
print(",".join(sorted(m for m in sys.modules if m.split(".")[0] in ("lightkube", "httpx2", "kubernetes")
                      or m.startswith("forewarn.node"))))
"""
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


def test_node_actions_without_node_name_stop_start_up_naming_the_option(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(REBOOT_POLICY)
    result = subprocess.run([sys.executable, "-m", "forewarn", "run", "--policy", str(policy), "--imds-endpoint",
                             "http://127.0.0.1:9", "--listen-address", "127.0.0.1:0", "--state-dir",
                             str(tmp_path / "state")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--node-name (FOREWARN_NODE_NAME" in result.stderr


def test_policy_check_shows_the_node_actions(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(REBOOT_POLICY)
    result = subprocess.run([sys.executable, "-m", "forewarn", "policy", "check", str(policy)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert ("node actions of rule reboot (on_failure: hold): cordon; condition ForewarnScheduledEvent; event "
            "Warning ScheduledEvent; drain (within 60 s, done 1 s before NotBefore") in result.stdout
