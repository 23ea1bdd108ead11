"""RSS of `forewarn run` with Kubernetes node actions and one sink, beside the same run without them.

`forewarn run` as deployed (a subprocess, the file sink, 1 poll/s) against the IMDS simulator and the strict
Kubernetes API stand-in (tests/peers/kube_api.py, RBAC from deploy/kubernetes/components/node-actions):
a Reboot for this VM triggers the policy's cordon, condition, event and drain (three pods evicted in three
priority tiers, then the node tainted NoExecute so a DaemonSet pod stops; at_deadline: delete), then the
approval; the event runs and completes, and forewarn undoes what it applied. After that, 30 s of
steady polling, then VmRSS and VmHWM (the peak since start). Two comparison runs: the same scenario,
policy rule and sink but no node actions (no --node-name, no kubeconfig: the Kubernetes client is never
imported), and the same without a policy at all (idle, as bench/cost.py's file-sink figure).

    python bench/node_actions.py [--steady 30] [--quick]

Results are printed and written to bench/results/node_actions.json. Goal (issue 15): RSS with node actions
and one sink at most 45 MB; without them, unchanged.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests
import yaml

from forewarn.simulator import Simulator, SimulatorServer, load_scenario

from common import Collector, header, peak_rss_mib, rss_mib, write_results
from peers.kube_api import KubeApi

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_ROLE = ROOT / "deploy" / "kubernetes" / "components" / "node-actions" / "clusterrole.yaml"
NODE, VM = "aks-nodepool1-bench-vmss000000", "aks-nodepool1-bench_0"
CONDITION = "ForewarnScheduledEvent"   # forewarn's own node condition type
MB = 1_000_000 / 2**20  # MiB in a MB: the goal is in MB, /proc reports KiB

WITH_ACTIONS = """
version: 1
rules:
  - name: reboot
    match: {event_type: [Reboot]}
    node: [cordon, condition, event, {drain: {timeout: 60, margin: 5, stop_daemonsets: true, at_deadline: delete}}]
    action: approve
    on_failure: hold
  - name: everything-else
    action: hold
"""
WITHOUT_ACTIONS = """
version: 1
rules:
  - name: reboot
    match: {event_type: [Reboot]}
    action: approve
  - name: everything-else
    action: hold
"""


def wait_for(what: str, check: Callable[[], bool], timeout: float) -> float:
    """Seconds until `check` holds; RuntimeError naming `what` after `timeout`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if check():
            return time.monotonic() - started
        time.sleep(0.1)
    raise RuntimeError(f"{what}: not within {timeout:g} s")


def metric(url: str, name: str, **labels: str) -> float:
    """The value of one sample of /metrics (0 when absent)."""
    wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    for line in requests.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.split()[-1])
    return 0.0


def run(directory: Path, node_actions: bool, steady: float, policy_on: bool = True) -> dict[str, Any]:
    scenario = directory / "scenario.yaml"
    # notice 900 s: the approval, not NotBefore, starts the event; it then runs 10 s and completes.
    scenario.write_text(yaml.safe_dump({"vm_name": VM, "vms": [VM], "events": [
        {"at": 3, "id": "BENCH-REBOOT", "type": "Reboot", "notice": 900, "run_for": 10}]}))
    policy = directory / "policy.yaml"
    policy.write_text(WITH_ACTIONS if node_actions else WITHOUT_ACTIONS)
    records = directory / "records.jsonl"
    # HTTPS with the cluster CA, as in a cluster (the service account's ca.crt): the TLS context then holds
    # that one CA, not the system store
    api = KubeApi(cluster_role=CLUSTER_ROLE, grace_scale=0.02, tls=True)
    server = SimulatorServer(Simulator(load_scenario(str(scenario)))).serve_in_background()
    extra = ["--policy", str(policy)] if policy_on else []
    if node_actions:
        api.add_node(NODE)
        # three priority tiers (the drain evicts tier by tier), a DaemonSet pod that the NoExecute taint stops
        # and forewarn's own, which tolerates it and stays
        for index, priority in enumerate((-10, 0, 1000)):
            api.add_pod("shop", f"web-{index}", NODE, labels={"app": "web"}, owner_kind="ReplicaSet", grace=30,
                        priority=priority)
        api.add_pod("kube-system", "kube-proxy-bench", NODE, owner_kind="DaemonSet")
        api.add_pod("forewarn", "forewarn-bench", NODE, owner_kind="DaemonSet",
                    tolerations=[{"key": "forewarn.io/drained", "operator": "Exists", "effect": "NoExecute"}])
        kubeconfig = api.kubeconfig(directory / "kubeconfig", namespace="forewarn")
        extra += ["--node-name", NODE, "--kubeconfig", str(kubeconfig)]
    collector = Collector(server.url, directory / "state", sinks=[f"file:{records}"], extra=extra,
                          log=directory / "forewarn.log")
    try:
        # the event is seen, acted on (with node actions) and approved; then it runs, completes, and forewarn
        # undoes what it applied
        url = collector.url
        if not policy_on:   # idle: no policy, no approval; the event is only observed and recorded
            wait_for("the event's record", lambda: records.exists() and "BENCH-REBOOT" in records.read_text(), 60)
            time.sleep(steady)
            return {"rss_mib": round(rss_mib(collector.pid), 1), "peak_rss_mib": round(peak_rss_mib(collector.pid), 1),
                    "steady_s": steady, "alive": collector.proc.poll() is None}
        approved = wait_for("the approval", lambda: metric(
            url, "azure_scheduled_events_approvals_total", event_type="Reboot", result="approved") >= 1, 90)
        result: dict[str, Any] = {"approved_after_s": round(approved, 2)}
        if node_actions:
            result.update(evictions=len(api.evictions), kubernetes_events=len(api.events()),
                          daemonset_pods_stopped=len(api.taint_evictions),
                          drain_records=sum('"change":"drain"' in line for line in records.open()))
            wait_for("the undo", lambda: metric(url, "azure_scheduled_events_node_actions_total",
                                                action="undo", result="ok") >= 1, 90)
            node = api.node(NODE)
            status = {c["type"]: c["status"] for c in node["status"].get("conditions", [])}
            # forewarn removes its condition on undo: None here (absent), not "False"
            result["after_undo"] = {"unschedulable": bool(node["spec"].get("unschedulable")),
                                    "condition": status.get(CONDITION)}
            result["node_actions_ok"] = {
                action: metric(url, "azure_scheduled_events_node_actions_total", action=action, result="ok")
                for action in ("cordon", "condition", "event", "drain", "undo")}
            result["node_actions_failed"] = sum(
                metric(url, "azure_scheduled_events_node_actions_total", action=action, result="failed")
                for action in ("cordon", "condition", "event", "drain", "undo"))
            result["api_requests"] = len(api.requests)
        wait_for("the event's completion", lambda: metric(
            url, "azure_scheduled_events_ended_total", event_type="Reboot", outcome="completed") >= 1, 90)
        rss_after_event = rss_mib(collector.pid)
        time.sleep(steady)   # steady polling, the measured state
        alive = collector.proc.poll() is None
        result.update(rss_after_event_mib=round(rss_after_event, 1), rss_mib=round(rss_mib(collector.pid), 1),
                      peak_rss_mib=round(peak_rss_mib(collector.pid), 1), steady_s=steady, alive=alive,
                      records=sum(1 for _ in records.open()))
        return result
    finally:
        collector.stop()
        server.stop()
        api.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steady", type=float, default=30.0, help="seconds of steady polling before reading RSS")
    parser.add_argument("--quick", action="store_true", help="10 s of steady polling (figures not for publishing)")
    options = parser.parse_args()
    steady = 10.0 if options.quick else options.steady
    results: dict[str, Any] = {**header(), "quick": options.quick, "goal_mb": 45}
    runs = (("idle_no_policy", False, False), ("without_node_actions", False, True), ("with_node_actions", True, True))
    for name, node_actions, policy_on in runs:
        with tempfile.TemporaryDirectory(prefix="forewarn-bench-") as directory:
            results[name] = run(Path(directory), node_actions, steady, policy_on)
    with_actions, without = results["with_node_actions"], results["without_node_actions"]
    results["difference_mib"] = round(with_actions["rss_mib"] - without["rss_mib"], 1)
    results["with_node_actions_mb"] = round(with_actions["rss_mib"] / MB, 1)
    results["peak_with_node_actions_mb"] = round(with_actions["peak_rss_mib"] / MB, 1)
    results["goal_met"] = results["with_node_actions_mb"] <= 45 and results["peak_with_node_actions_mb"] <= 45
    write_results("node_actions", results)


if __name__ == "__main__":
    main()
