"""Node actions through the Kubernetes API: cordon, taint, label, condition, event (and drain, in drain.py),
and their undo.

What forewarn applied is written in the annotation `forewarn.io/applied` on the Node itself, per event id,
in the same patch that applies it (a merge patch carrying the resourceVersion it was computed from, so a
concurrent change gets 409 and is computed again). So a restart remembers it, two events that both cordon
share one cordon, and an undo removes only what forewarn put there: a node an administrator or the AKS
remediator cordoned before stays cordoned, a label or taint someone else set stays as it is.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any, cast

from lightkube import ApiError, Client
from lightkube.resources.core_v1 import Node
from lightkube.resources.events_v1 import Event as KubeEvent
from lightkube.types import PatchType

from forewarn.approval.actor import ActionOutcome, Report
from forewarn.approval.policy import NodeAction
from forewarn.imds.document import Event
from forewarn.node.kube import KubeError, Stopped, explain

log = logging.getLogger(__name__)

#: The annotation that records what forewarn applied, per event id.
APPLIED = "forewarn.io/applied"
#: Kubernetes Events on a Node go to this namespace (as the kubelet's do).
EVENT_NAMESPACE = "default"
CONTROLLER = "forewarn.io/forewarn"
_CONFLICT_RETRIES = 5

Ledger = dict[str, dict[str, Any]]


def rfc3339(moment: float, micro: bool = False) -> str:
    text = datetime.fromtimestamp(moment, tz=timezone.utc).isoformat(timespec="microseconds" if micro else "seconds")
    return text.replace("+00:00", "Z")


def ledger_of(node: dict[str, Any]) -> Ledger:
    """What forewarn applied to `node`, by event id (empty when the annotation is absent or unreadable)."""
    text = ((node.get("metadata") or {}).get("annotations") or {}).get(APPLIED)
    if not text:
        return {}
    try:
        loaded = json.loads(text)
    except ValueError:
        log.warning("node annotation %s is not JSON; treating it as empty (nothing will be undone)", APPLIED)
        return {}
    return {str(k): v for k, v in loaded.items() if isinstance(v, dict)} if isinstance(loaded, dict) else {}


def ledger_patch(ledger: Ledger) -> dict[str, Any]:
    """The metadata part of a merge patch that stores `ledger` (removing the annotation when empty)."""
    value = json.dumps(ledger, separators=(",", ":"), sort_keys=True) if ledger else None
    return {"metadata": {"annotations": {APPLIED: value}}}


def held_by_others(ledger: Ledger, event_id: str, kind: str, item: Any = True) -> bool:
    """Whether an entry other than `event_id`'s holds `item` of `kind` (a cordon, a taint, a label...)."""
    for other, entry in ledger.items():
        if other == event_id:
            continue
        held = entry.get(kind)
        if held == item or (isinstance(held, list) and item in held):
            return True
    return False


class KubeNodeActor:
    """Carries out a rule's node actions on the node `node` (the NodeActor of the approver)."""

    def __init__(self, client: Client, node: str, *, clock: Callable[[], float] = time.time,
                 poll: float = 1.0, draining: Callable[[int], None] | None = None,
                 stopping: threading.Event | None = None) -> None:
        self.client = client
        self.node = node
        self.clock = clock
        self.poll = poll                  # seconds between looks at the pods of a drain
        # Set by close(): ends the waits of a drain and (shared with the client's transport) any request.
        self.stopping = stopping or threading.Event()
        self._draining = draining or (lambda _count: None)
        self._drains = 0
        self._drains_lock = threading.Lock()

    def close(self) -> None:
        self.stopping.set()
        self.client.close()

    # --- the NodeActor interface ------------------------------------------------------------------
    def act(self, actions: Sequence[NodeAction], event: Event, dry_run: bool, report: Report) -> bool:
        for action in actions:
            try:
                detail = self._one(action, event, dry_run)
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

    def undo(self, event_id: str, dry_run: bool, report: Report) -> None:
        try:
            detail = self._undo(event_id, dry_run)
        except KubeError as exc:
            log.error("node %s, event %s: undo failed: %s", self.node, event_id, exc)
            report(ActionOutcome("undo", "failed", str(exc)))
            return
        if detail:
            log.warning("node %s, event %s: %s%s", self.node, event_id, "DRY RUN: " if dry_run else "", detail)
            report(ActionOutcome("undo", "dry_run" if dry_run else "ok", detail))

    def _one(self, action: NodeAction, event: Event, dry_run: bool) -> str:
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
            from forewarn.node.drain import drain

            with self._drains_lock:
                self._drains += 1
                self._draining(self._drains)
            try:
                return drain(self, action, event, dry_run)
            finally:
                with self._drains_lock:
                    self._drains -= 1
                    self._draining(self._drains)
        raise KubeError(f"unknown node action {action.kind!r}")

    # --- reading and patching the Node ------------------------------------------------------------
    def get_node(self) -> dict[str, Any]:
        try:
            node: dict[str, Any] = self.client.get(Node, self.node).to_dict()
        except Exception as exc:  # lightkube raises ApiError or httpx2 errors; both become a KubeError
            raise explain(exc, f"get node {self.node}") from None
        return node

    def update_node(self, change: Callable[[dict[str, Any]], tuple[dict[str, Any] | None, str]],
                    dry_run: bool) -> str:
        """Read the node, let `change` compute a merge patch (None: nothing to change) and what it means,
        and apply it unless `dry_run`; computed again on a 409 (someone changed the node meanwhile)."""
        for _ in range(_CONFLICT_RETRIES):
            node = self.get_node()
            patch, detail = change(node)
            if patch is None:
                return detail
            if dry_run:
                return f"dry run, not applied: {detail}"
            patch.setdefault("metadata", {})["resourceVersion"] = node["metadata"]["resourceVersion"]
            try:
                self.client.patch(Node, self.node, patch, patch_type=PatchType.MERGE)
            except ApiError as exc:
                if exc.status.code == 409:
                    continue
                raise explain(exc, f"patch node {self.node}") from None
            except Exception as exc:
                raise explain(exc, f"patch node {self.node}") from None
            return detail
        raise KubeError(f"patch node {self.node}: still conflicting after {_CONFLICT_RETRIES} tries", 409)

    def record(self, event_id: str, kind: str, item: Any, dry_run: bool) -> None:
        """Add `item` of `kind` to the ledger entry of `event_id` (for what was applied in a separate
        request, such as a condition or a drain)."""
        def change(node: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
            ledger = ledger_of(node)
            entry = ledger.setdefault(event_id, {})
            if entry.get(kind) == item:
                return None, ""
            entry[kind] = item
            return ledger_patch(ledger), ""
        self.update_node(change, dry_run)

    # --- the actions ------------------------------------------------------------------------------
    def _cordon(self, event_id: str, dry_run: bool) -> str:
        def change(node: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
            ledger = ledger_of(node)
            entry = ledger.setdefault(event_id, {})
            cordoned = bool((node.get("spec") or {}).get("unschedulable"))
            if cordoned and entry.get("cordon"):
                return None, f"node {self.node} already cordoned for this event"
            if cordoned and held_by_others(ledger, event_id, "cordon"):
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
            entry = ledger.setdefault(event.event_id, {})
            taints = list((node.get("spec") or {}).get("taints") or [])
            text = f"{action.key}={value}:{action.effect}"
            present = any(t.get("key") == action.key and t.get("effect") == action.effect for t in taints)
            held = entry.get("taints", [])
            if present and mine in held:
                return None, f"taint {text} already on node {self.node} for this event"
            if present and held_by_others(ledger, event.event_id, "taints", mine):
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
            entry = ledger.setdefault(event.event_id, {})
            labels = (node.get("metadata") or {}).get("labels") or {}
            held = entry.get("labels", [])
            if action.key in labels and action.key in held:
                return None, f"label {action.key} already set for this event"
            if action.key in labels and held_by_others(ledger, event.event_id, "labels", action.key):
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
        node_uid = None
        try:
            node_uid = self.client.get(Node, self.node).metadata.uid  # type: ignore[union-attr]
        except Exception as exc:
            raise explain(exc, f"get node {self.node}") from None
        body = {
            "apiVersion": "events.k8s.io/v1", "kind": "Event",
            "metadata": {"name": f"{self.node}.{secrets.token_hex(8)}", "namespace": EVENT_NAMESPACE},
            "eventTime": rfc3339(self.clock(), micro=True),
            "reportingController": CONTROLLER,
            "reportingInstance": f"forewarn@{self.node}"[:128],
            "action": event.event_type,
            "reason": action.reason,
            "type": action.event_type,
            "note": note,
            "regarding": {"apiVersion": "v1", "kind": "Node", "name": self.node,
                          **({"uid": node_uid} if node_uid else {})},
        }
        try:
            self.client.create(cast(KubeEvent, KubeEvent.from_dict(body)), namespace=EVENT_NAMESPACE)
        except Exception as exc:
            raise explain(exc, f"create event in namespace {EVENT_NAMESPACE}") from None
        return f"posted a {action.event_type} event {action.reason} on node {self.node}"

    # --- undo -------------------------------------------------------------------------------------
    def pending(self) -> list[str]:
        """The event ids the node's ledger holds something for (what an undo would take back)."""
        return sorted(ledger_of(self.get_node()))

    def _undo(self, event_id: str, dry_run: bool) -> str:
        undone: list[str] = []
        # The condition first: once the ledger entry is gone nothing would remember it, so a failure here
        # leaves the entry in place for the undo to be tried again (removing an absent condition is a no-op).
        ledger = ledger_of(self.get_node())
        kind = (ledger.get(event_id) or {}).get("condition")
        if kind and not held_by_others(ledger, event_id, "condition", kind) and not dry_run:
            self._remove_condition(str(kind))

        def change(node: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
            undone.clear()
            ledger = ledger_of(node)
            entry = ledger.pop(event_id, None)
            if entry is None:
                return None, ""
            patch = ledger_patch(ledger)
            spec: dict[str, Any] = {}
            if entry.get("cordon") and not held_by_others(ledger, event_id, "cordon"):
                spec["unschedulable"] = None
                undone.append("uncordoned")
            taints = list((node.get("spec") or {}).get("taints") or [])
            drop = [t for t in entry.get("taints", []) if not held_by_others(ledger, event_id, "taints", t)]
            kept = [t for t in taints if [t.get("key"), t.get("effect")] not in drop]
            if len(kept) != len(taints):
                spec["taints"] = kept
                undone.append("removed taint " + ", ".join(f"{k}:{e}" for k, e in drop))
            labels = [k for k in entry.get("labels", []) if not held_by_others(ledger, event_id, "labels", k)]
            if labels:
                patch["metadata"]["labels"] = {key: None for key in labels}
                undone.append("removed label " + ", ".join(labels))
            if spec:
                patch["spec"] = spec
            held = entry.get("condition")
            if held and not held_by_others(ledger, event_id, "condition", held):
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
