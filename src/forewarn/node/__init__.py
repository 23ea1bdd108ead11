"""Kubernetes node actions (cordon, taint, label, condition, event, drain) and their undo.

Imports the Kubernetes client library: only `forewarn.agent` loads this package, and only for a policy
whose rules have node actions (`Policy.uses_node_actions`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from forewarn.node.actions import KubeNodeActor
from forewarn.node.kube import SERVICE_ACCOUNT, KubeError, make_client

__all__ = ["KubeError", "KubeNodeActor", "build_actor"]


def build_actor(node: str, kubeconfig: str | None, draining: Callable[[int], None] | None = None,
                poll: float = 1.0, *, service_account: Path = SERVICE_ACCOUNT,
                blocked: Callable[[float], None] | None = None) -> KubeNodeActor:
    """The actor for `node`, with a client from `kubeconfig` (or the in-cluster service account in
    `service_account`, KUBECONFIG, ~/.kube/config)."""
    stopping = threading.Event()   # the actor's close() sets it: it ends a request under way too
    client = make_client(kubeconfig, service_account=service_account, stop=stopping)
    return KubeNodeActor(client, node, draining=draining, poll=poll, stopping=stopping, blocked=blocked)
