"""The cluster-wide cap on nodes draining at once: a drain holds one of `max_nodes` coordination.k8s.io Leases
(`forewarn-drain-0`, ...), renewed while it runs and free again LEASE_SECONDS after its holder stopped
renewing. The Lease names the node, so a restarted forewarn takes its own slot back."""

from __future__ import annotations

from typing import Any, cast

from lightkube import ApiError
from lightkube.resources.coordination_v1 import Lease

from forewarn.node.kube import KubeError, explain, lease_expired
from forewarn.node.nodeapi import NodeHandle, rfc3339

LEASE_PREFIX = "forewarn-drain-"
LEASE_SECONDS = 60          # a slot whose holder stopped renewing is free again after this long


class Slot:
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
