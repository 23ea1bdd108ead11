"""The Kubernetes node as forewarn reads and writes it: the ledger of what forewarn applied, patches guarded
by the resourceVersion, and events.k8s.io Events. Every node action builds on this module (actions.py for
cordon, taint, label, condition and event; drain.py for the drain), and it imports neither of them.

What forewarn applied is written in the annotation `forewarn.io/applied` on the Node itself, one entry per
owner and event id (forewarn.owner: the per-VM agent, or a fleet instance by its scope and Lease), in the same
patch that applies it (a merge patch carrying the resourceVersion it was computed from, so a concurrent change
gets 409 and is computed again). So a restart remembers it, two events or two owners that both cordon share
one cordon, and an undo removes only what its owner put there.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, cast

from lightkube import ApiError, Client
from lightkube.resources.core_v1 import Node
from lightkube.resources.events_v1 import Event as KubeEvent
from lightkube.types import PatchType

from forewarn.node.kube import KubeError, explain
from forewarn.owner import AGENT, EntryRef, Owner, entry_ref

log = logging.getLogger(__name__)

#: The annotation that records what forewarn applied, per event id.
APPLIED = "forewarn.io/applied"
#: The annotation that turns forewarn's node actions off for one node (value `disabled`).
NODE_ACTIONS_ANNOTATION = "forewarn.io/node-actions"
NODE_ACTIONS_DISABLED = "disabled"
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


def entries(ledger: Ledger) -> list[EntryRef]:
    """Who holds what in `ledger`: each entry's key, event id and owner id."""
    return [entry_ref(key, entry) for key, entry in ledger.items()]


def held_by_others(ledger: Ledger, key: str, kind: str, item: Any = True) -> bool:
    """Whether an entry other than the one under `key` holds `item` of `kind` (a cordon, a taint, a label...),
    whoever its owner: what two entries hold stays until both are undone."""
    for other, entry in ledger.items():
        if other == key:
            continue
        held = entry.get(kind)
        if held == item or (isinstance(held, list) and item in held):
            return True
    return False


def actions_disabled(node: dict[str, Any]) -> str | None:
    """The value of the node's NODE_ACTIONS_ANNOTATION when it turns forewarn's node actions off, else None."""
    value = ((node.get("metadata") or {}).get("annotations") or {}).get(NODE_ACTIONS_ANNOTATION)
    if isinstance(value, str) and value.strip().lower() == NODE_ACTIONS_DISABLED:
        return value
    return None


class NodeHandle:
    """One Kubernetes node and the client that reaches it, with what every node action needs: read the node,
    patch it (ledger included) safely, post Events. `stopping` ends the waits of a drain (and, shared with
    the client's transport, any request under way); `poll` is the time between looks during a drain."""

    def __init__(self, client: Client, node: str, *, clock: Callable[[], float] = time.time, poll: float = 1.0,
                 stopping: threading.Event | None = None,
                 blocked: Callable[[float], None] | None = None, owner: Owner | None = None,
                 note: dict[str, Any] | None = None) -> None:
        self.client = client
        self.node = node
        self.clock = clock
        self.poll = poll
        self.owner = owner or Owner(AGENT)   # whose entries this handle writes and undoes
        self.note = dict(note or {})         # more fields for the entries it writes (fleet mode: `listed`)
        self.stopping = stopping or threading.Event()
        # Told when a drain became blocked by a PodDisruptionBudget (a Unix time), and 0 once it is not.
        self.blocked = blocked or (lambda _since: None)
        # forewarn's own pod, as far as it can tell: in a pod (not on the host network) the hostname is the pod's
        # name, and the service account's namespace is the pod's. Used to make sure a NoExecute taint of the
        # drain would not stop forewarn itself; None when it cannot tell.
        self.own_pod: tuple[str, str] | None = (str(client.namespace), socket.gethostname())

    def key(self, event_id: str) -> str:
        """The ledger key of this handle's owner's entry for `event_id`."""
        return self.owner.key(event_id)

    def entry(self, ledger: Ledger, event_id: str) -> dict[str, Any]:
        """This owner's entry for `event_id` in `ledger`, added (naming the owner) when there is none."""
        entry = ledger.setdefault(self.key(event_id), self.owner.new_entry(event_id))
        entry.update(self.note)
        return entry

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
            entry = self.entry(ledger, event_id)
            if entry.get(kind) == item:
                return None, ""
            entry[kind] = item
            return ledger_patch(ledger), ""
        self.update_node(change, dry_run)

    def post_event(self, regarding: dict[str, Any], *, action: str, reason: str, kind: str, note: str) -> None:
        """Post an events.k8s.io/v1 Event about `regarding` (an ObjectReference: a Node, or a Pod with its
        namespace), in the object's namespace (`default` for a Node). Raises KubeError."""
        namespace = regarding.get("namespace") or EVENT_NAMESPACE
        body = {
            "apiVersion": "events.k8s.io/v1", "kind": "Event",
            "metadata": {"name": f"{regarding.get('name')}.{secrets.token_hex(8)}"[-253:].lstrip(".-"),
                         "namespace": namespace},
            "eventTime": rfc3339(self.clock(), micro=True),
            "reportingController": CONTROLLER,
            "reportingInstance": f"forewarn@{self.node}"[:128],
            "action": action[:128] or "Drain",
            "reason": reason,
            "type": kind,
            "note": note.encode()[:1024].decode(errors="ignore"),
            "regarding": regarding,
        }
        try:
            self.client.create(cast(KubeEvent, KubeEvent.from_dict(body)), namespace=namespace)
        except Exception as exc:
            raise explain(exc, f"create event in namespace {namespace}") from None
