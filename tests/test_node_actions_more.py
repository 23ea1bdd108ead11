"""More Kubernetes node actions against the strict API stand-in (tests/peers/kube_api.py): the options beyond
their defaults, the drain deadline, the cap's Lease taken over after its holder died, undo retried after a
transient API error, `policy explain`, where the client configuration comes from, and a SIGHUP reload that
adds node actions to a run without --node-name.

The approver runs in-process (the Harness of test_node_actions.py), so tests wait with wait_until.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from forewarn.agent import build_actor
from forewarn.approval.approver import Stage
from forewarn.cli import build_parser
from forewarn.config import Settings, resolve
from forewarn.metrics import Metrics
from forewarn.node import KubeNodeActor
from forewarn.node.drain import LEASE_SECONDS
from test_node_actions import CLUSTER_ROLE, Harness, imds_event

from conftest import CollectorProcess, SimulatorHandle, agent_ledger, sample, wait_for_polls, wait_until
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


REBOOT_DRAIN = """
rules:
  - name: reboot
    match: {event_type: [Reboot]}
    node: [cordon, DRAIN]
    action: hold
"""


def ledger(api: KubeApi, node: str = "node-1") -> dict[str, dict[str, object]]:
    return agent_ledger(api.node(node))


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


# --- 2. the cap's Lease: a holder that died is taken over after the lease expires ----------------------

def test_a_drain_slot_held_by_a_dead_instance_is_taken_over_once_its_lease_expires(
        api: KubeApi, harnesses: Callable[..., Harness], caplog: pytest.LogCaptureFixture) -> None:
    policy = REBOOT_DRAIN.replace("DRAIN", "{drain: {timeout: 300, margin: 1, max_nodes: 1}}")
    api.add_node("node-1")
    api.add_node("node-2")
    api.add_pod("shop", "web-1", "node-1", labels={"app": "web"}, owner_kind="ReplicaSet")
    api.add_pod("shop", "web-2", "node-2", owner_kind="ReplicaSet")
    api.add_pdb("shop", "web", {"app": "web"}, max_unavailable=0)  # node-1's drain never ends
    one_event = imds_event(resources=("vm-1", "vm-2"))
    first = harnesses(api, policy)
    first.poll(one_event)
    wait_until(lambda: any(r.status == 429 for r in api.requests), timeout=10, message="node-1 draining")
    first.close()  # dies holding the slot: nobody releases or renews its Lease
    first.settle()
    (lease,) = api.leases()
    assert lease["spec"]["holderIdentity"] == "node-1"

    later = [0.0]  # the second instance's clock runs ahead by this much
    second = harnesses(api, policy, node="node-2", vm="vm-2")
    second.actor.clock = lambda: time.time() + later[0]
    with caplog.at_level(logging.WARNING, logger="forewarn.node.drain"):
        second.poll(one_event)
        wait_until(lambda: "waiting for a drain slot" in caplog.text, timeout=10, message="node-2 waiting")
    assert "draining: node-1" in caplog.text
    assert second.approver.stage("E1") is Stage.ACTING and not any(pod == "web-2" for _, pod, _ in api.evictions)
    later[0] = LEASE_SECONDS + 1.0  # node-1's Lease has not been renewed for longer than its duration
    wait_until(lambda: second.approver.stage("E1") is Stage.ACTED, timeout=10, message="the takeover and drain")
    takeovers = [r.json() for r in api.requests if r.method == "PUT" and r.path.endswith("/forewarn-drain-0")]
    assert takeovers[0]["spec"]["holderIdentity"] == "node-2" and takeovers[0]["metadata"]["resourceVersion"]
    assert [pod for _, pod, _ in api.evictions] == ["web-2"]
    assert second.counter("drain", "ok") == 1
    (lease,) = api.leases()
    assert not lease["spec"].get("holderIdentity"), "released once node-2 drained"


# --- 3. policy explain -------------------------------------------------------------------------------

def test_policy_explain_shows_the_node_actions_for_this_vm_and_not_for_others(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(REBOOT_DRAIN.replace(
        "DRAIN", "{taint: {key: example.com/m, value: x, effect: NoExecute}}, label, {event: {reason: Going}}, "
        "{drain: {timeout: 120, margin: 5, grace: 20, delete_local_data: true, max_nodes: 2}}")
        .replace("action: hold", "action: approve\n    on_failure: approve"))
    document = tmp_path / "doc.json"
    document.write_text(json.dumps({"DocumentIncarnation": 3, "Events": [
        imds_event("MINE"), imds_event("OTHER", resources=("vm-9",))]}))
    result = subprocess.run([sys.executable, "-m", "forewarn", "policy", "explain", str(policy), "--document",
                             str(document), "--vm-name", "vm-1"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    actions = ("cordon; taint example.com/m=x:NoExecute; label forewarn.io/scheduled-event=<event type>; "
               "event Warning Going; drain (within 120 s, done 5 s before NotBefore, grace at most 20 s, evicting "
               "pods with local storage; at most 2 node(s) draining at once; by pod priority, lowest first, each tier "
               "waited for; system-cluster-critical, system-node-critical last; at the deadline: report the pods left "
               "and fail)")
    mine, other = out.split("\nMINE")[1].split("\nOTHER")
    assert f"  node     {actions} -> this VM's node (--node-name), before the decision (on_failure: approve)" in mine
    assert "  decision APPROVE: rule reboot approves" in mine
    assert f"  node     {actions} -> none: the event does not affect this VM" in other


# --- 4. where the Kubernetes configuration comes from --------------------------------------------------

def node_settings(tmp_path: Path, *flags: str) -> Settings:
    policy = tmp_path / "policy.yaml"
    policy.write_text(REBOOT_DRAIN.replace("DRAIN", "label"))
    return resolve(build_parser().parse_args(["run", "--policy", str(policy), "--node-name", "node-1", *flags]),
                   environ={})


def test_kubeconfig_is_the_file_the_node_actions_use(api: KubeApi, tmp_path: Path) -> None:
    api.add_node("node-1")
    kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")
    actor = build_actor(node_settings(tmp_path, "--kubeconfig", str(kubeconfig)), True, Metrics())
    assert isinstance(actor, KubeNodeActor)
    try:
        assert actor.get_node()["metadata"]["name"] == "node-1"
    finally:
        actor.close()
    (request,) = api.requests
    assert (request.method, request.path) == ("GET", "/api/v1/nodes/node-1")
    assert request.headers["authorization"].startswith("Bearer ")


def test_without_kubeconfig_the_kubeconfig_env_var_is_used(api: KubeApi, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # The in-cluster service account is read from a fixed path (/var/run/secrets/...), absent here, so the
    # fallback after it is what a test can reach: KUBECONFIG.
    api.add_node("node-1")
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path / "from-env")))
    actor = build_actor(node_settings(tmp_path), True, Metrics())
    assert isinstance(actor, KubeNodeActor)
    try:
        assert actor.get_node()["metadata"]["name"] == "node-1"
    finally:
        actor.close()


def test_without_any_kubernetes_configuration_run_exits_2_naming_kubeconfig(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(REBOOT_DRAIN.replace("DRAIN", "cordon"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "FOREWARN_"))}
    env["HOME"] = str(tmp_path)  # no ~/.kube/config
    env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"] = "127.0.0.1", "9"  # but no token file
    result = subprocess.run([sys.executable, "-m", "forewarn", "run", "--policy", str(policy), "--node-name", "node-1",
                             "--imds-endpoint", "http://127.0.0.1:9", "--listen-address", "127.0.0.1:0",
                             "--state-dir", str(tmp_path / "state")], capture_output=True, text=True, timeout=60,
                            env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("forewarn run: error:")]
    assert "--kubeconfig" in line and "in-cluster" in line and "KUBECONFIG" in line, line


def test_a_kubeconfig_that_does_not_exist_exits_2_naming_it(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(REBOOT_DRAIN.replace("DRAIN", "cordon"))
    missing = tmp_path / "nowhere.yaml"
    result = subprocess.run([sys.executable, "-m", "forewarn", "run", "--policy", str(policy), "--node-name", "node-1",
                             "--kubeconfig", str(missing), "--imds-endpoint", "http://127.0.0.1:9",
                             "--listen-address", "127.0.0.1:0", "--state-dir", str(tmp_path / "state")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"--kubeconfig {missing}" in result.stderr


# --- 5. a failed undo is tried again -------------------------------------------------------------------

def test_an_undo_that_fails_once_is_retried_so_the_node_is_not_left_cordoned(
        api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    api.add_node("node-1")
    h = harnesses(api, REBOOT_DRAIN.replace(", DRAIN", ", taint"))
    h.poll(imds_event())
    wait_until(lambda: h.approver.stage("E1") is Stage.ACTED, timeout=10)
    assert api.node("node-1")["spec"]["unschedulable"] is True
    api.fail_next("PATCH", r"^/api/v1/nodes/node-1$", 503, "etcdserver: request timed out")
    h.poll()  # the event ends; the uncordon PATCH fails once
    wait_until(lambda: ("undo", "failed") in h.actions(), timeout=10, message="the failed undo")
    assert "503" in h.detail("undo") and api.node("node-1")["spec"]["unschedulable"] is True

    def undone() -> bool:
        h.poll()  # later polls (no change in the document) try again
        return not api.node("node-1")["spec"].get("unschedulable")

    wait_until(undone, timeout=10, message="the undo tried again")
    h.settle()
    node = api.node("node-1")
    assert not node["spec"].get("taints") and ledger(api) == {}
    assert h.actions()[-2:] == [("undo", "failed"), ("undo", "ok")]
    assert h.counter("undo", "failed") == 1 and h.counter("undo", "ok") == 1
    for _ in range(3):  # done: never again
        h.poll()
    h.settle()
    assert h.counter("undo", "ok") == 1 and h.actions().count(("undo", "ok")) == 1


# --- 6. SIGHUP adding node actions to a run without --node-name ------------------------------------------

HOLD_ALL = "version: 1\nrules:\n  - name: hold-all\n    action: hold\n"
USER_REBOOT_NODE = ("version: 1\nrules:\n  - name: user-reboot\n    match:\n      source: [User]\n"
                    "    node: [cordon]\n    action: approve\n    on_failure: approve\n")


@pytest.mark.slow
def test_sighup_adding_node_actions_without_node_name_is_refused_and_the_old_policy_kept(
        tmp_path: Path, simulator: Callable[..., SimulatorHandle],
        collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator("user-reboot")
    policy = tmp_path / "policy.yaml"
    policy.write_text(HOLD_ALL)
    proc = collector(sim.url, "--policy", str(policy))
    wait_until(lambda: "rule hold-all holds it" in proc.log(), message="the hold under the first policy")
    assert sample(proc.metrics(), RELOAD_OK) == 1
    policy.write_text(USER_REBOOT_NODE)
    assert proc.proc is not None
    proc.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: sample(proc.metrics(), RELOAD_OK) == 0, message="the refused reload in the metrics")
    (line,) = [line for line in proc.log().splitlines() if "received SIGHUP" in line]
    assert "ERROR" in line and "--node-name" in line and "keeping the previous policy" in line, line
    wait_for_polls(proc, 3)
    assert proc.alive() and sim.sim.approval_posts == []
    assert "rule user-reboot" not in proc.log(), "the refused policy never decided anything"
    assert "Traceback" not in proc.log()


@pytest.mark.slow
def test_sighup_adding_node_actions_with_node_name_builds_the_client_and_acts(
        tmp_path: Path, api: KubeApi, simulator: Callable[..., SimulatorHandle],
        collector: Callable[..., CollectorProcess]) -> None:
    api.add_node("node-1")
    sim = simulator("user-reboot")
    policy = tmp_path / "policy.yaml"
    policy.write_text(HOLD_ALL)
    proc = collector(sim.url, "--policy", str(policy), "--node-name", "node-1", "--kubeconfig",
                     str(api.kubeconfig(tmp_path / "kubeconfig")))
    wait_until(lambda: "rule hold-all holds it" in proc.log(), message="the hold under the first policy")
    assert api.requests == [], "no Kubernetes client without node actions"
    policy.write_text(USER_REBOOT_NODE)
    assert proc.proc is not None
    proc.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: sim.sim.approval_posts, timeout=10, message="the approval after the node action")
    assert api.node("node-1")["spec"]["unschedulable"] is True
    assert sample(proc.metrics(), RELOAD_OK) == 1
    assert sample(proc.metrics(), "azure_scheduled_events_node_actions_total", action="cordon", result="ok") == 1
