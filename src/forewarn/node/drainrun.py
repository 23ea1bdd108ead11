"""One drain under way for one event: what it has done so far (pods evicted, deleted, blocked by a budget),
and how it tells people: DrainProgress reports for the records (a blocked drain at most once a minute),
Kubernetes Events on the node and on each pod it removes, and the blocked-since gauge."""

from __future__ import annotations

import logging
from typing import Any

from lightkube import ApiError
from lightkube.resources.core_v1 import Pod

from forewarn.approval.actor import DrainProgress, Report
from forewarn.approval.policy import NodeAction
from forewarn.imds.document import Event
from forewarn.node.kube import KubeError, Stopped, explain
from forewarn.node.nodeapi import NodeHandle
from forewarn.node.pods import MIRROR, Tier, clamp_grace, evict_pod, is_daemonset, pod_name, tier_text

log = logging.getLogger(__name__)

#: A drain blocked by a PodDisruptionBudget is reported at most this often (seconds).
BLOCKED_EVERY = 60.0


class DrainRun:
    """One drain under way for one event: what it did so far, and how it tells people."""

    def __init__(self, node: NodeHandle, action: NodeAction, event: Event, report: Report, deadline: float,
                 started_at: float) -> None:
        self.node = node
        self.action = action
        self.event = event
        self.report = report
        self.deadline = deadline
        self.started_at = started_at
        self.evicted: dict[str, int] = {}     # pod -> grace given
        self.deleted: dict[str, int] = {}     # pod -> grace left when deleted at the deadline
        self.blocked: dict[str, str] = {}     # pod -> the budget keeping it, at the last look
        self.blocked_since: float | None = None
        self.blocked_said: float | None = None
        self.matching = f" matching {action.selector_text}" if action.selector else ""

    # --- telling people --------------------------------------------------------------------------
    def about(self) -> str:
        not_before = self.event.raw.get("NotBefore") or "not set"
        return f"Azure scheduled event {self.event.event_id} ({self.event.event_type}), NotBefore {not_before}"

    def say(self, phase: str, detail: str, key: str = "", **facts: Any) -> None:
        self.report(DrainProgress(phase, detail, key, facts))

    def node_event(self, reason: str, kind: str, what: str) -> None:
        self._post({"apiVersion": "v1", "kind": "Node", "name": self.node.node}, reason, kind, what)

    def pod_event(self, pod: dict[str, Any], reason: str, kind: str, what: str) -> None:
        meta = pod.get("metadata") or {}
        regarding = {"apiVersion": "v1", "kind": "Pod", "name": meta.get("name"), "namespace": meta.get("namespace")}
        if meta.get("uid"):
            regarding["uid"] = meta["uid"]
        self._post(regarding, reason, kind, what)

    def _post(self, regarding: dict[str, Any], reason: str, kind: str, what: str) -> None:
        # Events help people follow the drain; one that cannot be posted never stops it.
        try:
            self.node.post_event(regarding, action=self.event.event_type or "Drain", reason=reason, kind=kind,
                                 note=f"{what}; {self.about()} (forewarn)")
        except Stopped:
            raise
        except KubeError as exc:
            log.warning("node %s: cannot post the %s event: %s", self.node.node, reason, exc)

    def note_blocked(self, blocked: dict[str, str], now: float, tier: Tier) -> None:
        """Keep the blocked gauge, and report the pods a budget keeps: at once, then at most once a minute."""
        self.blocked = blocked
        if not blocked:
            if self.blocked_since is not None:
                self.blocked_since = None
                self.node.blocked(0)
            return
        if self.blocked_since is None:
            self.blocked_since = now
            self.node.blocked(now)
        if self.blocked_said is not None and now - self.blocked_said < BLOCKED_EVERY:
            return
        self.blocked_said = now
        pods = [{"pod": pod, "budget": budget} for pod, budget in sorted(blocked.items())]
        detail = (f"drain of node {self.node.node} blocked: {len(blocked)} pod(s){self.matching} kept by a "
                  f"PodDisruptionBudget: " + ", ".join(f"{p['pod']} (budget {p['budget']})" for p in pods[:20])
                  + f"; blocked for {now - self.blocked_since:.0f} s, {max(0.0, self.deadline - now):.0f} s to the "
                  f"deadline")
        self.say("blocked", detail, key=str(int((now - self.started_at) // BLOCKED_EVERY)), blocked=pods,
                 tier=tier_text(tier, self.action), blocked_seconds=round(now - self.blocked_since, 1))
        self.node_event("DrainBlocked", "Warning", detail)

    # --- acting on pods ---------------------------------------------------------------------------
    def evict(self, pod: dict[str, Any], now: float) -> None:
        name = pod_name(pod)
        grace = clamp_grace(pod, self.action.grace, self.deadline - now)
        outcome, budget = evict_pod(self.node, pod, grace)
        if outcome == "evicted":
            self.evicted[name] = grace
            self.pod_event(pod, "EvictedForMaintenance", "Normal",
                           f"evicted from node {self.node.node} by forewarn's drain (grace {grace} s)")
        elif outcome == "blocked":
            self.blocked[name] = budget

    def delete(self, pod: dict[str, Any], now: float) -> None:
        """Delete `pod` at the deadline with the grace left before NotBefore (at_deadline: delete)."""
        name = pod_name(pod)
        meta = pod.get("metadata") or {}
        if MIRROR in (meta.get("annotations") or {}) or is_daemonset(pod):
            return  # classify() never hands these on; kept here too, as the rule that matters most
        left = (self.event.not_before.timestamp() - now) if self.event.not_before else self.action.margin
        grace = clamp_grace(pod, self.action.grace, left)
        try:
            self.node.client.delete(Pod, str(meta.get("name")), namespace=str(meta.get("namespace")),
                                    grace_period=grace)
        except ApiError as exc:
            if exc.status.code == 404:
                return
            raise explain(exc, f"delete pod {name}") from None
        except Exception as exc:
            raise explain(exc, f"delete pod {name}") from None
        self.deleted[name] = grace
        budget = self.blocked.get(name)
        why = f"kept by PodDisruptionBudget {budget}" if budget else "still there"
        detail = (f"deleted pod {name} from node {self.node.node} at the drain deadline ({why}), grace {grace} s "
                  "(at_deadline: delete)")
        log.warning("node %s: %s", self.node.node, detail)
        self.say("deleted", detail, key=name, pod=name, grace=grace, **({"budget": budget} if budget else {}))
        self.pod_event(pod, "DeletedAtDeadline", "Warning", detail)
