"""Which Kubernetes node is a VM of the fleet: AKS names each node's VM in its `spec.providerID`.

The forms (cloud-provider-azure), with the ARM ID after `azure://`:
- a scale-set instance (AKS node pools, Uniform scale sets):
  `azure:///subscriptions/{s}/resourceGroups/{rg}/providers/Microsoft.Compute/virtualMachineScaleSets/{vmss}/virtualMachines/{instance}`;
  the Scheduled Event names it `{vmss}_{instance}` in its Resources, so its VM ID in fleet mode
  (forewarn.fleet.feed.vm_ids) is `.../virtualMachines/{vmss}_{instance}`;
- a VM of its own (availability sets, Flexible scale sets):
  `azure:///subscriptions/{s}/resourceGroups/{rg}/providers/Microsoft.Compute/virtualMachines/{name}`.
Resource groups are compared without regard to case (AKS's node resource group is `MC_...` in one and
`mc_...` in the other), and so are names, as ARM compares them.

`NodeIndex` maps the fleet's VM IDs to node names; `load_nodes` reads the cluster's nodes (name and providerID
only) through the Kubernetes client. A VM that is no node of this cluster maps to None: fleet mode counts it
and leaves it to whatever runs there.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from forewarn.owner import EntryRef

PROVIDER_PREFIX = "azure://"
_SCALE_SET_INSTANCE = re.compile(
    r"/subscriptions/(?P<sub>[^/]+)/resourceGroups/(?P<rg>[^/]+)/providers/Microsoft\.Compute/"
    r"virtualMachineScaleSets/(?P<vmss>[^/]+)/virtualMachines/(?P<instance>[^/]+)", re.IGNORECASE)
_VIRTUAL_MACHINE = re.compile(
    r"/subscriptions/(?P<sub>[^/]+)/resourceGroups/(?P<rg>[^/]+)/providers/Microsoft\.Compute/"
    r"virtualMachines/(?P<name>[^/]+)", re.IGNORECASE)

VmKey = tuple[str, str, str]   # (subscription, resource group, VM name), in lower case


def key_of_provider_id(provider_id: str) -> VmKey | None:
    """The VM a node's providerID names, or None when it names no Azure VM."""
    if not provider_id.lower().startswith(PROVIDER_PREFIX):
        return None
    arm_id = provider_id[len(PROVIDER_PREFIX):].rstrip("/")
    found = _SCALE_SET_INSTANCE.fullmatch(arm_id)
    if found:
        name = f"{found['vmss']}_{found['instance']}"
        return found["sub"].lower(), found["rg"].lower(), name.lower()
    found = _VIRTUAL_MACHINE.fullmatch(arm_id)
    if found:
        return found["sub"].lower(), found["rg"].lower(), found["name"].lower()
    return None


def key_of_vm_id(vm_resource_id: str) -> VmKey | None:
    """The same key for a VM ID of fleet mode (`.../virtualMachines/{name}`)."""
    found = _VIRTUAL_MACHINE.fullmatch(vm_resource_id.rstrip("/"))
    return (found["sub"].lower(), found["rg"].lower(), found["name"].lower()) if found else None


class NodeIndex:
    """The nodes of one cluster by the VM each runs on, and what forewarn holds on each (`held`: node name ->
    the entries of its ledger, the forewarn.io/applied annotation, each with its event id and owner)."""

    def __init__(self, nodes: Iterable[tuple[str, str]], held: dict[str, list[EntryRef]] | None = None,
                 out_of_service: Iterable[tuple[str, str]] = ()) -> None:
        """`nodes`: (node name, providerID) pairs; nodes without an Azure providerID are left out.
        `out_of_service`: (node, mark) for the nodes forewarn tainted out of service (forewarn.fleet.gone)."""
        self.held = dict(held or {})
        self.out_of_service = dict(out_of_service)
        self._by_vm: dict[VmKey, str] = {}
        for name, provider_id in nodes:
            key = key_of_provider_id(provider_id or "")
            if key is not None:
                self._by_vm[key] = name

    def __len__(self) -> int:
        return len(self._by_vm)

    def node_of(self, vm_resource_id: str) -> str | None:
        """The node running the VM `vm_resource_id`, or None when it is no node of this cluster."""
        key = key_of_vm_id(vm_resource_id)
        return self._by_vm.get(key) if key is not None else None


def load_nodes(client: Any) -> NodeIndex:
    """Every node of the cluster, through a lightkube Client (raises what the client raises)."""
    from lightkube.resources.core_v1 import Node

    from forewarn.fleet.gone import MARK
    from forewarn.node.nodeapi import entries, ledger_of

    pairs: list[tuple[str, str]] = []
    held: dict[str, list[EntryRef]] = {}
    marked: list[tuple[str, str]] = []
    for node in client.list(Node):
        name = node.metadata.name if node.metadata is not None else None
        provider_id = node.spec.providerID if node.spec is not None else None
        if name and provider_id:
            pairs.append((name, provider_id))
        ledger = ledger_of(node.to_dict()) if name else {}
        if ledger and name:
            held[name] = entries(ledger)
        if name and node.metadata is not None and MARK in (node.metadata.annotations or {}):
            marked.append((name, str((node.metadata.annotations or {})[MARK])))
    return NodeIndex(pairs, held, marked)
