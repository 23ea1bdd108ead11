"""After the VM is gone: what fleet mode may do to the Node of a VM a Preempt or Terminate took away.

A Spot eviction (Preempt) or a Terminate removes the VM, but its Node object stays until the cloud provider
notices, and pods with volumes on it wait for the attach/detach timeout (6 minutes) before their volumes
can move. A rule's `after_eviction` (fleet mode only, opt-in) ends that wait once the event has completed:
- `out_of_service`: the taint `node.kubernetes.io/out-of-service=nodeshutdown:NoExecute`, which Kubernetes
  documents for exactly this (non-graceful node shutdown): pods without a matching toleration are deleted
  at once and their volumes detach. forewarn marks the node with the annotation `forewarn.io/out-of-service`
  (`{EventId}@{owner id}`, forewarn.owner) and, once the node is Ready again, the instance that set it takes
  its taint back off, never one another instance or anyone else set;
- `delete_node`: delete the Node object (the VM will not come back as this node).
Never for a node that is Ready: a Ready node is running, whatever the event said.
"""

from __future__ import annotations

from typing import Any

from lightkube.resources.core_v1 import Node

from forewarn.node.kube import explain
from forewarn.node.nodeapi import NodeHandle

OUT_OF_SERVICE = {"key": "node.kubernetes.io/out-of-service", "value": "nodeshutdown", "effect": "NoExecute"}
MARK = "forewarn.io/out-of-service"


def is_ready(node: dict[str, Any]) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _ours(taint: dict[str, Any]) -> bool:
    return taint.get("key") == OUT_OF_SERVICE["key"] and taint.get("effect") == OUT_OF_SERVICE["effect"]


def mark_is_mine(mark: str, owner_id: str) -> bool:
    """Whether the out-of-service mark `mark` was set by `owner_id` (a mark without an owner, set before owners
    existed, is taken back by any fleet instance: only a Ready node loses it, and only forewarn's taint)."""
    return "@" not in mark or mark.split("@", 1)[1] == owner_id


class GoneNode(NodeHandle):
    """The Node of a VM that is gone."""

    def out_of_service(self, event_id: str, dry_run: bool) -> tuple[str, str]:
        """Taint the node out of service, unless it is Ready or already tainted: (result, detail), the result
        `skipped` for a Ready node. Raises KubeError."""
        ready = False

        def change(node: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
            nonlocal ready
            ready = is_ready(node)
            if ready:
                return None, f"node {self.node} is Ready: not tainted out of service"
            taints = list((node.get("spec") or {}).get("taints") or [])
            if any(_ours(taint) for taint in taints):
                return None, f"node {self.node} is already out of service"
            patch = {"metadata": {"annotations": {MARK: self.key(event_id)}},
                     "spec": {"taints": [*taints, OUT_OF_SERVICE]}}
            return (patch,
                    f"tainted node {self.node} out of service (node.kubernetes.io/out-of-service=nodeshutdown:"
                    "NoExecute): its pods go and their volumes detach")
        detail = self.update_node(change, dry_run)
        return ("skipped" if ready else "dry_run" if dry_run else "ok"), detail

    def back_in_service(self, dry_run: bool) -> tuple[str, str]:
        """Take forewarn's out-of-service taint off a node that is Ready again (and the mark): (the id of the
        event it was set for, what was done), or ("", "") when there is nothing to do."""
        event_id = ""

        def change(node: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
            nonlocal event_id
            annotations = (node.get("metadata") or {}).get("annotations") or {}
            if MARK not in annotations or not mark_is_mine(str(annotations[MARK]), self.owner.id):
                return None, ""
            event_id = str(annotations[MARK]).split("@", 1)[0]
            if not is_ready(node):
                return None, ""
            taints = [t for t in (node.get("spec") or {}).get("taints") or [] if not _ours(t)]
            return ({"metadata": {"annotations": {MARK: None}}, "spec": {"taints": taints}},
                    f"node {self.node} is Ready again: took forewarn's out-of-service taint off")
        detail = self.update_node(change, dry_run)
        return (event_id, detail) if detail else ("", "")

    def delete(self, dry_run: bool) -> tuple[str, str]:
        """Delete the Node object, unless it is Ready: (result, detail). Raises KubeError."""
        node = self.get_node()
        if is_ready(node):
            return "skipped", f"node {self.node} is Ready: not deleted"
        if dry_run:
            return "dry_run", f"dry run, not applied: delete node {self.node}"
        try:
            self.client.delete(Node, self.node)
        except Exception as exc:
            raise explain(exc, f"delete node {self.node}") from None
        return "ok", f"deleted node {self.node}: its VM is gone"
