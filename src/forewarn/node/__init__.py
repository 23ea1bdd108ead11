"""Kubernetes node actions (cordon, taint, label, condition, event, drain) and their undo.

Imports the Kubernetes client library: only `forewarn.agent` loads this package, and only for a policy
whose rules have node actions (`Policy.uses_node_actions`).
"""

from __future__ import annotations

from collections.abc import Callable

from forewarn.node.actions import KubeNodeActor
from forewarn.node.kube import KubeError, make_client

__all__ = ["KubeError", "KubeNodeActor", "build_actor"]


def build_actor(node: str, kubeconfig: str | None, draining: Callable[[int], None] | None = None,
                poll: float = 1.0) -> KubeNodeActor:
    """The actor for `node`, with a client from `kubeconfig` (or in-cluster / KUBECONFIG / ~/.kube/config)."""
    return KubeNodeActor(make_client(kubeconfig), node, draining=draining, poll=poll)
