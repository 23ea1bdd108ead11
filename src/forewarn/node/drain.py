"""Drain: evict this node's pods through the Eviction API before the event's NotBefore.

- Evictions, not deletions, so PodDisruptionBudgets hold: a 429 (the budget allows no disruption now) is
  tried again every poll until the drain deadline.
- DaemonSet pods (their controller would put them back) and mirror pods (the kubelet's static pods) are
  skipped, as are pods already finished; pods with emptyDir volumes only when the action allows it
  (`delete_local_data`), otherwise they stay and the drain fails naming them.
- Each eviction's grace period is the pod's own, at most `grace`, and clamped so the pod is gone by the
  deadline: the earlier of `timeout` after the start and NotBefore minus `margin`.
- At most `max_nodes` nodes drain at once across the cluster: a drain holds one of that many Leases
  (`forewarn-drain-0`, ...), renewed while it runs, so one event listing a whole scale set never empties
  the node pool. The Lease names the node, so a restarted forewarn takes its own slot back.
- With a `selector`, only the pods matching it are listed and evicted (the API filters them, as the
  `labelSelector` of the pod list); every rule above holds for those. A Freeze pauses the VM for seconds,
  which most pods sit out unharmed, so the AKS policy moves only pods labelled as unable to pause.
- The start and the deadline are written to the node's `forewarn.io/applied` annotation: a forewarn that
  restarts in the middle of a drain resumes it, with the same deadline, rather than starting another.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from lightkube import ALL_NS, ApiError, operators
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Pod, PodEviction

from forewarn.approval.policy import LabelRequirement, NodeAction
from forewarn.imds.document import Event
from forewarn.node.actions import ledger_of, rfc3339
from forewarn.node.kube import KubeError, Stopped, explain, lease_expired

if TYPE_CHECKING:
    from forewarn.node.actions import KubeNodeActor

log = logging.getLogger(__name__)

LEASE_PREFIX = "forewarn-drain-"
LEASE_SECONDS = 60          # a slot whose holder stopped renewing is free again after this long
DEFAULT_GRACE = 30          # Kubernetes' default terminationGracePeriodSeconds
MIRROR = "kubernetes.io/config.mirror"


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

    def __init__(self, actor: KubeNodeActor, namespace: str, slots: int, event_id: str) -> None:
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


def _pods(actor: KubeNodeActor, action: NodeAction) -> list[dict[str, Any]]:
    """The pods on the node, only those matching the drain's selector when it has one."""
    labels = cast(Any, label_pairs(action.selector)) if action.selector else None
    try:
        return [pod.to_dict() for pod in actor.client.list(Pod, namespace=ALL_NS, labels=labels,
                                                            fields={"spec.nodeName": actor.node})]
    except Exception as exc:
        raise explain(exc, f"list pods on node {actor.node}"
                      + (f" matching {action.selector_text}" if action.selector else "")) from None


def drain(actor: KubeNodeActor, action: NodeAction, event: Event, dry_run: bool) -> str:
    """Drain `actor.node` for `event`; returns what was done, raises KubeError when the drain failed."""
    clock = actor.clock
    start = clock()
    deadline = start + action.timeout
    if event.not_before is not None:
        deadline = min(deadline, event.not_before.timestamp() - action.margin)
    # A notice shorter than the margin still gets the quickest drain possible rather than none.
    deadline = max(deadline, start + 1.0)
    # A selective drain says so wherever it reports, so nobody reads "drained" as "the node is empty".
    matching = f" matching {action.selector_text}" if action.selector else ""
    if dry_run:
        pods = _pods(actor, action)
        kinds = {_name(pod): classify(pod, action.delete_local_data) for pod in pods}
        evict = sorted(name for name, kind in kinds.items() if kind == "evict")
        stay = sorted(name for name, kind in kinds.items() if kind == "local")
        return (f"would drain node {actor.node}: evict {len(evict)} pod(s){matching} ({', '.join(evict) or 'none'})"
                + (f"; {len(stay)} with local storage would block it ({', '.join(stay)})" if stay else "")
                + f"; deadline in {deadline - start:.0f} s")

    entry = ledger_of(actor.get_node()).get(event.event_id, {})
    earlier = entry.get("drain") if isinstance(entry.get("drain"), dict) else None
    if earlier and earlier.get("done"):
        return f"node {actor.node} already drained for this event"
    if earlier:
        deadline = float(earlier.get("deadline", deadline))
        log.warning("node %s: resuming the drain for event %s started at %s (deadline %s)", actor.node,
                    event.event_id, earlier.get("started"), rfc3339(deadline))
    namespace = action.lease_namespace or actor.client.namespace
    slot = _Slot(actor, namespace, action.max_nodes, event.event_id)
    waiting_logged = False
    while slot.take() is None:
        if not waiting_logged:
            log.warning("node %s: waiting for a drain slot (at most %d node(s) drain at once; draining: %s)",
                        actor.node, action.max_nodes, slot.busy)
            waiting_logged = True
        if clock() >= deadline:
            raise KubeError(f"no drain slot came free before the deadline (at most {action.max_nodes} node(s) "
                            f"drain at once; draining: {slot.busy})")
        if actor.stopping.wait(actor.poll):
            raise Stopped("stopped while waiting for a drain slot")
    if not earlier:
        actor.record(event.event_id, "drain", {"started": rfc3339(start), "deadline": deadline, "lease": slot.name},
                     dry_run=False)
    evicted: dict[str, int] = {}
    said = ""
    try:
        while True:
            slot.renew()
            pods = _pods(actor, action)
            blocked: list[str] = []
            left: list[str] = []
            local: list[str] = []
            for pod in pods:
                name = _name(pod)
                kind = classify(pod, action.delete_local_data)
                if kind == "local":
                    local.append(name)
                elif kind == "wait" or (kind == "evict" and name in evicted):
                    left.append(name)
                elif kind == "evict":
                    grace = clamp_grace(pod, action.grace, deadline - clock())
                    outcome = _evict(actor, pod, grace)
                    if outcome == "evicted":
                        evicted[name] = grace
                        left.append(name)
                    elif outcome == "blocked":
                        blocked.append(name)
            if not left and not blocked:
                break
            now = clock()
            progress = (f"{len(left)} pod(s){matching} terminating, {len(blocked)} blocked by a PodDisruptionBudget "
                        f"({', '.join(sorted(blocked)) or 'none'})")
            if progress != said:
                log.info("node %s: draining: %s; %.0f s to the deadline", actor.node, progress, deadline - now)
                said = progress
            if now >= deadline:
                raise KubeError(f"drain deadline passed with pods left: {progress}"
                                + (f"; not evicted (local storage): {', '.join(sorted(local))}" if local else ""))
            if actor.stopping.wait(actor.poll):
                raise Stopped("stopped in the middle of the drain; the next start resumes it")
        actor.record(event.event_id, "drain", {"started": (earlier or {}).get("started", rfc3339(start)),
                                               "deadline": deadline, "done": True}, dry_run=False)
        slot.release()
    except KubeError as exc:
        if exc.code == 403 or "deadline" in str(exc):
            try:
                slot.release()
            except KubeError as release_error:
                log.error("node %s: cannot release drain slot: %s", actor.node, release_error)
        raise
    graces = sorted(set(evicted.values()))
    done = (f"drained node {actor.node}: evicted {len(evicted)} pod(s){matching}"
            + (f" (grace {', '.join(map(str, graces))} s)" if graces else "")
            + f" in {clock() - start:.1f} s, {max(0.0, deadline - clock()):.0f} s before the deadline")
    if local:
        raise KubeError(f"{done}; but {len(local)} pod(s) with local storage were not evicted (allow with "
                        f"delete_local_data: true): {', '.join(sorted(local))}")
    return done


def _evict(actor: KubeNodeActor, pod: dict[str, Any], grace: int) -> str:
    """Ask for the eviction of `pod`: evicted, blocked (a PodDisruptionBudget forbids it now) or gone."""
    meta = pod.get("metadata") or {}
    name, namespace = str(meta.get("name")), str(meta.get("namespace"))
    body = cast(PodEviction, Pod.Eviction.from_dict({"apiVersion": "policy/v1", "kind": "Eviction",
                                   "metadata": {"name": name, "namespace": namespace},
                                   "deleteOptions": {"gracePeriodSeconds": grace}}))
    try:
        actor.client.create(body, name=name, namespace=namespace)
    except ApiError as exc:
        code = exc.status.code
        if code == 429 or (code == 500 and "disruption budget" in str(exc.status.message or "")):
            return "blocked"
        if code == 404:
            return "gone"
        raise explain(exc, f"evict pod {namespace}/{name}") from None
    except Exception as exc:
        raise explain(exc, f"evict pod {namespace}/{name}") from None
    log.info("node %s: evicted pod %s/%s (grace %d s)", actor.node, namespace, name, grace)
    return "evicted"
