"""The Kubernetes API stand-in (tests/peers/kube_api.py) is strict where the API server is: these tests drive
it with the real client libraries (lightkube and the official `kubernetes`) and with raw HTTP, and check the
answers the API server documents."""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from peers.kube_api import TOKEN, KubeApi

lightkube = pytest.importorskip("lightkube")
kubernetes = pytest.importorskip("kubernetes")

from kubernetes import client as k8s  # noqa: E402
from kubernetes import config as k8s_config  # noqa: E402
from kubernetes.client.rest import ApiException  # noqa: E402
from lightkube import ApiError, Client, KubeConfig  # noqa: E402
from lightkube.models.coordination_v1 import LeaseSpec  # noqa: E402
from lightkube.models.core_v1 import ObjectReference  # noqa: E402
from lightkube.models.meta_v1 import DeleteOptions, ObjectMeta  # noqa: E402
from lightkube.resources.coordination_v1 import Lease  # noqa: E402
from lightkube.resources.core_v1 import Node, Pod  # noqa: E402
from lightkube.resources.events_v1 import Event  # noqa: E402
from lightkube.types import PatchType  # noqa: E402

NOW = datetime.datetime(2026, 3, 1, 12, 0, tzinfo=datetime.timezone.utc)
AKS_TAINT = {"key": "remediator.kubernetes.azure.com/unschedulable", "value": "true", "effect": "NoSchedule"}
NPD_CONDITION = {"type": "VMEventScheduled", "status": "True", "reason": "VMEventScheduled",
                 "message": "Reboot scheduled", "lastHeartbeatTime": "2026-03-01T11:00:00Z",
                 "lastTransitionTime": "2026-03-01T11:00:00Z"}

CLUSTER_ROLE = """\
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: forewarn-node-actions
rules:
  - apiGroups: [""]
    resources: ["nodes"]
    verbs: ["get", "patch"]
  - apiGroups: [""]
    resources: ["pods"]
    verbs: ["list"]
  - apiGroups: [""]
    resources: ["pods/eviction"]
    verbs: ["create"]
  - apiGroups: ["events.k8s.io"]
    resources: ["events"]
    verbs: ["create"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: forewarn-drain-cap
  namespace: forewarn
rules:
  - apiGroups: ["coordination.k8s.io"]
    resources: ["leases"]
    resourceNames: ["forewarn-drain-cap"]
    verbs: ["get", "update"]
"""


@pytest.fixture
def kube() -> Iterator[KubeApi]:
    api = KubeApi()
    api.add_node("node-1", taints=[AKS_TAINT], conditions=[NPD_CONDITION])
    api.add_node("node-2")
    try:
        yield api
    finally:
        api.stop()


def lightkube_client(api: KubeApi, tmp_path: Path) -> Client:
    return Client(config=KubeConfig.from_file(api.kubeconfig(tmp_path / "kubeconfig")), field_manager="forewarn")


def official_client(api: KubeApi, tmp_path: Path) -> k8s.ApiClient:
    return k8s_config.new_client_from_config(str(api.kubeconfig(tmp_path / "kubeconfig")))


def raw(api: KubeApi, method: str, path: str, body: Any = None, content_type: str = "application/json",
        **params: str) -> requests.Response:
    data = None if body is None else json.dumps(body)
    return requests.request(method, api.url + path, data=data, params=params, timeout=5,
                            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": content_type})


def node_event(**changes: Any) -> Event:
    fields: dict[str, Any] = {
        "metadata": ObjectMeta(generateName="node-1.", namespace="default"), "eventTime": NOW,
        "reportingController": "forewarn.io/forewarn", "reportingInstance": "forewarn-node-1",
        "action": "Cordon", "reason": "ScheduledEventReboot", "type": "Normal", "note": "Reboot at 12:15",
        "regarding": ObjectReference(apiVersion="v1", kind="Node", name="node-1")}
    fields.update(changes)
    return Event(**fields)


# --- strict validation -----------------------------------------------------------------------------

def test_a_node_patch_with_an_unknown_field_is_422_and_changes_nothing(kube: KubeApi, tmp_path: Path) -> None:
    before = kube.node("node-1")
    client = lightkube_client(kube, tmp_path)
    with pytest.raises(ApiError) as raised:
        client.patch(Node, "node-1", {"spec": {"unschedulable": True, "drained": True}})
    assert raised.value.status.code == 422
    assert raised.value.status.reason == "Invalid"
    assert raised.value.status.message.startswith('Node "node-1" is invalid: spec:')
    assert "'drained' was unexpected" in raised.value.status.message
    assert kube.node("node-1") == before


@pytest.mark.parametrize(("patch", "problem"), [
    ({"metadata": {"labels": {"forewarn.io/event": "not a label value!"}}}, "metadata.labels.forewarn.io/event"),
    ({"metadata": {"labels": {"Forewarn.IO/event": "x"}}}, "prefix part must be a lowercase RFC 1123 subdomain"),
    ({"spec": {"taints": [{"key": "forewarn.io/x", "effect": "NoRun"}]}}, 'spec.taints[0].effect: Unsupported'),
    ({"spec": {"taints": [{"key": "a", "effect": "NoSchedule"}, {"key": "a", "value": "b", "effect": "NoSchedule"}]}},
     "taints must be unique by key and effect pair"),
    ({"spec": {"unschedulable": "yes"}}, "spec.unschedulable: 'yes' is not of type 'boolean', 'null'"),
])
def test_node_writes_get_the_api_servers_field_checks(kube: KubeApi, patch: dict[str, Any], problem: str) -> None:
    answer = raw(kube, "PATCH", "/api/v1/nodes/node-1", patch, "application/merge-patch+json")
    assert answer.status_code == 422, answer.text
    assert answer.json()["kind"] == "Status" and answer.json()["reason"] == "Invalid"
    assert problem in answer.json()["message"]


def test_an_unsupported_patch_type_is_415_and_a_missing_token_401(kube: KubeApi) -> None:
    apply = raw(kube, "PATCH", "/api/v1/nodes/node-1", {"spec": {}}, "application/apply-patch+yaml")
    assert (apply.status_code, apply.json()["reason"]) == (415, "UnsupportedMediaType")
    anonymous = requests.get(kube.url + "/api/v1/nodes/node-1", timeout=5)
    assert (anonymous.status_code, anonymous.json()["reason"]) == (401, "Unauthorized")


# --- resourceVersion ------------------------------------------------------------------------------

def test_a_stale_resource_version_is_409_and_a_no_op_keeps_the_version(kube: KubeApi, tmp_path: Path) -> None:
    client = lightkube_client(kube, tmp_path)
    seen = client.get(Node, "node-2").metadata.resourceVersion
    cordoned = client.patch(Node, "node-2", {"spec": {"unschedulable": True}})
    assert int(cordoned.metadata.resourceVersion) > int(seen)
    with pytest.raises(ApiError) as raised:  # written by someone who read the node before the cordon
        client.patch(Node, "node-2", {"metadata": {"resourceVersion": seen}, "spec": {"unschedulable": False}})
    assert (raised.value.status.code, raised.value.status.reason) == (409, "Conflict")
    assert "the object has been modified" in raised.value.status.message
    assert kube.node("node-2")["spec"]["unschedulable"] is True
    again = client.patch(Node, "node-2", {"spec": {"unschedulable": True}})
    assert again.metadata.resourceVersion == cordoned.metadata.resourceVersion


# --- patch semantics -------------------------------------------------------------------------------

def test_strategic_merge_merges_conditions_by_type_and_replaces_taints(kube: KubeApi, tmp_path: Path) -> None:
    client = lightkube_client(kube, tmp_path)
    mine = {"type": "ForewarnScheduledEvent", "status": "True", "reason": "Reboot", "message": "NotBefore 12:15"}
    client.patch(Node.Status, "node-1", {"status": {"conditions": [mine]}})
    types = [c["type"] for c in kube.node("node-1")["status"]["conditions"]]
    assert types == ["MemoryPressure", "DiskPressure", "PIDPressure", "Ready", "VMEventScheduled",
                     "ForewarnScheduledEvent"]  # merged by `type`: the others stay
    client.patch(Node.Status, "node-1", {"status": {"conditions": [{"type": "ForewarnScheduledEvent",
                                                                    "status": "False"}]}})
    (updated,) = [c for c in kube.node("node-1")["status"]["conditions"] if c["type"] == "ForewarnScheduledEvent"]
    assert updated == {**mine, "status": "False"}  # the item itself merged too

    forewarn_taint = {"key": "forewarn.io/scheduled-event", "value": "Reboot", "effect": "NoSchedule"}
    client.patch(Node, "node-1", {"spec": {"taints": [forewarn_taint]}})
    assert kube.node("node-1")["spec"]["taints"] == [forewarn_taint]  # no patch strategy: the AKS taint is gone


def test_strategic_merge_directives_delete_an_item_and_keys(kube: KubeApi, tmp_path: Path) -> None:
    client = lightkube_client(kube, tmp_path)
    client.patch(Node.Status, "node-1",
                 {"status": {"conditions": [{"type": "VMEventScheduled", "$patch": "delete"}]}})
    client.patch(Node, "node-1", {"metadata": {"labels": {"kubernetes.io/os": None, "forewarn.io/cordoned": "yes"}}})
    node = kube.node("node-1")
    assert "VMEventScheduled" not in [c["type"] for c in node["status"]["conditions"]]
    assert node["metadata"]["labels"] == {"kubernetes.io/hostname": "node-1", "forewarn.io/cordoned": "yes"}


def test_a_merge_patch_replaces_lists_and_null_deletes(kube: KubeApi, tmp_path: Path) -> None:
    client = lightkube_client(kube, tmp_path)
    mine = {"type": "ForewarnScheduledEvent", "status": "True", "reason": "Reboot", "message": "x"}
    client.patch(Node.Status, "node-1", {"status": {"conditions": [mine]}}, patch_type=PatchType.MERGE)
    assert kube.node("node-1")["status"]["conditions"] == [mine]  # RFC 7386: NPD's condition is lost
    client.patch(Node, "node-1", {"metadata": {"annotations": {"forewarn.io/applied": "{}"}}},
                 patch_type=PatchType.MERGE)
    client.patch(Node, "node-1", {"metadata": {"annotations": {"forewarn.io/applied": None}}},
                 patch_type=PatchType.MERGE)
    assert "forewarn.io/applied" not in kube.node("node-1")["metadata"].get("annotations", {})


def test_a_status_patch_changes_only_status_and_a_node_patch_never_status(kube: KubeApi, tmp_path: Path) -> None:
    client = lightkube_client(kube, tmp_path)
    client.patch(Node.Status, "node-2", {"spec": {"unschedulable": True},
                                         "status": {"conditions": [{"type": "X", "status": "True"}]}})
    client.patch(Node, "node-2", {"status": {"conditions": [{"type": "Y", "status": "True"}]}})
    node = kube.node("node-2")
    assert "unschedulable" not in node["spec"]
    assert [c["type"] for c in node["status"]["conditions"]][-1] == "X"


def test_a_json_patch_test_operation_guards_the_change(kube: KubeApi) -> None:
    version = kube.node("node-2")["metadata"]["resourceVersion"]
    guarded = [{"op": "test", "path": "/metadata/resourceVersion", "value": version},
               {"op": "add", "path": "/spec/unschedulable", "value": True},
               {"op": "add", "path": "/metadata/labels/forewarn.io~1cordoned", "value": "true"}]
    assert raw(kube, "PATCH", "/api/v1/nodes/node-2", guarded, "application/json-patch+json").status_code == 200
    node = kube.node("node-2")
    assert node["spec"]["unschedulable"] is True and node["metadata"]["labels"]["forewarn.io/cordoned"] == "true"
    stale = raw(kube, "PATCH", "/api/v1/nodes/node-2", [guarded[0], {"op": "remove", "path": "/spec/unschedulable"}],
                "application/json-patch+json")
    assert stale.status_code == 422
    assert stale.json()["message"] == "testing value /metadata/resourceVersion failed: test failed"
    assert kube.node("node-2") == node


def test_dry_run_validates_and_stores_nothing(kube: KubeApi, tmp_path: Path) -> None:
    client = lightkube_client(kube, tmp_path)
    before = kube.node("node-2")
    answer = client.patch(Node, "node-2", {"spec": {"unschedulable": True}}, dry_run=True)
    assert answer.spec.unschedulable is True
    assert kube.node("node-2") == before
    with pytest.raises(ApiError) as raised:
        client.patch(Node, "node-2", {"spec": {"unschedulable": 1}}, dry_run=True)
    assert raised.value.status.code == 422
    client.create(node_event(), dry_run=True)
    assert kube.events() == []
    assert [r.query.get("dryRun") for r in kube.requests if r.method != "GET"] == ["All", "All", "All"]


# --- RBAC --------------------------------------------------------------------------------------------

def test_the_cluster_role_decides_403(tmp_path: Path) -> None:
    role = tmp_path / "rbac.yaml"
    role.write_text(CLUSTER_ROLE)
    with KubeApi(cluster_role=role) as api:
        api.add_node("node-1")
        api.add_pod("default", "web-1", "node-1")
        client = lightkube_client(api, tmp_path)
        client.patch(Node, "node-1", {"spec": {"unschedulable": True}})  # granted
        assert [p.metadata.name for p in client.list(Pod, namespace="*", fields={"spec.nodeName": "node-1"})] == [
            "web-1"]

        def forbidden(call: Any) -> str:
            with pytest.raises(ApiError) as raised:
                call()
            assert (raised.value.status.code, raised.value.status.reason) == (403, "Forbidden")
            return str(raised.value.status.message)

        assert forbidden(lambda: client.delete(Node, "node-1")) == (
            'nodes "node-1" is forbidden: User "system:serviceaccount:forewarn:forewarn" cannot delete resource '
            '"nodes" in API group "" at the cluster scope')
        assert 'cannot patch resource "nodes/status"' in forbidden(   # a subresource is granted on its own
            lambda: client.patch(Node.Status, "node-1", {"status": {"conditions": []}}))
        assert 'cannot delete resource "pods" in API group "" in the namespace "default"' in forbidden(
            lambda: client.delete(Pod, "web-1", namespace="default"))
        lease = Lease(metadata=ObjectMeta(name="forewarn-drain-cap", namespace="forewarn"),
                      spec=LeaseSpec(holderIdentity="node-1", leaseDurationSeconds=60))
        assert 'cannot create resource "leases" in API group "coordination.k8s.io"' in forbidden(
            lambda: client.create(lease))  # the Role names the lease, and create has no name to match
        with pytest.raises(ApiError) as missing:  # get is granted on that name: the answer is the real one
            client.get(Lease, "forewarn-drain-cap", namespace="forewarn")
        assert missing.value.status.code == 404
        assert "forbidden" in forbidden(lambda: client.get(Lease, "other", namespace="forewarn"))
        assert "forbidden" in forbidden(lambda: client.get(Lease, "forewarn-drain-cap", namespace="default"))
        assert api.node("node-1")["spec"]["unschedulable"] is True
        assert api.pods() != []


# --- pods, eviction and budgets ---------------------------------------------------------------------

def test_pods_of_a_node_are_listed_with_what_a_drain_needs_to_skip(kube: KubeApi, tmp_path: Path) -> None:
    kube.add_pod("kube-system", "forewarn-abcde", "node-1", owner_kind="DaemonSet")
    kube.add_pod("kube-system", "etcd-node-1", "node-1", mirror=True)
    kube.add_pod("default", "cache-0", "node-1", owner_kind="StatefulSet", local_storage=True)
    kube.add_pod("default", "web-1", "node-2", owner_kind="ReplicaSet")
    client = lightkube_client(kube, tmp_path)
    pods = {p.metadata.name: p for p in client.list(Pod, namespace="*", fields={"spec.nodeName": "node-1"})}
    assert sorted(pods) == ["cache-0", "etcd-node-1", "forewarn-abcde"]
    assert pods["forewarn-abcde"].metadata.ownerReferences[0].kind == "DaemonSet"
    assert "kubernetes.io/config.mirror" in pods["etcd-node-1"].metadata.annotations
    assert pods["etcd-node-1"].metadata.ownerReferences[0].kind == "Node"
    assert pods["cache-0"].spec.volumes[0].emptyDir is not None
    in_default = client.list(Pod, namespace="default", fields={"spec.nodeName": "node-1"})
    assert [p.metadata.name for p in in_default] == ["cache-0"]
    listed = raw(kube, "GET", "/api/v1/pods", fieldSelector="spec.nodeName=node-2").json()
    assert listed["kind"] == "PodList" and [p["metadata"]["name"] for p in listed["items"]] == ["web-1"]
    assert "kind" not in listed["items"][0]  # as the API server sends list items
    unsupported = raw(kube, "GET", "/api/v1/pods", fieldSelector="spec.priority=5")
    assert (unsupported.status_code, unsupported.json()["message"]) == (400, "field label not supported: spec.priority")


def test_an_eviction_a_budget_forbids_is_429_until_it_allows_one(kube: KubeApi, tmp_path: Path) -> None:
    kube.add_pod("default", "web-1", "node-1", labels={"app": "web"}, owner_kind="ReplicaSet", grace=30)
    kube.add_pod("default", "web-2", "node-2", labels={"app": "web"}, owner_kind="ReplicaSet")
    kube.add_pdb("default", "web-pdb", {"app": "web"}, max_unavailable=0)
    client = lightkube_client(kube, tmp_path)
    eviction = Pod.Eviction(metadata=ObjectMeta(name="web-1", namespace="default"),
                            deleteOptions=DeleteOptions(gracePeriodSeconds=10))
    with pytest.raises(ApiError) as raised:
        client.create(eviction, name="web-1", namespace="default")
    status = raised.value.status
    assert (status.code, status.reason) == (429, "TooManyRequests")
    assert status.message == "Cannot evict pod as it would violate the pod's disruption budget."
    assert status.details.causes[0].reason == "DisruptionBudget"
    assert status.details.causes[0].message == "The disruption budget web-pdb needs 2 healthy pods and has 2 currently"
    assert kube.pod("default", "web-1") is not None and kube.evictions == []

    kube.set_pdb_allowed("default", "web-pdb", 1)
    client.create(eviction, name="web-1", namespace="default")
    assert kube.evictions == [("default", "web-1", 10)]
    assert kube.pod("default", "web-1") is None
    assert kube.pdb("default", "web-pdb")["status"]["disruptionsAllowed"] == 0
    with pytest.raises(ApiError) as gone:
        client.create(eviction, name="web-1", namespace="default")
    assert gone.value.status.code == 404
    assert [r.status for r in kube.requests if r.path.endswith("/eviction")] == [429, 201, 404]


def test_an_evicted_pod_terminates_for_its_grace_period_on_the_injected_clock(tmp_path: Path) -> None:
    now = [100.0]
    with KubeApi(grace_scale=1.0, clock=lambda: now[0]) as api:
        api.add_node("node-1")
        api.add_pod("default", "web-1", "node-1", grace=30)
        answer = raw(api, "POST", "/api/v1/namespaces/default/pods/web-1/eviction",
                     {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "web-1"},
                      "deleteOptions": {"gracePeriodSeconds": 5}})
        assert answer.status_code == 201 and answer.json()["status"] == "Success"
        terminating = api.pod("default", "web-1")
        assert terminating is not None and terminating["metadata"]["deletionGracePeriodSeconds"] == 5
        now[0] = 104.9
        assert api.pod("default", "web-1") is not None
        now[0] = 105.0
        assert api.pod("default", "web-1") is None and api.pods() == []


def test_an_eviction_body_is_validated(kube: KubeApi) -> None:
    kube.add_pod("default", "web-1", "node-1")
    wrong_name = raw(kube, "POST", "/api/v1/namespaces/default/pods/web-1/eviction",
                     {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "web-2"}})
    assert (wrong_name.status_code, wrong_name.json()["message"]) == (
        400, "name in URL does not match name in Eviction object")
    unknown = raw(kube, "POST", "/api/v1/namespaces/default/pods/web-1/eviction",
                  {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "web-1"}, "gracePeriod": 5})
    assert unknown.status_code == 422
    old_api = raw(kube, "POST", "/api/v1/namespaces/default/pods/web-1/eviction",
                  {"apiVersion": "policy/v1beta1", "kind": "Eviction", "metadata": {"name": "web-1"}})
    assert old_api.status_code == 400
    assert kube.pod("default", "web-1") is not None


def test_the_official_client_sees_409_422_and_429_as_api_exceptions(kube: KubeApi, tmp_path: Path) -> None:
    kube.add_pod("default", "web-1", "node-1", labels={"app": "web"})
    kube.add_pdb("default", "web-pdb", {"app": "web"})
    api = official_client(kube, tmp_path)
    core = k8s.CoreV1Api(api)
    cordoned = core.patch_node("node-1", {"spec": {"unschedulable": True}})
    assert cordoned.spec.unschedulable is True
    assert [p.metadata.name for p in core.list_pod_for_all_namespaces(field_selector="spec.nodeName=node-1").items] \
        == ["web-1"]
    eviction = k8s.V1Eviction(metadata=k8s.V1ObjectMeta(name="web-1", namespace="default"),
                              delete_options=k8s.V1DeleteOptions(grace_period_seconds=3))
    statuses = []
    for call in (lambda: core.create_namespaced_pod_eviction("web-1", "default", eviction),
                 lambda: core.patch_node("node-1", {"spec": {"cordoned": True}}),
                 lambda: core.patch_node("node-1", {"metadata": {"resourceVersion": "1"}})):
        with pytest.raises(ApiException) as raised:
            call()
        statuses.append((raised.value.status, json.loads(raised.value.body)["reason"]))
    assert statuses == [(429, "TooManyRequests"), (422, "Invalid"), (409, "Conflict")]
    kube.set_pdb_allowed("default", "web-pdb", 1)
    core.create_namespaced_pod_eviction("web-1", "default", eviction)
    assert kube.evictions == [("default", "web-1", 3)]

    coordination = k8s.CoordinationV1Api(api)
    lease = k8s.V1Lease(metadata=k8s.V1ObjectMeta(name="cap"),
                        spec=k8s.V1LeaseSpec(holder_identity="node-1", lease_duration_seconds=30, renew_time=NOW))
    created = coordination.create_namespaced_lease("forewarn", lease)
    created.spec.holder_identity = "node-2"
    coordination.replace_namespaced_lease("cap", "forewarn", created)
    with pytest.raises(ApiException) as stale:
        coordination.replace_namespaced_lease("cap", "forewarn", created)
    assert stale.value.status == 409
    event = k8s.EventsV1Event(metadata=k8s.V1ObjectMeta(generate_name="node-1."), event_time=NOW,
                              reporting_controller="forewarn.io/forewarn", reporting_instance="forewarn-node-1",
                              action="Drain", reason="ScheduledEventReboot", type="Normal",
                              regarding=k8s.V1ObjectReference(api_version="v1", kind="Node", name="node-1"))
    k8s.EventsV1Api(api).create_namespaced_event("default", event)
    assert [e["action"] for e in kube.events()] == ["Drain"]


# --- events and leases -----------------------------------------------------------------------------

@pytest.mark.parametrize(("changes", "problem"), [
    ({"reportingController": None}, "reportingController: Required value"),
    ({"reportingController": "Forewarn Agent"}, "reportingController: Invalid value"),
    ({"action": None}, "action: Required value"),
    ({"reason": "x" * 129}, "reason: Invalid value: can have at most 128 characters"),
    ({"type": "Info"}, 'type: Invalid value: "Info"'),
    ({"regarding": None}, "regarding: Required value"),
    ({"eventTime": None}, "eventTime"),
    ({"metadata": ObjectMeta(generateName="node-1.", namespace="forewarn")},
     'involvedObject.namespace: Invalid value: "": does not match event.namespace'),
])
def test_events_are_validated_as_the_api_server_does(kube: KubeApi, tmp_path: Path, changes: dict[str, Any],
                                                     problem: str) -> None:
    client = lightkube_client(kube, tmp_path)
    with pytest.raises(ApiError) as raised:
        client.create(node_event(**changes))
    assert raised.value.status.code == 422, raised.value.status.message
    assert problem in raised.value.status.message
    assert kube.events() == []


def test_a_valid_event_is_stored(kube: KubeApi, tmp_path: Path) -> None:
    created = lightkube_client(kube, tmp_path).create(node_event())
    (stored,) = kube.events()
    assert stored["metadata"]["name"] == created.metadata.name and created.metadata.name.startswith("node-1.")
    assert stored["regarding"] == {"apiVersion": "v1", "kind": "Node", "name": "node-1"}
    assert stored["eventTime"] == "2026-03-01T12:00:00.000000Z"  # a MicroTime, as the server writes it


def test_leases_create_once_and_update_only_from_the_latest_version(kube: KubeApi, tmp_path: Path) -> None:
    client = lightkube_client(kube, tmp_path)

    def lease() -> Lease:
        return Lease(metadata=ObjectMeta(name="forewarn-drain-cap", namespace="forewarn"),
                     spec=LeaseSpec(holderIdentity="node-1", leaseDurationSeconds=60, acquireTime=NOW, renewTime=NOW))

    created = client.create(lease())
    with pytest.raises(ApiError) as exists:
        client.create(lease())
    assert (exists.value.status.code, exists.value.status.reason) == (409, "AlreadyExists")
    assert exists.value.status.message == 'leases.coordination.k8s.io "forewarn-drain-cap" already exists'
    created.spec.holderIdentity = "node-2"
    replaced = client.replace(created)
    assert replaced.spec.holderIdentity == "node-2"
    created.spec.holderIdentity = "node-3"
    with pytest.raises(ApiError) as stale:
        client.replace(created)  # still carries the version read before node-2 took it
    assert (stale.value.status.code, stale.value.status.reason) == (409, "Conflict")
    unconditional = raw(kube, "PUT", "/apis/coordination.k8s.io/v1/namespaces/forewarn/leases/forewarn-drain-cap",
                        {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                         "metadata": {"name": "forewarn-drain-cap"}, "spec": {"holderIdentity": "node-3"}})
    assert unconditional.status_code == 422  # a Lease update must name the version it replaces
    assert "metadata.resourceVersion" in unconditional.json()["message"]
    (stored,) = kube.leases()
    assert stored["spec"]["holderIdentity"] == "node-2"
    assert stored["spec"]["acquireTime"] == "2026-03-01T12:00:00.000000Z"


# --- test hooks -----------------------------------------------------------------------------------------

def test_fail_next_injects_one_failure_and_requests_are_recorded(kube: KubeApi, tmp_path: Path) -> None:
    kube.fail_next("PATCH", r"^/api/v1/nodes/node-2$", 500)
    client = lightkube_client(kube, tmp_path)
    with pytest.raises(ApiError) as raised:
        client.patch(Node, "node-2", {"spec": {"unschedulable": True}})
    assert raised.value.status.code == 500
    assert "unschedulable" not in kube.node("node-2")["spec"]
    client.patch(Node, "node-2", {"spec": {"unschedulable": True}})
    patches = [r for r in kube.requests if r.method == "PATCH"]
    assert [r.status for r in patches] == [500, 200]
    assert patches[1].json() == {"spec": {"unschedulable": True}}
    assert patches[1].query == {"fieldManager": "forewarn"}
    assert patches[1].headers["content-type"] == "application/strategic-merge-patch+json"


def test_times_are_checked_and_written_back_as_the_server_does(kube: KubeApi) -> None:
    condition = {"type": "ForewarnScheduledEvent", "status": "True",
                 "lastTransitionTime": "2026-03-01T13:00:00.5+01:00"}
    assert raw(kube, "PATCH", "/api/v1/nodes/node-2/status", {"status": {"conditions": [condition]}},
               "application/strategic-merge-patch+json").status_code == 200
    (stored,) = [c for c in kube.node("node-2")["status"]["conditions"] if c["type"] == "ForewarnScheduledEvent"]
    assert stored["lastTransitionTime"] == "2026-03-01T12:00:00Z"  # a Time: UTC, whole seconds
    bad = raw(kube, "PATCH", "/api/v1/nodes/node-2/status",
              {"status": {"conditions": [{**condition, "lastTransitionTime": "Sun, 01 Mar 2026 12:00:00 GMT"}]}},
              "application/strategic-merge-patch+json")
    assert bad.status_code == 422 and "is not a 'date-time'" in bad.json()["message"]


def test_deletes_answer_as_the_api_server_does(kube: KubeApi, tmp_path: Path) -> None:
    kube.add_pod("default", "web-1", "node-1")
    client = lightkube_client(kube, tmp_path)
    client.create(Lease(metadata=ObjectMeta(name="cap", namespace="forewarn"), spec=LeaseSpec(holderIdentity="a")))
    client.delete(Lease, "cap", namespace="forewarn")
    client.delete(Pod, "web-1", namespace="default", grace_period=0)
    assert kube.leases() == [] and kube.pods() == []
    with pytest.raises(ApiError) as gone:
        client.delete(Lease, "cap", namespace="forewarn")
    assert gone.value.status.code == 404
    assert gone.value.status.message == 'leases.coordination.k8s.io "cap" not found'


def test_node_label_selectors_and_missing_namespaces(tmp_path: Path) -> None:
    with KubeApi(namespaces=["forewarn"]) as api:
        api.add_node("node-1", labels={"agentpool": "spot", "kubernetes.azure.com/scalesetpriority": "spot"})
        api.add_node("node-2", labels={"agentpool": "system"})
        api.add_node("node-3", labels={})
        client = lightkube_client(api, tmp_path)

        def names(selector: str) -> list[str]:
            answer = raw(api, "GET", "/api/v1/nodes", labelSelector=selector)
            assert answer.status_code == 200, answer.text
            return [n["metadata"]["name"] for n in answer.json()["items"]]

        assert names("agentpool=spot") == ["node-1"]
        assert names("agentpool!=spot") == ["node-2", "node-3"]
        assert names("agentpool in (spot,system),!kubernetes.azure.com/scalesetpriority") == ["node-2"]
        assert names("agentpool") == ["node-1", "node-2"]
        assert [n.metadata.name for n in client.list(Node, labels={"agentpool": "system"})] == ["node-2"]
        assert raw(api, "GET", "/api/v1/nodes", labelSelector="agentpool in spot").status_code == 400
        assert raw(api, "GET", "/api/v1/nodes", watch="true").status_code == 400  # no watch in the stand-in

        lease = Lease(metadata=ObjectMeta(name="cap", namespace="forewarn-system"), spec=LeaseSpec())
        with pytest.raises(ApiError) as missing:
            client.create(lease)
        assert (missing.value.status.code, missing.value.status.message) == (
            404, 'namespaces "forewarn-system" not found')
        lease.metadata.namespace = "forewarn"
        client.create(lease)
        assert [le["metadata"]["namespace"] for le in api.leases()] == ["forewarn"]
