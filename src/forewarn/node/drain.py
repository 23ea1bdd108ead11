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
- `stop_daemonsets`: once the node is drained it is tainted `forewarn.io/drained=<event type>:NoExecute`,
  so DaemonSet pods that do not tolerate it (log shippers...) stop with their own grace, after the
  workloads they serve; forewarn's own DaemonSet tolerates it. The taint is undone with the event.
- At most `max_nodes` nodes drain at once across the cluster: a drain holds one of that many Leases
  (`forewarn-drain-0`, ...), renewed while it runs, so one event listing a whole scale set never empties
  the node pool. The Lease names the node, so a restarted forewarn takes its own slot back.
- With a `selector`, only the pods matching it are listed and evicted (the API filters them, as the
  `labelSelector` of the pod list); every rule above holds for those.
- The start, the deadline and the tier under way are written to the node's `forewarn.io/applied`
  annotation: a forewarn that restarts in the middle of a drain resumes it where it was, with the same
  deadline, rather than starting another.
- Each step is reported as it happens (DrainProgress: started, blocked at most once a minute, deleted, done,
  failed) and posted as a Kubernetes Event on the node; each pod evicted or deleted gets an Event too.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from typing import Any, cast

from lightkube import ALL_NS, ApiError, operators
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Pod, PodEviction

from forewarn.approval.actor import DrainProgress, Report
from forewarn.approval.policy import STOP_TAINT, LabelRequirement, NodeAction
from forewarn.imds.document import Event
from forewarn.node.kube import KubeError, Stopped, explain, lease_expired
from forewarn.node.nodeapi import NodeHandle, held_by_others, ledger_of, ledger_patch, rfc3339

log = logging.getLogger(__name__)

LEASE_PREFIX = "forewarn-drain-"
LEASE_SECONDS = 60          # a slot whose holder stopped renewing is free again after this long
DEFAULT_GRACE = 30          # Kubernetes' default terminationGracePeriodSeconds
MIRROR = "kubernetes.io/config.mirror"
#: A drain blocked by a PodDisruptionBudget is reported at most this often (seconds).
BLOCKED_EVERY = 60.0
#: The values Kubernetes gives its own PriorityClasses, for a pod that names one but has no spec.priority.
KNOWN_PRIORITIES = {"system-node-critical": 2000001000, "system-cluster-critical": 2000000000}
_BUDGET = re.compile(r"disruption budget (\S+)")

#: A drain tier: (1 for the PriorityClasses evicted last, else 0; the pods' priority).
Tier = tuple[int, int]


def _name(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name')}"


def classify(pod: dict[str, Any], delete_local_data: bool) -> str:
    """What a drain does with `pod`: evict, skip (DaemonSet, mirror, finished), local (emptyDir, not
    allowed) or wait (terminating already)."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    if MIRROR in (meta.get("annotations") or {}):
        return "skip"
    if any(ref.get("kind") == "DaemonSet" for ref in meta.get("ownerReferences") or []):
        return "skip"
    if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return "skip"
    if meta.get("deletionTimestamp"):
        return "wait"
    if not delete_local_data and any("emptyDir" in volume for volume in spec.get("volumes") or []):
        return "local"
    return "evict"


def clamp_grace(pod: dict[str, Any], most: int | None, left: float) -> int:
    """The grace period to give `pod`: its own, at most `most`, and no longer than the `left` seconds to
    the deadline (at least 1: 0 would mean a kill without SIGTERM)."""
    own = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
    grace = DEFAULT_GRACE if own is None else int(own)
    if most is not None:
        grace = min(grace, most)
    return max(1, min(grace, math.floor(left)))


class _Slot:
    """One of the cluster-wide drain Leases, held by this node while it drains."""

    def __init__(self, actor: NodeHandle, namespace: str, slots: int, event_id: str) -> None:
        self.actor = actor
        self.namespace = namespace
        self.slots = slots
        self.event_id = event_id
        self.name: str | None = None
        self.renewed = 0.0

    def _body(self, name: str, holder: str | None, version: str | None, acquired: str | None) -> Lease:
        now = rfc3339(self.actor.clock(), micro=True)
        spec: dict[str, Any] = {"leaseDurationSeconds": LEASE_SECONDS}
        if holder:
            spec.update(holderIdentity=holder, renewTime=now, acquireTime=acquired or now)
        metadata: dict[str, Any] = {"name": name, "namespace": self.namespace,
                                    "labels": {"app.kubernetes.io/managed-by": "forewarn"}}
        if version:
            metadata["resourceVersion"] = version
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata, "spec": spec}
        return cast(Lease, Lease.from_dict(body))

    def take(self) -> str | None:
        """Take a free slot (or the one this node holds already); None when all are busy. Returns a
        description of the holders when busy, through `self.busy`."""
        client = self.actor.client
        node = self.actor.node
        now = self.actor.clock()
        holders = []
        for index in range(self.slots):
            name = f"{LEASE_PREFIX}{index}"
            try:
                lease = client.get(Lease, name, namespace=self.namespace).to_dict()
            except ApiError as exc:
                if exc.status.code != 404:
                    raise explain(exc, f"get lease {self.namespace}/{name}") from None
                try:
                    client.create(self._body(name, node, None, None), namespace=self.namespace)
                except ApiError as exc2:
                    if exc2.status.code == 409:  # another node created it first
                        continue
                    raise explain(exc2, f"create lease {self.namespace}/{name}") from None
                except Exception as exc2:
                    raise explain(exc2, f"create lease {self.namespace}/{name}") from None
                return self._took(name, now)
            except Exception as exc:
                raise explain(exc, f"get lease {self.namespace}/{name}") from None
            spec = lease.get("spec") or {}
            holder = spec.get("holderIdentity")
            if holder == node:
                return self._took(name, now, renew=False)
            if holder and not lease_expired(spec, now, LEASE_SECONDS):
                holders.append(str(holder))
                continue
            try:
                client.replace(self._body(name, node, lease["metadata"]["resourceVersion"], None))
            except ApiError as exc:
                if exc.status.code == 409:  # taken meanwhile
                    continue
                raise explain(exc, f"update lease {self.namespace}/{name}") from None
            except Exception as exc:
                raise explain(exc, f"update lease {self.namespace}/{name}") from None
            return self._took(name, now)
        self.busy = ", ".join(holders)
        return None

    busy = ""

    def _took(self, name: str, now: float, renew: bool = True) -> str:
        self.name = name
        self.renewed = now if renew else 0.0
        return name

    def _update(self, holder: str | None) -> None:
        if self.name is None:
            return
        client = self.actor.client
        try:
            lease = client.get(Lease, self.name, namespace=self.namespace).to_dict()
            if (lease.get("spec") or {}).get("holderIdentity") != self.actor.node:
                raise KubeError(f"lease {self.namespace}/{self.name} was taken by another node")
            acquired = (lease.get("spec") or {}).get("acquireTime")
            client.replace(self._body(self.name, holder, lease["metadata"]["resourceVersion"], acquired))
        except KubeError:
            raise
        except Exception as exc:
            raise explain(exc, f"update lease {self.namespace}/{self.name}") from None

    def renew(self) -> None:
        now = self.actor.clock()
        if now - self.renewed >= LEASE_SECONDS / 3:
            self._update(self.actor.node)
            self.renewed = now

    def release(self) -> None:
        self._update(None)
        self.name = None


def label_pairs(selector: Sequence[LabelRequirement]) -> list[tuple[str, operators.Operator[Any]]]:
    """`selector` in the form lightkube's `list(labels=...)` encodes into a labelSelector. A list of pairs
    rather than a dict: `build_selector` takes both, and only a list keeps two terms on one key
    (`a!=x,a!=y`)."""
    pairs: list[tuple[str, operators.Operator[Any]]] = []
    for term in selector:
        operator: operators.Operator[Any]
        if term.op == "exists":
            operator = operators.exists()
        elif term.op == "!":
            operator = operators.not_exists()
        elif term.op == "in":
            operator = operators.in_(term.values)
        elif term.op == "notin":
            operator = operators.not_in(term.values)
        elif term.op == "!=":
            operator = operators.not_equal(term.values[0])
        else:
            operator = operators.equal(term.values[0])
        pairs.append((term.key, operator))
    return pairs


def priority_of(pod: dict[str, Any]) -> int:
    """The pod's priority: spec.priority (set by admission from its PriorityClass), else the value of a
    well-known class it names, else 0 (Kubernetes' default without a global default class)."""
    spec = pod.get("spec") or {}
    if isinstance(spec.get("priority"), int):
        return int(spec["priority"])
    return KNOWN_PRIORITIES.get(str(spec.get("priorityClassName") or ""), 0)


def tier_of(pod: dict[str, Any], action: NodeAction) -> Tier:
    """The tier `pod` is evicted in: lower tiers go first."""
    if action.order == "none":
        return (0, 0)
    last = 1 if (pod.get("spec") or {}).get("priorityClassName") in action.last else 0
    return (last, priority_of(pod))


def tier_text(tier: Tier, action: NodeAction) -> str:
    if action.order == "none":
        return "every pod"
    return f"priority {tier[1]}" + (" (a class evicted last)" if tier[0] else "")


def tolerates(pod: dict[str, Any], taint: dict[str, str]) -> bool:
    """Whether `pod` tolerates `taint` (the scheduler's and the taint manager's matching)."""
    for toleration in (pod.get("spec") or {}).get("tolerations") or []:
        if toleration.get("effect") and toleration["effect"] != taint["effect"]:
            continue
        operator = toleration.get("operator") or "Equal"
        key = toleration.get("key") or ""
        if not key:
            if operator == "Exists":
                return True
            continue
        if key == taint["key"] and (operator == "Exists" or (toleration.get("value") or "") == taint.get("value", "")):
            return True
    return False


def _daemonset(pod: dict[str, Any]) -> bool:
    meta = pod.get("metadata") or {}
    return (any(ref.get("kind") == "DaemonSet" for ref in meta.get("ownerReferences") or [])
            and MIRROR not in (meta.get("annotations") or {})
            and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"))


def _pods(node: NodeHandle, action: NodeAction, every: bool = False) -> list[dict[str, Any]]:
    """The pods on the node, only those matching the drain's selector when it has one (unless `every`)."""
    selective = bool(action.selector) and not every
    labels = cast(Any, label_pairs(action.selector)) if selective else None
    try:
        return [pod.to_dict() for pod in node.client.list(Pod, namespace=ALL_NS, labels=labels,
                                                           fields={"spec.nodeName": node.node})]
    except Exception as exc:
        raise explain(exc, f"list pods on node {node.node}"
                      + (f" matching {action.selector_text}" if selective else "")) from None


def _listed(names: Sequence[str], most: int = 20) -> str:
    shown = ", ".join(sorted(names)[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "") if names else "none"


def _dry_run(node: NodeHandle, action: NodeAction, event: Event, seconds: float, matching: str) -> str:
    pods = _pods(node, action)
    kinds = {_name(pod): classify(pod, action.delete_local_data) for pod in pods}
    evict = sorted(name for name, kind in kinds.items() if kind == "evict")
    stay = sorted(name for name, kind in kinds.items() if kind == "local")
    tiers: dict[Tier, list[str]] = {}
    for pod in pods:
        if kinds[_name(pod)] == "evict":
            tiers.setdefault(tier_of(pod, action), []).append(_name(pod))
    text = (f"would drain node {node.node}: evict {len(evict)} pod(s){matching} ({', '.join(evict) or 'none'})"
            + (f"; {len(stay)} with local storage would block it ({', '.join(stay)})" if stay else ""))
    if len(tiers) > 1:
        text += "; in this order: " + "; ".join(f"{tier_text(tier, action)}: {_listed(names, 5)}"
                                               for tier, names in sorted(tiers.items()))
    if action.stop_daemonsets:
        taint = _stop_taint(event)
        everything = _pods(node, action, every=True)
        going = [_name(p) for p in everything if _daemonset(p) and not tolerates(p, taint)]
        staying = [_name(p) for p in everything if _daemonset(p) and tolerates(p, taint)]
        text += (f"; then would taint {STOP_TAINT}:NoExecute: {len(going)} DaemonSet pod(s) would stop "
                 f"({_listed(going)}), {len(staying)} tolerate it and stay ({_listed(staying)})")
    return text + f"; deadline in {seconds:.0f} s"


def _stop_taint(event: Event) -> dict[str, str]:
    return {"key": STOP_TAINT, "value": event.event_type or "Unknown", "effect": "NoExecute"}


class _Drain:
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
        name = _name(pod)
        grace = clamp_grace(pod, self.action.grace, self.deadline - now)
        outcome, budget = _evict(self.node, pod, grace)
        if outcome == "evicted":
            self.evicted[name] = grace
            self.pod_event(pod, "EvictedForMaintenance", "Normal",
                           f"evicted from node {self.node.node} by forewarn's drain (grace {grace} s)")
        elif outcome == "blocked":
            self.blocked[name] = budget

    def delete(self, pod: dict[str, Any], now: float) -> None:
        """Delete `pod` at the deadline with the grace left before NotBefore (at_deadline: delete)."""
        name = _name(pod)
        meta = pod.get("metadata") or {}
        if MIRROR in (meta.get("annotations") or {}) or _daemonset(pod):
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

    entry = ledger_of(node.get_node()).get(event.event_id, {})
    earlier = entry.get("drain") if isinstance(entry.get("drain"), dict) else None
    if earlier and earlier.get("done"):
        return f"node {node.node} already drained for this event"
    state: dict[str, Any] = dict(earlier or {})
    if earlier:
        deadline = float(earlier.get("deadline", deadline))
        log.warning("node %s: resuming the drain for event %s started at %s (deadline %s, tier %s)", node.node,
                    event.event_id, earlier.get("started"), rfc3339(deadline), earlier.get("tier"))
    namespace = action.lease_namespace or node.client.namespace
    slot = _Slot(node, namespace, action.max_nodes, event.event_id)
    run = _Drain(node, action, event, report, deadline, float(state.get("started_at", start)))
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
        stopped = _stop_daemonsets(run) if action.stop_daemonsets else ""
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
            + (f", deleted {len(run.deleted)} at the deadline ({_listed(list(run.deleted))})" if run.deleted else "")
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


def _failed(run: _Drain, reason: str, took: float) -> None:
    run.say("failed", f"drain of node {run.node.node} failed: {reason}", reason=reason,
            blocked=[{"pod": pod, "budget": budget} for pod, budget in sorted(run.blocked.items())],
            evicted_count=len(run.evicted), seconds=round(took, 1))
    run.node_event("DrainFailed", "Warning", f"forewarn's drain of node {run.node.node} failed: {reason}")


def _evict_all(run: _Drain, state: dict[str, Any], slot: _Slot) -> list[str]:
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
        pods = _pods(node, action)
        kinds = {_name(pod): classify(pod, action.delete_local_data) for pod in pods}
        local = sorted(name for name, kind in kinds.items() if kind == "local")
        present = sorted({tier_of(pod, action) for pod in pods if kinds[_name(pod)] in ("evict", "wait")})
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
            name = _name(pod)
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
        waiting = sum(1 for pod in pods if kinds[_name(pod)] == "evict" and tier_of(pod, action) > tier)
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
                    if kinds[_name(pod)] == "evict" and _name(pod) not in run.evicted:
                        run.delete(pod, now)
            elif now > deleted_at + max([*run.deleted.values(), *run.evicted.values(), 0]) + 5:
                raise KubeError(f"pods still there after the deletions at the drain deadline: {progress}")
        if node.stopping.wait(node.poll):
            raise Stopped("stopped in the middle of the drain; the next start resumes it")


def _stop_daemonsets(run: _Drain) -> str:
    """Taint the drained node NoExecute, then wait (until the deadline) for the DaemonSet pods that do not
    tolerate it to stop; returns what happened, to add to the drain's outcome."""
    node, event = run.node, run.event
    taint = _stop_taint(event)
    mine = [STOP_TAINT, "NoExecute"]
    text = f"{STOP_TAINT}={taint['value']}:NoExecute"

    def change(current: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        ledger = ledger_of(current)
        entry = ledger.setdefault(event.event_id, {})
        taints = list((current.get("spec") or {}).get("taints") or [])
        present = any(t.get("key") == STOP_TAINT and t.get("effect") == "NoExecute" for t in taints)
        held = entry.get("taints", [])
        if present and mine in held:
            return None, ""
        if present and not held_by_others(ledger, event.event_id, "taints", mine):
            return None, ""   # someone else's: left as it is, and not ours to undo
        entry["taints"] = [*held, mine]
        patch = ledger_patch(ledger)
        if not present:
            # spec.taints has no patch strategy: the list is replaced whole (the resourceVersion guards it).
            patch["spec"] = {"taints": [*taints, taint]}
        return patch, ""

    own = node.own_pod
    mine_here = [p for p in _pods(node, run.action, every=True) if own is not None and _name(p) == "/".join(own)]
    if own is not None and mine_here and not tolerates(mine_here[0], taint):
        # The taint would stop forewarn before it could report the drain or undo the taint after the event.
        raise KubeError(f"not tainting node {node.node} {text}: forewarn's own pod {own[0]}/{own[1]} does not tolerate "
                        "it; add the toleration {key: forewarn.io/drained, operator: Exists, effect: NoExecute} "
                        "(the Helm chart and the kustomize component node-actions have it)")
    node.update_node(change, dry_run=False)
    said = ""
    while True:
        pods = _pods(node, run.action, every=True)
        going = [_name(p) for p in pods if _daemonset(p) and not tolerates(p, taint)]
        staying = [_name(p) for p in pods if _daemonset(p) and tolerates(p, taint)]
        if not going:
            return (f"; tainted it {text}: its DaemonSet pods stopped, {len(staying)} tolerate the taint and stay "
                    f"({_listed(staying)})")
        if node.clock() >= run.deadline:
            return (f"; tainted it {text}: {len(going)} DaemonSet pod(s) still stopping at the deadline "
                    f"({_listed(going)})")
        if _listed(going) != said:
            log.info("node %s: waiting for %d DaemonSet pod(s) to stop: %s", node.node, len(going), _listed(going))
            said = _listed(going)
        if node.stopping.wait(node.poll):
            raise Stopped("stopped while DaemonSet pods were stopping; the next start resumes it")


def _evict(node: NodeHandle, pod: dict[str, Any], grace: int) -> tuple[str, str]:
    """Ask for the eviction of `pod`: evicted, blocked (a PodDisruptionBudget forbids it now; with the
    budget's name) or gone."""
    meta = pod.get("metadata") or {}
    name, namespace = str(meta.get("name")), str(meta.get("namespace"))
    body = cast(PodEviction, Pod.Eviction.from_dict({"apiVersion": "policy/v1", "kind": "Eviction",
                                   "metadata": {"name": name, "namespace": namespace},
                                   "deleteOptions": {"gracePeriodSeconds": grace}}))
    try:
        node.client.create(body, name=name, namespace=namespace)
    except ApiError as exc:
        code = exc.status.code
        message = str(exc.status.message or "")
        if code == 429 or (code == 500 and "disruption budget" in message.lower()):
            return "blocked", _budget_of(exc)
        if code == 404:
            return "gone", ""
        raise explain(exc, f"evict pod {namespace}/{name}") from None
    except Exception as exc:
        raise explain(exc, f"evict pod {namespace}/{name}") from None
    log.info("node %s: evicted pod %s/%s (grace %d s)", node.node, namespace, name, grace)
    return "evicted", ""


def _budget_of(exc: ApiError) -> str:
    """The PodDisruptionBudget a refused eviction names (the API server's cause: "The disruption budget web
    needs 1 healthy pods ..."), or a description when it names none."""
    status: Any = exc.status
    causes = getattr(getattr(status, "details", None), "causes", None) or []
    for cause in causes:
        found = _BUDGET.search(str(getattr(cause, "message", "") or ""))
        if found:
            return found.group(1)
    if "more than one" in str(status.message or ""):
        return "(more than one PodDisruptionBudget)"
    return "(unnamed PodDisruptionBudget)"
