"""Drain: evict this node's pods through the Eviction API before the event's NotBefore.

- Evictions, not deletions, so PodDisruptionBudgets hold: a 429 (the budget allows no disruption now) is
  tried again every poll until the drain deadline.
- DaemonSet pods (their controller would put them back) and mirror pods (the kubelet's static pods) are
  skipped, as are pods already finished; pods with emptyDir volumes only when the action allows it
  (`delete_local_data`), otherwise they stay and the drain fails naming them.
- Order (`order: priority`, the default): the pods with the lowest priority (`spec.priority`) go first, tier by
  tier; the PriorityClasses in `last` (system-cluster-critical, system-node-critical) after every other. A
  tier is waited for until its pods are gone or its share of the time is up (the time left to the deadline
  divided by the tiers left), then the next one starts; pods of earlier tiers still there are tried again.
- Each eviction's grace period is the pod's own, at most `grace`, and clamped so the pod is gone by the
  deadline: the earlier of `timeout` after the start and NotBefore minus `margin`.
- At the deadline (`at_deadline`): `report` fails the drain naming the pods left and the budgets that keep
  them; `delete` deletes them (never mirror pods, never DaemonSet pods) with the grace left before NotBefore,
  each one reported, and waits for them to go.
- `stop_daemonsets` (daemonsets.py): once the node is drained it is tainted NoExecute, so DaemonSet pods
  that do not tolerate it (log shippers...) stop with their own grace, after the workloads they serve.
- At most `max_nodes` nodes drain at once across the cluster (slots.py: one of that many Leases), so one
  event listing a whole scale set never empties the node pool.
- With a `selector`, only the pods matching it are listed and evicted (the API filters them, as the
  `labelSelector` of the pod list); every rule above holds for those.
- The start, the deadline and the tier under way are written to the node's `forewarn.io/applied`
  annotation: a forewarn that restarts in the middle of a drain resumes it where it was, with the same
  deadline, rather than starting another.
- Each step is reported as it happens (drainrun.py: started, blocked at most once a minute, deleted, done,
  failed) and posted as a Kubernetes Event on the node; each pod evicted or deleted gets an Event too.
Which pods go, in which tier and with what grace is pods.py.
"""

from __future__ import annotations

import logging
from typing import Any

from forewarn.approval.actor import Report
from forewarn.approval.policy import STOP_TAINT, NodeAction
from forewarn.imds.document import Event
from forewarn.node.daemonsets import stop_daemonsets, stop_taint
from forewarn.node.drainrun import DrainRun
from forewarn.node.kube import KubeError, Stopped
from forewarn.node.nodeapi import NodeHandle, ledger_of, rfc3339
from forewarn.node.pods import (
    Tier,
    classify,
    is_daemonset,
    list_pods,
    listed,
    pod_name,
    tier_of,
    tier_text,
    tolerates,
)
from forewarn.node.slots import LEASE_PREFIX, LEASE_SECONDS, Slot

# Re-exported: the Lease names and times are documented with the drain.
__all__ = ["LEASE_PREFIX", "LEASE_SECONDS", "drain"]

log = logging.getLogger(__name__)


def _dry_run(node: NodeHandle, action: NodeAction, event: Event, seconds: float, matching: str) -> str:
    pods = list_pods(node, action)
    kinds = {pod_name(pod): classify(pod, action.delete_local_data) for pod in pods}
    evict = sorted(name for name, kind in kinds.items() if kind == "evict")
    stay = sorted(name for name, kind in kinds.items() if kind == "local")
    tiers: dict[Tier, list[str]] = {}
    for pod in pods:
        if kinds[pod_name(pod)] == "evict":
            tiers.setdefault(tier_of(pod, action), []).append(pod_name(pod))
    text = (f"would drain node {node.node}: evict {len(evict)} pod(s){matching} ({', '.join(evict) or 'none'})"
            + (f"; {len(stay)} with local storage would block it ({', '.join(stay)})" if stay else ""))
    if len(tiers) > 1:
        text += "; in this order: " + "; ".join(f"{tier_text(tier, action)}: {listed(names, 5)}"
                                               for tier, names in sorted(tiers.items()))
    if action.stop_daemonsets:
        taint = stop_taint(event)
        everything = list_pods(node, action, every=True)
        going = [pod_name(p) for p in everything if is_daemonset(p) and not tolerates(p, taint)]
        staying = [pod_name(p) for p in everything if is_daemonset(p) and tolerates(p, taint)]
        text += (f"; then would taint {STOP_TAINT}:NoExecute: {len(going)} DaemonSet pod(s) would stop "
                 f"({listed(going)}), {len(staying)} tolerate it and stay ({listed(staying)})")
    return text + f"; deadline in {seconds:.0f} s"


def drain(node: NodeHandle, action: NodeAction, event: Event, dry_run: bool, report: Report) -> str:
    """Drain `node` for `event`; returns what was done, raises KubeError when the drain failed."""
    clock = node.clock
    start = clock()
    deadline = start + action.timeout
    if event.not_before is not None:
        deadline = min(deadline, event.not_before.timestamp() - action.margin)
    # A notice shorter than the margin still gets the quickest drain possible rather than none.
    deadline = max(deadline, start + 1.0)
    # A selective drain says so wherever it reports, so nobody reads "drained" as "the node is empty".
    matching = f" matching {action.selector_text}" if action.selector else ""
    if dry_run:
        return _dry_run(node, action, event, deadline - start, matching)

    entry = ledger_of(node.get_node()).get(node.key(event.event_id), {})
    earlier = entry.get("drain") if isinstance(entry.get("drain"), dict) else None
    if earlier and earlier.get("done"):
        return f"node {node.node} already drained for this event"
    state: dict[str, Any] = dict(earlier or {})
    if earlier:
        deadline = float(earlier.get("deadline", deadline))
        log.warning("node %s: resuming the drain for event %s started at %s (deadline %s, tier %s)", node.node,
                    event.event_id, earlier.get("started"), rfc3339(deadline), earlier.get("tier"))
    namespace = action.lease_namespace or node.client.namespace
    slot = Slot(node, namespace, action.max_nodes, event.event_id)
    run = DrainRun(node, action, event, report, deadline, float(state.get("started_at", start)))
    waiting_logged = False
    try:
        while slot.take() is None:
            if not waiting_logged:
                log.warning("node %s: waiting for a drain slot (at most %d node(s) drain at once; draining: %s)",
                            node.node, action.max_nodes, slot.busy)
                waiting_logged = True
            if clock() >= deadline:
                raise KubeError(f"no drain slot came free before the deadline (at most {action.max_nodes} node(s) "
                                f"drain at once; draining: {slot.busy})")
            if node.stopping.wait(node.poll):
                raise Stopped("stopped while waiting for a drain slot")
        if not earlier:
            state = {"started": rfc3339(start), "started_at": start, "deadline": deadline, "lease": slot.name}
            node.record(event.event_id, "drain", state, dry_run=False)
        run.say("started", f"drain of node {node.node}{matching} started: deadline {rfc3339(deadline)} (in "
                f"{max(0.0, deadline - clock()):.0f} s); order: {action.order_text}; at the deadline: "
                f"{action.at_deadline}", deadline=rfc3339(deadline), order=action.order,
                at_deadline=action.at_deadline, resumed=bool(earlier))
        if not earlier:
            run.node_event("DrainStarted", "Normal", f"forewarn started draining node {node.node}{matching} "
                           f"(deadline {rfc3339(deadline)})")
        local = _evict_all(run, state, slot)
        stopped = stop_daemonsets(run) if action.stop_daemonsets else ""
        node.record(event.event_id, "drain", {"started": state.get("started", rfc3339(start)),
                                              "deadline": deadline, "done": True}, dry_run=False)
        slot.release()
    except Stopped:
        node.blocked(0)
        raise
    except KubeError as exc:
        node.blocked(0)
        if exc.code == 403 or "deadline" in str(exc):
            try:
                slot.release()
            except KubeError as release_error:
                log.error("node %s: cannot release drain slot: %s", node.node, release_error)
        _failed(run, str(exc), clock() - start)
        raise
    node.blocked(0)
    graces = sorted(set(run.evicted.values()))
    took = clock() - start
    done = (f"drained node {node.node}: evicted {len(run.evicted)} pod(s){matching}"
            + (f" (grace {', '.join(map(str, graces))} s)" if graces else "")
            + (f", deleted {len(run.deleted)} at the deadline ({listed(list(run.deleted))})" if run.deleted else "")
            + f" in {took:.1f} s, {max(0.0, deadline - clock()):.0f} s before the deadline" + stopped)
    if local:
        reason = (f"{done}; but {len(local)} pod(s) with local storage were not evicted (allow with "
                  f"delete_local_data: true): {', '.join(sorted(local))}")
        _failed(run, reason, took)
        raise KubeError(reason)
    run.say("done", done, evicted=sorted(run.evicted), evicted_count=len(run.evicted), deleted=sorted(run.deleted),
            seconds=round(took, 1))
    run.node_event("DrainDone", "Normal", done)
    return done


def _failed(run: DrainRun, reason: str, took: float) -> None:
    run.say("failed", f"drain of node {run.node.node} failed: {reason}", reason=reason,
            blocked=[{"pod": pod, "budget": budget} for pod, budget in sorted(run.blocked.items())],
            evicted_count=len(run.evicted), seconds=round(took, 1))
    run.node_event("DrainFailed", "Warning", f"forewarn's drain of node {run.node.node} failed: {reason}")


def _evict_all(run: DrainRun, state: dict[str, Any], slot: Slot) -> list[str]:
    """Evict the pods tier by tier until none is left; returns the pods kept for their local storage."""
    node, action, event = run.node, run.action, run.event
    clock = node.clock
    tier: Tier | None = tuple(state["tier"]) if isinstance(state.get("tier"), list) else None
    tier_until = float(state.get("tier_until") or 0.0)
    deleted_at: float | None = None
    said = ""
    while True:
        slot.renew()
        now = clock()
        pods = list_pods(node, action)
        kinds = {pod_name(pod): classify(pod, action.delete_local_data) for pod in pods}
        local = sorted(name for name, kind in kinds.items() if kind == "local")
        present = sorted({tier_of(pod, action) for pod in pods if kinds[pod_name(pod)] in ("evict", "wait")})
        if not present:
            return local
        # The tier under way: the first; the next once every pod up to this one is gone or its time is up.
        active = [t for t in present if tier is not None and t <= tier]
        if tier is None or not active or now >= tier_until:
            later = [t for t in present if tier is None or t > tier]
            if later:
                tier = later[0]
                tier_until = now + max(0.0, run.deadline - now) / len(later)
                state.update(tier=list(tier), tier_until=tier_until)
                node.record(event.event_id, "drain", dict(state), dry_run=False)
                log.info("node %s: draining %s (%d tier(s) left, this one until %s)", node.node,
                         tier_text(tier, action), len(later), rfc3339(tier_until))
        assert tier is not None
        run.blocked = {}   # filled by run.evict() with the pods a budget refuses at this look
        left: list[str] = []
        for pod in pods:
            name = pod_name(pod)
            kind = kinds[name]
            if kind not in ("evict", "wait") or tier_of(pod, action) > tier:
                continue
            if kind == "wait" or name in run.evicted or name in run.deleted:
                left.append(name)
                continue
            run.evict(pod, now)
            if name in run.evicted:
                left.append(name)
        blocked = dict(run.blocked)
        run.note_blocked(blocked, now, tier)
        waiting = sum(1 for pod in pods if kinds[pod_name(pod)] == "evict" and tier_of(pod, action) > tier)
        progress = (f"{len(left)} pod(s){run.matching} terminating, {len(blocked)} blocked by a PodDisruptionBudget"
                    f" ({', '.join(f'{p} by {b}' for p, b in sorted(blocked.items())) or 'none'}), {waiting} waiting "
                    f"for a later tier")
        if progress != said:
            log.info("node %s: draining: %s; %.0f s to the deadline", node.node, progress, run.deadline - now)
            said = progress
        if now >= run.deadline:
            if action.at_deadline != "delete":
                raise KubeError(f"drain deadline passed with pods left: {progress}"
                                + (f"; not evicted (local storage): {', '.join(local)}" if local else ""))
            if deleted_at is None:
                # Never before the deadline: only now do the pods still there go without their budget's say.
                deleted_at = now
                for pod in pods:
                    if kinds[pod_name(pod)] == "evict" and pod_name(pod) not in run.evicted:
                        run.delete(pod, now)
            elif now > deleted_at + max([*run.deleted.values(), *run.evicted.values(), 0]) + 5:
                raise KubeError(f"pods still there after the deletions at the drain deadline: {progress}")
        if node.stopping.wait(node.poll):
            raise Stopped("stopped in the middle of the drain; the next start resumes it")
