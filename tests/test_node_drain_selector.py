"""A drain limited to the pods matching a label selector, and the AKS overlay's Freeze rule built on it, with the
REAL client (lightkube) against the strict API stand-in (tests/peers/kube_api.py).

A Freeze pauses the VM for seconds: only pods labelled forewarn.io/cannot-pause=true are moved, the rest sit it
out. One test runs `forewarn run` against the IMDS simulator end to end; the others drive the approver in-process
(the Harness of test_node_actions.py) and wait with wait_until.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from forewarn.approval.approver import Stage
from forewarn.approval.policy import PolicyError, load_policy, parse_label_selector, parse_policy
from forewarn.node.actions import APPLIED
from test_node_actions import CLUSTER_ROLE, CONDITION, Harness, conditions, imds_event, writes

from conftest import CollectorProcess, SimulatorHandle, wait_until
from peers.kube_api import KubeApi

ROOT = Path(__file__).parent.parent
AKS_POLICY = ROOT / "deploy" / "kubernetes" / "overlays" / "aks" / "policy.yaml"
CANNOT_PAUSE = {"forewarn.io/cannot-pause": "true"}
FREEZE_TAINT = {"key": "forewarn.io/scheduled-event", "value": "Freeze", "effect": "NoSchedule"}

FREEZE_POLICY = """
rules:
  - name: freeze
    match: {event_type: [Freeze]}
    node: [taint, condition, event, {drain: {selector: forewarn.io/cannot-pause=true, timeout: 60, margin: 1}}]
    action: approve
    on_failure: hold
"""


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


def three_pods(api: KubeApi) -> None:
    """node-1 with a pod that cannot pause, one that can, and a DaemonSet pod that says it cannot."""
    api.add_node("node-1")
    api.add_pod("shop", "leader-1", "node-1", labels={"app": "leader", **CANNOT_PAUSE}, owner_kind="ReplicaSet")
    api.add_pod("shop", "web-1", "node-1", labels={"app": "web"}, owner_kind="ReplicaSet")
    api.add_pod("kube-system", "agent-1", "node-1", labels={"app": "agent", **CANNOT_PAUSE}, owner_kind="DaemonSet")


def pod_names(api: KubeApi) -> set[str]:
    return {pod["metadata"]["name"] for pod in api.pods()}


def pod_lists(api: KubeApi) -> list[dict[str, str]]:
    return [r.query for r in api.requests if r.method == "GET" and r.path == "/api/v1/pods"]


# --- end to end: forewarn run, the IMDS simulator and the stand-in --------------------------------------

@pytest.mark.slow
def test_a_freeze_evicts_only_the_pod_that_cannot_pause_then_approves_and_lifts_the_taint(
        tmp_path: Path, api: KubeApi, simulator: Callable[..., SimulatorHandle],
        collector: Callable[..., CollectorProcess]) -> None:
    three_pods(api)
    sim = simulator({"vm_name": "vm-1", "vms": ["vm-1"], "events": [
        {"id": "FREEZE", "at": 0, "type": "Freeze", "notice": 900, "duration": 30, "run_for": 3}]})
    policy = tmp_path / "policy.yaml"
    policy.write_text(FREEZE_POLICY)
    proc = collector(sim.url, "--policy", str(policy), "--node-name", "node-1", "--kubeconfig",
                     str(api.kubeconfig(tmp_path / "kubeconfig", namespace="forewarn")))
    wait_until(lambda: sim.sim.approval_posts, timeout=20, message="the approval after the drain")
    assert [post["event_ids"] for post in sim.sim.approval_posts] == [["FREEZE"]]
    assert [(ns, pod) for ns, pod, _ in api.evictions] == [("shop", "leader-1")]
    assert pod_names(api) == {"web-1", "agent-1"}, "the pod that can pause and the DaemonSet pod stay"
    node = api.node("node-1")
    assert node["spec"]["taints"] == [FREEZE_TAINT] and not node["spec"].get("unschedulable")
    assert conditions(node)[CONDITION]["status"] == "True"
    # The API did the filtering: the pod list asked for the node's pods matching the selector.
    assert {"labelSelector": "forewarn.io/cannot-pause=true", "fieldSelector": "spec.nodeName=node-1"}.items() \
        <= pod_lists(api)[0].items()

    wait_until(lambda: not api.node("node-1")["spec"].get("taints"), timeout=20,
               message="the taint lifted once the Freeze completed")
    node = api.node("node-1")
    assert CONDITION not in conditions(node), "the condition is removed once the event ended"
    assert APPLIED not in node["metadata"].get("annotations", {})
    assert pod_names(api) == {"web-1", "agent-1"}
    wait_until(lambda: any(r["data"]["change"] == "removed" for r in proc.records()), timeout=10)
    # the undo's record is written by the approver's thread, after the taint is gone: wait for it too
    wait_until(lambda: any(r["data"].get("action") == "undo" for r in proc.records()), timeout=10,
               message="the undo's record")
    changes = [(r["data"]["change"], r["data"].get("action"), r["data"].get("result")) for r in proc.records()]
    assert changes.index(("node_action", "drain", "ok")) < changes.index(("approved", None, None)), changes
    (drained,) = [r["data"]["detail"] for r in proc.records() if r["data"].get("action") == "drain"]
    assert "evicted 1 pod(s) matching forewarn.io/cannot-pause=true" in drained, drained
    assert "matching forewarn.io/cannot-pause=true" in proc.log()
    assert [action for _, action, _ in changes if action] == ["taint", "condition", "event", "drain", "undo"]


# --- the AKS overlay's policy, the shipped file itself ---------------------------------------------------

def test_the_aks_overlays_freeze_rule_taints_and_drains_only_the_pod_that_cannot_pause(
        api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    policy = load_policy(AKS_POLICY)
    (freeze,) = [rule for rule in policy.rules if rule.name == "long-freeze"]
    assert [action.kind for action in freeze.node] == ["taint", "condition", "event", "drain"]
    assert freeze.node[-1].selector_text == "forewarn.io/cannot-pause=true"
    assert (freeze.action, freeze.on_failure) == ("approve", "hold")
    three_pods(api)
    h = harnesses(api, AKS_POLICY.read_text())
    event = imds_event(event_type="Freeze")  # DurationInSeconds -1: not a short freeze
    h.poll(event)
    wait_until(lambda: h.approver.stage("E1") is Stage.ACTED, timeout=15, message="the Freeze rule's actions")
    h.poll(event)
    h.settle()
    assert h.starts.posts == [["E1"]]
    assert [(ns, pod) for ns, pod, _ in api.evictions] == [("shop", "leader-1")]
    assert pod_names(api) == {"web-1", "agent-1"}
    node = api.node("node-1")
    assert node["spec"]["taints"] == [FREEZE_TAINT] and not node["spec"].get("unschedulable")
    assert h.actions() == [("taint", "ok"), ("condition", "ok"), ("event", "ok"), ("drain", "ok")]
    assert "matching forewarn.io/cannot-pause=true" in h.detail("drain")
    h.poll(imds_event(event_type="Freeze", status="Started"))
    h.poll()
    h.settle()
    assert not api.node("node-1")["spec"].get("taints")


def test_a_dry_run_selective_drain_names_only_the_matching_pods_and_writes_nothing(
        api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    three_pods(api)
    h = harnesses(api, FREEZE_POLICY, dry_run=True)
    h.poll(imds_event(event_type="Freeze"))
    wait_until(lambda: h.approver.stage("E1") is Stage.ACTED, timeout=10)
    assert writes(api) == [] and pod_names(api) == {"leader-1", "web-1", "agent-1"}
    assert "would drain node node-1: evict 1 pod(s) matching forewarn.io/cannot-pause=true (shop/leader-1)" \
        in h.detail("drain")


@pytest.mark.parametrize(("selector", "evicted"), [
    ("tier==cache", {"cache-1"}),
    ("tier in (web, cache)", {"web-1", "cache-1"}),
    ("tier notin (web,cache)", {"db-1", "bare-1"}),
    ("tier!=web,tier!=cache", {"db-1", "bare-1"}),  # two terms on one key
    ("tier,!keep", {"web-1", "db-1"}),
])
def test_each_selector_form_evicts_exactly_the_pods_it_matches(
        selector: str, evicted: set[str], api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    api.add_node("node-1")
    for name, labels in (("web-1", {"tier": "web"}), ("cache-1", {"tier": "cache", "keep": "yes"}),
                         ("db-1", {"tier": "db"}), ("bare-1", {})):
        api.add_pod("shop", name, "node-1", labels=labels, owner_kind="ReplicaSet")
    h = harnesses(api, FREEZE_POLICY.replace("forewarn.io/cannot-pause=true", json.dumps(selector)))
    h.poll(imds_event(event_type="Freeze"))
    wait_until(lambda: h.approver.stage("E1") is Stage.ACTED, timeout=10)
    assert {pod for _, pod, _ in api.evictions} == evicted
    assert pod_names(api) == {"web-1", "cache-1", "db-1", "bare-1"} - evicted


# --- policy check and explain ------------------------------------------------------------------------

def policy_command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "forewarn", "policy", *args], capture_output=True, text=True,
                          timeout=60)


def drain_rule(selector: str) -> str:
    return ("rules:\n  - name: freeze-movers\n    match: {event_type: [Freeze]}\n"
            f"    node: [{{drain: {{selector: {json.dumps(selector)}}}}}]\n    action: approve\n")


@pytest.mark.parametrize(("selector", "problem"), [
    ("a in b", "expected '(' after 'a in'"),
    ("=x", "expected a label key, found '='"),
    ("Bad Key=1", "expected an operator or ',' after 'Bad', found 'Key'"),
    ("-a=1", "'-a' is not a valid label key"),
    ("UPPER.example/a=1", "'UPPER.example/a' is not a valid label key"),
    ("app=" + "x" * 64, "is not a valid label value"),
    ("app=-x", "'-x' is not a valid label value"),
    ("app in ()", "the set of 'app in' is empty"),
    ("app notin (a,", "expected a value or ')' in the set of 'app notin' at the end"),
    ("a,,b", "expected a label key, found ','"),
    ("replicas>1", "the operator '>' is not supported"),
    ("", "the selector is empty; leave 'selector' out to drain every pod"),
])
def test_policy_check_refuses_a_malformed_selector_naming_the_rule(selector: str, problem: str,
                                                                   tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(drain_rule(selector))
    result = policy_command("check", str(policy))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"forewarn policy: {policy}:4: rule freeze-movers: rules[0].node[0].drain.selector: "
                           f"{selector!r} is not a valid label selector: "), line
    assert problem in line and "valid: k=v, k==v, k!=v, k, !k, k in (a,b), k notin (a,b)" in line, line


GOOD = {
    "forewarn.io/cannot-pause=true": "forewarn.io/cannot-pause=true",
    "app==web": "app=web",
    "app != web": "app!=web",
    "example.com/critical": "example.com/critical",
    "!example.com/spare": "!example.com/spare",
    "tier in (web, cache)": "tier in (web,cache)",
    "tier notin (db)": "tier notin (db)",
    "a.b/c_d-e=V.1_x-2, zone=": "a.b/c_d-e=V.1_x-2,zone=",
    "a=in": "a=in",
}


def test_policy_check_accepts_every_selector_form_and_shows_it(tmp_path: Path) -> None:
    rules = "".join(f"  - name: r{index}\n    match: {{event_type: [Freeze]}}\n"
                    f"    node: [{{drain: {{selector: {json.dumps(selector)}}}}}]\n    action: approve\n"
                    for index, selector in enumerate(GOOD))
    policy = tmp_path / "policy.yaml"
    policy.write_text("rules:\n" + rules)
    result = policy_command("check", str(policy))
    assert result.returncode == 0, result.stderr
    for index, shown in enumerate(GOOD.values()):
        assert f"node actions of rule r{index} (on_failure: hold): drain pods matching {shown} (within 600 s" \
            in result.stdout, result.stdout


def test_the_parsed_selector_keeps_each_term() -> None:
    assert [(t.key, t.op, t.values) for t in parse_label_selector("a in (x, y),!b,c!=,d")] == [
        ("a", "in", ("x", "y")), ("b", "!", ()), ("c", "!=", ("",)), ("d", "exists", ())]
    with pytest.raises(PolicyError, match=r"p.yaml:4: rule freeze-movers: .*'k in' is empty"):
        parse_policy(drain_rule("k in ()"), "p.yaml")
    with pytest.raises(PolicyError, match=r"p.yaml:4: rules\[0\].node\[0\].drain.selector: 5 is not of type"):
        parse_policy(drain_rule("x").replace('"x"', "5"), "p.yaml")


def test_policy_explain_shows_the_selector(tmp_path: Path) -> None:
    document = tmp_path / "doc.json"
    document.write_text(json.dumps({"DocumentIncarnation": 1, "Events": [imds_event("F1", event_type="Freeze")]}))
    result = policy_command("explain", str(AKS_POLICY), "--document", str(document), "--vm-name", "vm-1")
    assert result.returncode == 0, result.stderr
    assert "  matched  long-freeze" in result.stdout
    assert ("  node     taint forewarn.io/scheduled-event=<event type>:NoSchedule; condition ForewarnScheduledEvent; "
            "event Warning ScheduledEvent; drain pods matching forewarn.io/cannot-pause=true (within 300 s, done 30 s "
            "before NotBefore; at most 5 node(s) draining at once; by pod priority, lowest first, each tier waited "
            "for; system-cluster-critical, system-node-critical last; at the deadline: report the pods left and "
            "fail) -> this VM's node (--node-name)") in result.stdout


def test_the_freeze_rules_in_the_docs_are_the_shipped_ones() -> None:
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    block = docs.split("Its Freeze rules:\n\n```yaml\n", 1)[1].split("```", 1)[0]
    shipped = {rule["name"]: rule for rule in yaml.safe_load(AKS_POLICY.read_text())["rules"]}
    documented = yaml.safe_load(block)
    assert documented == [shipped["short-freeze"], shipped["long-freeze"]]
