"""A VM of the fleet to its Kubernetes node (forewarn.fleet.nodes): AKS scale-set instances and VMs by their
providerID, resource groups in either case; the nodes read through lightkube from the strict API stand-in."""

from __future__ import annotations

from pathlib import Path

import pytest

from forewarn.fleet.feed import FleetEvent, vm_ids
from forewarn.fleet.nodes import NodeIndex, key_of_provider_id, load_nodes
from forewarn.imds.document import Event
from forewarn.node.kube import make_client

from peers.kube_api import KubeApi

SUB = "0b7a6f6e-1d2c-4c3b-9a8e-7f6d5c4b3a21"
POOL = (f"/subscriptions/{SUB}/resourceGroups/MC_rg-aks_cluster_westeurope/providers/Microsoft.Compute/"
        "virtualMachineScaleSets/aks-nodepool1-12345678-vmss")
AVSET = f"/subscriptions/{SUB}/resourceGroups/rg-legacy/providers/Microsoft.Compute/availabilitySets/workers"


def event_on(target: str, group: str, resources: tuple[str, ...]) -> FleetEvent:
    event = Event("E-1", "Reboot", "Scheduled", "VirtualMachine", resources, None, raw={"EventId": "E-1"})
    return FleetEvent(target, SUB, group, event, "resourcegraph")


@pytest.mark.parametrize(("provider_id", "key"), [
    (f"azure://{POOL}/virtualMachines/3", (SUB, "mc_rg-aks_cluster_westeurope", "aks-nodepool1-12345678-vmss_3")),
    (f"azure:///subscriptions/{SUB.upper()}/resourcegroups/RG-Legacy/providers/microsoft.compute/virtualMachines/"
     "Worker-1", (SUB, "rg-legacy", "worker-1")),
    ("kind://docker/kind/kind-control-plane", None),
    (f"azure://{POOL}", None),
    ("", None),
])
def test_provider_ids_name_the_vm(provider_id: str, key: tuple[str, str, str] | None) -> None:
    assert key_of_provider_id(provider_id) == key


def test_the_vms_of_scale_set_and_availability_set_events_map_to_their_nodes_whatever_the_case() -> None:
    index = NodeIndex([
        ("aks-nodepool1-12345678-vmss000003", f"azure://{POOL}/virtualMachines/3"),
        ("aks-nodepool1-12345678-vmss00000a", f"azure://{POOL}/virtualMachines/10"),
        ("worker-1", f"azure:///subscriptions/{SUB}/resourceGroups/RG-LEGACY/providers/Microsoft.Compute/"
                     "virtualMachines/worker-1"),
        ("on-prem", ""),
    ])
    assert len(index) == 3
    # ARM IDs name AKS's node resource group in lower case where providerIDs have MC_ (and the reverse)
    pool_event = event_on(POOL.replace("MC_rg-aks", "mc_rg-aks"), "mc_rg-aks_cluster_westeurope",
                          ("aks-nodepool1-12345678-vmss_3", "aks-nodepool1-12345678-vmss_10",
                           "aks-nodepool1-12345678-vmss_7"))
    assert [index.node_of(vm) for vm in vm_ids(pool_event)] == [
        "aks-nodepool1-12345678-vmss000003", "aks-nodepool1-12345678-vmss00000a", None]  # _7: no node here
    legacy = event_on(AVSET, "rg-legacy", ("worker-1", "worker-2"))
    assert [index.node_of(vm) for vm in vm_ids(legacy)] == ["worker-1", None]


def test_the_nodes_are_read_through_the_kubernetes_api(tmp_path: Path) -> None:
    with KubeApi() as api:
        api.add_node("aks-nodepool1-12345678-vmss000003", provider_id=f"azure://{POOL}/virtualMachines/3")
        api.add_node("worker-1", provider_id=f"azure:///subscriptions/{SUB}/resourceGroups/rg-legacy/providers/"
                                             "Microsoft.Compute/virtualMachines/worker-1")
        api.add_node("no-provider")
        index = load_nodes(make_client(str(api.kubeconfig(tmp_path / "kubeconfig", admin=True))))
    assert len(index) == 2
    assert index.node_of(f"/subscriptions/{SUB}/resourceGroups/mc_rg-aks_cluster_westeurope/providers/"
                         "Microsoft.Compute/virtualMachines/aks-nodepool1-12345678-vmss_3") == \
        "aks-nodepool1-12345678-vmss000003"
