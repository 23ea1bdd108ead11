"""Node actions through the Kubernetes API: cordon, taint, label, condition, event (and drain, in drain.py),
and their undo.

What forewarn applied is written in the annotation `forewarn.io/applied` on the Node itself, per event id,
in the same patch that applies it (a merge patch carrying the resourceVersion it was computed from, so a
concurrent change gets 409 and is computed again). So a restart remembers it, two events that both cordon
share one cordon, and an undo removes only what forewarn put there: a node an administrator or the AKS
remediator cordoned before stays cordoned, a label or taint someone else set stays as it is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from lightkube import Client
from lightkube.resources.core_v1 import Node
from lightkube.types import PatchType

from forewarn.approval.actor import ActionOutcome, Report
from forewarn.approval.policy import NodeAction
from forewarn.imds.document import Event
from forewarn.node.drain import drain
from forewarn.node.kube import KubeError, Stopped, explain
from forewarn.node.nodeapi import (
    APPLIED,
    CONTROLLER,
    EVENT_NAMESPACE,
    NODE_ACTIONS_ANNOTATION,
    Ledger,
    NodeHandle,
    actions_disabled,
    entries,
    held_by_others,
    ledger_of,
    ledger_patch,
    rfc3339,
)
from forewarn.owner import AGENT, Owner

# Re-exported: tests, fleet/lease.py and operators' scripts know them from here.
__all__ = ["APPLIED", "CONTROLLER", "EVENT_NAMESPACE", "KubeNodeActor", "Ledger", "held_by_others", "ledger_of",
           "ledger_patch", "rfc3339"]

log = logging.getLogger(__name__)


class KubeNodeActor(NodeHandle):
    """Carries out a rule's node actions on the node `node` (the NodeActor of the approver)."""

    def __init__(self, client: Client, node: str, *, clock: Callable[[], float] = time.time,
                 poll: float = 1.0, draining: Callable[[int], None] | None = None,
                 stopping: threading.Event | None = None,
                 blocked: Callable[[float], None] | None = None, owner: Owner | None = None,
                 note: dict[str, Any] | None = None) -> None:
        super().__init__(client, node, clock=clock, poll=poll, stopping=stopping, blocked=blocked, owner=owner,
                         note=note)
        self._draining = draining or (lambda _count: None)
        self._drains = 0
        self._drains_lock = threading.Lock()

    def close(self) -> None:
        self.stopping.set()
        self.client.close()

    # --- the NodeActor interface ------------------------------------------------------------------
    def act(self, actions: Sequence[NodeAction], event: Event, dry_run: bool, report: Report) -> bool:
        if actions:
            try:
                disabled = actions_disabled(self.get_node())
            except KubeError as exc:
                log.error("node %s, event %s: %s failed: %s", self.node, event.event_id, actions[0].kind, exc)
                report(ActionOutcome(actions[0].kind, "failed", str(exc)))
                return False
            if disabled is not None:
                # The administrator's word for this node: nothing is done, and the rule's on_failure decides
                # the approval as if the actions had failed (hold by default: Azure starts it at NotBefore).
                detail = (f"node actions are disabled on node {self.node} by its annotation "
                          f"{NODE_ACTIONS_ANNOTATION}={disabled}: not done")
                log.warning("node %s, event %s: %s", self.node, event.event_id, detail)
                for action in actions:
                    report(ActionOutcome(action.kind, "skipped", detail))
                return False
        for action in actions:
            try:
                detail = self._one(action, event, dry_run, report)
            except Stopped as exc:
                log.info("node %s, event %s: %s", self.node, event.event_id, exc)
                return False
            except KubeError as exc:
                log.error("node %s, event %s: %s failed: %s", self.node, event.event_id, action.kind, exc)
                report(ActionOutcome(action.kind, "failed", str(exc)))
                return False
            log.warning("node %s, event %s: %s%s", self.node, event.event_id, "DRY RUN: " if dry_run else "", detail)
            report(ActionOutcome(action.kind, "dry_run" if dry_run else "ok", detail))
        return True

    def undo(self, event_id: str, dry_run: bool, report: Report, legacy: bool | None = None) -> None:
        """Take back what this actor's owner applied for `event_id` (its entry only). `legacy`: also what an
        entry written before owners holds for it (forewarn.owner); by default only the per-VM agent adopts
        those, since its IMDS document lists every event of its VM while the event is open."""
        try:
            detail = self._undo(event_id, dry_run, self.owner.by == AGENT if legacy is None else legacy)
        except KubeError as exc:
            log.error("node %s, event %s: undo failed: %s", self.node, event_id, exc)
            report(ActionOutcome("undo", "failed", str(exc)))
            return
        if detail:
            log.warning("node %s, event %s: %s%s", self.node, event_id, "DRY RUN: " if dry_run else "", detail)
            report(ActionOutcome("undo", "dry_run" if dry_run else "ok", detail))

    def _one(self, action: NodeAction, event: Event, dry_run: bool, report: Report) -> str:
        if action.kind == "cordon":
            return self._cordon(event.event_id, dry_run)
        if action.kind == "taint":
            return self._taint(action, event, dry_run)
        if action.kind == "label":
            return self._label(action, event, dry_run)
        if action.kind == "condition":
            return self._condition(action, event, dry_run)
        if action.kind == "event":
            return self._event(action, event, dry_run)
        if action.kind == "drain":
            with self._drains_lock:
                self._drains += 1
                self._draining(self._drains)
            try:
                return drain(self, action, event, dry_run, report)
            finally:
                with self._drains_lock:
                    self._drains -= 1
                    self._draining(self._drains)
        raise KubeError(f"unknown node action {action.kind!r}")

    # --- the actions ------------------------------------------------------------------------------
    def _cordon(self, event_id: str, dry_run: bool) -> str:
        def change(node: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
            ledger = ledger_of(node)
            entry = self.entry(ledger, event_id)
            cordoned = bool((node.get("spec") or {}).get("unschedulable"))
            if cordoned and entry.get("cordon"):
                return None, f"node {self.node} already cordoned for this event"
            if cordoned and held_by_others(ledger, self.key(event_id), "cordon"):
                entry["cordon"] = True   # shared: uncordoned when the last of forewarn's events ends
                return ledger_patch(ledger), f"node {self.node} already cordoned by forewarn for another event"
            if cordoned:
                return None, (f"node {self.node} was already cordoned by someone else: left as it is, and left "
                              "cordoned after the event")
            entry["cordon"] = True
            patch = ledger_patch(ledger)
            patch["spec"] = {"unschedulable": True}
            return patch, f"cordoned node {self.node}"
        return self.update_node(change, dry_run)

    def _taint(self, action: NodeAction, event: Event, dry_run: bool) -> str:
        value = action.value or event.event_type
        mine = [action.key, action.effect]

        def change(node: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
            ledger = ledger_of(node)
            entry = self.entry(ledger, event.event_id)
            taints = list((node.get("spec") or {}).get("taints") or [])
            text = f"{action.key}={value}:{action.effect}"
            present = any(t.get("key") == action.key and t.get("effect") == action.effect for t in taints)
            held = entry.get("taints", [])
            if present and mine in held:
                return None, f"taint {text} already on node {self.node} for this event"
            if present and held_by_others(ledger, self.key(event.event_id), "taints", mine):
                entry["taints"] = [*held, mine]
                return ledger_patch(ledger), f"taint {action.key}:{action.effect} already set by forewarn"
            if present:
                return None, f"taint {action.key}:{action.effect} was set by someone else: left as it is"
            entry["taints"] = [*held, mine]
            patch = ledger_patch(ledger)
            # spec.taints has no patch strategy: the list is replaced whole (the resourceVersion guards it).
            patch["spec"] = {"taints": [*taints, {"key": action.key, "value": value, "effect": action.effect}]}
            return patch, f"tainted node {self.node} with {text}"
        return self.update_node(change, dry_run)

    def _label(self, action: NodeAction, event: Event, dry_run: bool) -> str:
        value = action.value or event.event_type

        def change(node: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
            ledger = ledger_of(node)
            entry = self.entry(ledger, event.event_id)
            labels = (node.get("metadata") or {}).get("labels") or {}
            held = entry.get("labels", [])
            if action.key in labels and action.key in held:
                return None, f"label {action.key} already set for this event"
            if action.key in labels and held_by_others(ledger, self.key(event.event_id), "labels", action.key):
                entry["labels"] = [*held, action.key]
                return ledger_patch(ledger), f"label {action.key} already set by forewarn"
            if action.key in labels:
                return None, f"label {action.key}={labels[action.key]} was set by someone else: left as it is"
            entry["labels"] = [*held, action.key]
            patch = ledger_patch(ledger)
            patch["metadata"]["labels"] = {action.key: value}
            return patch, f"labelled node {self.node} {action.key}={value}"
        return self.update_node(change, dry_run)

    def _condition(self, action: NodeAction, event: Event, dry_run: bool) -> str:
        not_before = event.raw.get("NotBefore") or "unknown"
        reason = f"{event.event_type}Scheduled"
        message = (f"Azure scheduled event {event.event_id} ({event.event_type}, {event.status}) affects this node; "
                   f"NotBefore {not_before} (forewarn)")
        if dry_run:
            return f"would set condition {action.condition_type}=True ({reason}) on node {self.node}"
        self._set_condition(action.condition_type, "True", reason, message)
        self.record(event.event_id, "condition", action.condition_type, dry_run=False)
        return f"set condition {action.condition_type}=True ({reason}) on node {self.node}"

    def _set_condition(self, kind: str, status: str, reason: str, message: str) -> None:
        now = rfc3339(self.clock())
        # Strategic merge: conditions merge by type, so only forewarn's own condition is written.
        patch = {"status": {"conditions": [{"type": kind, "status": status, "reason": reason, "message": message,
                                            "lastHeartbeatTime": now, "lastTransitionTime": now}]}}
        try:
            self.client.patch(Node.Status, self.node, patch, patch_type=PatchType.STRATEGIC)
        except Exception as exc:
            raise explain(exc, f"patch node {self.node} status") from None

    def _event(self, action: NodeAction, event: Event, dry_run: bool) -> str:
        not_before = event.raw.get("NotBefore") or "unknown"
        note = (f"Azure scheduled event {event.event_id}: {event.event_type} ({event.status}), NotBefore "
                f"{not_before}; {event.description or ''}").strip("; ")[:1024]
        if dry_run:
            return f"would post a {action.event_type} event {action.reason} on node {self.node}"
        try:
            node_uid = self.client.get(Node, self.node).metadata.uid  # type: ignore[union-attr]
        except Exception as exc:
            raise explain(exc, f"get node {self.node}") from None
        regarding = {"apiVersion": "v1", "kind": "Node", "name": self.node, **({"uid": node_uid} if node_uid else {})}
        self.post_event(regarding, action=event.event_type, reason=action.reason, kind=action.event_type, note=note)
        return f"posted a {action.event_type} event {action.reason} on node {self.node}"

    # --- undo -------------------------------------------------------------------------------------
    def pending(self) -> list[str]:
        """The event ids this owner's entries (and, for the per-VM agent, legacy entries) hold something for:
        what its undo would take back. Other owners' entries are not listed."""
        adopt = self.owner.by == AGENT
        return sorted({ref.event_id for ref in entries(ledger_of(self.get_node()))
                       if ref.owner_id == self.owner.id or (adopt and ref.legacy)})

    def _taken(self, ledger: Ledger, event_id: str, legacy: bool) -> tuple[dict[str, Any] | None, str]:
        """This owner's entry for `event_id`, merged with the legacy one when `legacy`, both taken out of
        `ledger`; and the key the entry stood under (None for the entry: nothing held)."""
        merged: dict[str, Any] = {}
        found = False
        keys = [self.key(event_id)]
        old = ledger.get(event_id)
        if legacy and old is not None and "by" not in old:
            keys.append(event_id)
        for key in keys:
            entry = ledger.pop(key, None)
            if entry is None:
                continue
            found = True
            for kind, held in entry.items():
                if isinstance(held, list):
                    merged[kind] = [*merged.get(kind, []), *(item for item in held if item not in merged.get(kind, []))]
                elif kind not in merged or not merged[kind]:
                    merged[kind] = held
        return (merged if found else None), self.key(event_id)

    def _undo(self, event_id: str, dry_run: bool, legacy: bool = False) -> str:
        undone: list[str] = []
        # The condition first: once the ledger entry is gone nothing would remember it, so a failure here
        # leaves the entry in place for the undo to be tried again (removing an absent condition is a no-op).
        ledger = ledger_of(self.get_node())
        mine, key = self._taken(ledger, event_id, legacy)
        kind = (mine or {}).get("condition")
        if kind and not held_by_others(ledger, key, "condition", kind) and not dry_run:
            self._remove_condition(str(kind))

        def change(node: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
            undone.clear()
            ledger = ledger_of(node)
            entry, key = self._taken(ledger, event_id, legacy)
            if entry is None:
                return None, ""
            patch = ledger_patch(ledger)
            spec: dict[str, Any] = {}
            if entry.get("cordon") and not held_by_others(ledger, key, "cordon"):
                spec["unschedulable"] = None
                undone.append("uncordoned")
            taints = list((node.get("spec") or {}).get("taints") or [])
            drop = [t for t in entry.get("taints", []) if not held_by_others(ledger, key, "taints", t)]
            kept = [t for t in taints if [t.get("key"), t.get("effect")] not in drop]
            if len(kept) != len(taints):
                spec["taints"] = kept
                undone.append("removed taint " + ", ".join(f"{k}:{e}" for k, e in drop))
            labels = [k for k in entry.get("labels", []) if not held_by_others(ledger, key, "labels", k)]
            if labels:
                patch["metadata"]["labels"] = {key: None for key in labels}
                undone.append("removed label " + ", ".join(labels))
            if spec:
                patch["spec"] = spec
            held = entry.get("condition")
            if held and not held_by_others(ledger, key, "condition", held):
                undone.append(f"removed condition {held}")
            if entry.get("drain"):
                undone.append("drain record dropped")
            return patch, "; ".join(undone) or "nothing left to undo"

        detail = self.update_node(change, dry_run)
        if not detail:
            return ""
        return f"node {self.node}: {detail}"

    def _remove_condition(self, kind: str) -> None:
        # Strategic merge: the `$patch: delete` directive removes the one condition whose type (the merge key)
        # matches; the kubelet's, NPD's and anyone else's stay as they are.
        patch = {"status": {"conditions": [{"type": kind, "$patch": "delete"}]}}
        try:
            self.client.patch(Node.Status, self.node, patch, patch_type=PatchType.STRATEGIC)
        except Exception as exc:
            raise explain(exc, f"patch node {self.node} status") from None
