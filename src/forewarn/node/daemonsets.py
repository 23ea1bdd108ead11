"""The DaemonSet stop after a drain (`stop_daemonsets`): the node is tainted `forewarn.io/drained=<event
type>:NoExecute`, so Kubernetes' taint manager stops every DaemonSet pod that does not tolerate it with its
own grace period, after the workloads they serve have gone. The taint is written in the node's ledger, so
the undo takes it back with the event; forewarn never taints when its own pod would not tolerate it."""

from __future__ import annotations

import logging
from typing import Any

from forewarn.approval.policy import STOP_TAINT
from forewarn.imds.document import Event
from forewarn.node.drainrun import DrainRun
from forewarn.node.kube import KubeError, Stopped
from forewarn.node.nodeapi import held_by_others, ledger_of, ledger_patch
from forewarn.node.pods import is_daemonset, list_pods, listed, pod_name, tolerates

log = logging.getLogger(__name__)


def stop_taint(event: Event) -> dict[str, str]:
    return {"key": STOP_TAINT, "value": event.event_type or "Unknown", "effect": "NoExecute"}


def stop_daemonsets(run: DrainRun) -> str:
    """Taint the drained node NoExecute, then wait (until the deadline) for the DaemonSet pods that do not
    tolerate it to stop; returns what happened, to add to the drain's outcome."""
    node, event = run.node, run.event
    taint = stop_taint(event)
    mine = [STOP_TAINT, "NoExecute"]
    text = f"{STOP_TAINT}={taint['value']}:NoExecute"

    def change(current: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        ledger = ledger_of(current)
        entry = node.entry(ledger, event.event_id)
        taints = list((current.get("spec") or {}).get("taints") or [])
        present = any(t.get("key") == STOP_TAINT and t.get("effect") == "NoExecute" for t in taints)
        held = entry.get("taints", [])
        if present and mine in held:
            return None, ""
        if present and not held_by_others(ledger, node.key(event.event_id), "taints", mine):
            return None, ""   # someone else's: left as it is, and not ours to undo
        entry["taints"] = [*held, mine]
        patch = ledger_patch(ledger)
        if not present:
            # spec.taints has no patch strategy: the list is replaced whole (the resourceVersion guards it).
            patch["spec"] = {"taints": [*taints, taint]}
        return patch, ""

    own = node.own_pod
    mine_here = [p for p in list_pods(node, run.action, every=True) if own is not None and pod_name(p) == "/".join(own)]
    if own is not None and mine_here and not tolerates(mine_here[0], taint):
        # The taint would stop forewarn before it could report the drain or undo the taint after the event.
        raise KubeError(f"not tainting node {node.node} {text}: forewarn's own pod {own[0]}/{own[1]} does not tolerate "
                        "it; add the toleration {key: forewarn.io/drained, operator: Exists, effect: NoExecute} "
                        "(the Helm chart and the kustomize component node-actions have it)")
    node.update_node(change, dry_run=False)
    said = ""
    while True:
        pods = list_pods(node, run.action, every=True)
        going = [pod_name(p) for p in pods if is_daemonset(p) and not tolerates(p, taint)]
        staying = [pod_name(p) for p in pods if is_daemonset(p) and tolerates(p, taint)]
        if not going:
            return (f"; tainted it {text}: its DaemonSet pods stopped, {len(staying)} tolerate the taint and stay "
                    f"({listed(staying)})")
        if node.clock() >= run.deadline:
            return (f"; tainted it {text}: {len(going)} DaemonSet pod(s) still stopping at the deadline "
                    f"({listed(going)})")
        if listed(going) != said:
            log.info("node %s: waiting for %d DaemonSet pod(s) to stop: %s", node.node, len(going), listed(going))
            said = listed(going)
        if node.stopping.wait(node.poll):
            raise Stopped("stopped while DaemonSet pods were stopping; the next start resumes it")
