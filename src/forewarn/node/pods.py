"""The pods of a node as a drain sees them: which to evict, in which tier, with what grace, which tolerate a
taint; listing them and asking for an eviction through the Eviction API."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from typing import Any, cast

from lightkube import ALL_NS, ApiError, operators
from lightkube.resources.core_v1 import Pod, PodEviction

from forewarn.approval.policy import LabelRequirement, NodeAction
from forewarn.node.kube import explain
from forewarn.node.nodeapi import NodeHandle

log = logging.getLogger(__name__)

DEFAULT_GRACE = 30          # Kubernetes' default terminationGracePeriodSeconds
MIRROR = "kubernetes.io/config.mirror"
#: The values Kubernetes gives its own PriorityClasses, for a pod that names one but has no spec.priority.
KNOWN_PRIORITIES = {"system-node-critical": 2000001000, "system-cluster-critical": 2000000000}
_BUDGET = re.compile(r"disruption budget (\S+)")

#: A drain tier: (1 for the PriorityClasses evicted last, else 0; the pods' priority).
Tier = tuple[int, int]


def pod_name(pod: dict[str, Any]) -> str:
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


def is_daemonset(pod: dict[str, Any]) -> bool:
    meta = pod.get("metadata") or {}
    return (any(ref.get("kind") == "DaemonSet" for ref in meta.get("ownerReferences") or [])
            and MIRROR not in (meta.get("annotations") or {})
            and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"))


def list_pods(node: NodeHandle, action: NodeAction, every: bool = False) -> list[dict[str, Any]]:
    """The pods on the node, only those matching the drain's selector when it has one (unless `every`)."""
    selective = bool(action.selector) and not every
    labels = cast(Any, label_pairs(action.selector)) if selective else None
    try:
        return [pod.to_dict() for pod in node.client.list(Pod, namespace=ALL_NS, labels=labels,
                                                           fields={"spec.nodeName": node.node})]
    except Exception as exc:
        raise explain(exc, f"list pods on node {node.node}"
                      + (f" matching {action.selector_text}" if selective else "")) from None


def listed(names: Sequence[str], most: int = 20) -> str:
    shown = ", ".join(sorted(names)[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "") if names else "none"


def evict_pod(node: NodeHandle, pod: dict[str, Any], grace: int) -> tuple[str, str]:
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
            return "blocked", budget_of(exc)
        if code == 404:
            return "gone", ""
        raise explain(exc, f"evict pod {namespace}/{name}") from None
    except Exception as exc:
        raise explain(exc, f"evict pod {namespace}/{name}") from None
    log.info("node %s: evicted pod %s/%s (grace %d s)", node.node, namespace, name, grace)
    return "evicted", ""


def budget_of(exc: ApiError) -> str:
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
