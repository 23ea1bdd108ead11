"""Undoing node actions, against the strict API stand-in (tests/peers/kube_api.py) with the real client:
forewarn's condition is removed (not left False) and nobody else's is touched; what the node still holds
from before a restart is undone once the first document is known (an undo still failing at SIGTERM, an
event that ended while forewarn was down), while an event still in the document keeps what it holds; and
the in-cluster configuration (a service account mounted as files, HTTPS with its CA).

The restart tests run `forewarn run` as a subprocess against the IMDS simulator; the others drive the
approver in-process (the Harness of test_node_actions.py). Tests wait with wait_until, never a sleep.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import requests
import yaml
from lightkube import ApiError, Client, KubeConfig
from lightkube.resources.core_v1 import Node
from lightkube.types import PatchType

from forewarn.approval.actor import ActionOutcome
from forewarn.approval.approver import UNDO_RETRY_FOR, Stage
from forewarn.approval.policy import parse_policy
from forewarn.imds.document import parse_document
from forewarn.node import KubeError, build_actor
from test_node_actions import CLUSTER_ROLE, RECORD_SCHEMA, Harness, conditions, imds_event

from conftest import CollectorProcess, SimulatorHandle, agent_ledger, sample, wait_for_polls, wait_until
from peers.kube_api import TOKEN, KubeApi
from peers.pki import Authority

CONDITION = "ForewarnScheduledEvent"
APPLIED = "forewarn.io/applied"
NPD = {"type": "VMEventScheduled", "status": "True", "reason": "VMEventScheduled",
       "message": "Reboot scheduled for 2030-01-01T00:00:00Z", "lastHeartbeatTime": "2030-01-01T00:00:00Z",
       "lastTransitionTime": "2030-01-01T00:00:00Z"}
CORDON_CONDITION = """
rules:
  - name: reboot
    match: {event_type: [Reboot]}
    node: [cordon, condition]
    action: hold
"""


@pytest.fixture
def api() -> Iterator[KubeApi]:
    server = KubeApi(cluster_role=CLUSTER_ROLE)
    yield server
    server.stop()


@pytest.fixture
def harnesses(tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def make(api: KubeApi, policy: str, **kwargs: Any) -> Harness:
        harness = Harness(api, tmp_path, policy, **kwargs)
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.close()


def ledger(api: KubeApi, node: str = "node-1") -> dict[str, Any]:
    return agent_ledger(api.node(node))


def writes(api: KubeApi) -> list[str]:
    return [f"{r.method} {r.path}" for r in api.requests if r.method not in ("GET", "HEAD")]


# --- 1. the condition is removed, and only forewarn's -----------------------------------------------

def test_the_stand_in_deletes_only_the_condition_whose_type_matches(api: KubeApi, tmp_path: Path) -> None:
    # As the API server's strategic merge: `$patch: delete` in a list merged by `type` removes the item with
    # that type, every other item stays as it was, and deleting a type that is not there changes nothing.
    api.add_node("node-1", conditions=[NPD])
    client = Client(_kubeconfig(api, tmp_path))
    mine = {"type": CONDITION, "status": "True", "reason": "RebootScheduled", "message": "E1"}
    client.patch(Node.Status, "node-1", {"status": {"conditions": [mine]}}, patch_type=PatchType.STRATEGIC)
    before = api.node("node-1")["status"]["conditions"]
    assert [c["type"] for c in before][-2:] == ["VMEventScheduled", CONDITION]
    client.patch(Node.Status, "node-1", {"status": {"conditions": [{"type": CONDITION, "$patch": "delete"}]}},
                 patch_type=PatchType.STRATEGIC)
    after = api.node("node-1")
    assert after["status"]["conditions"] == [c for c in before if c["type"] != CONDITION]
    version = after["metadata"]["resourceVersion"]
    client.patch(Node.Status, "node-1", {"status": {"conditions": [{"type": CONDITION, "$patch": "delete"}]}},
                 patch_type=PatchType.STRATEGIC)
    assert api.node("node-1") == after and api.node("node-1")["metadata"]["resourceVersion"] == version
    client.close()


def test_the_stand_in_fails_every_matching_request_until_it_recovers(api: KubeApi, tmp_path: Path) -> None:
    api.add_node("node-1")
    client = Client(_kubeconfig(api, tmp_path))
    api.fail_always("PATCH", r"^/api/v1/nodes/node-1$", 503, "etcdserver: request timed out")
    api.fail_next("GET", r"^/api/v1/nodes/node-1$", 500)
    for _ in range(3):
        with pytest.raises(ApiError) as info:
            client.patch(Node, "node-1", {"spec": {"unschedulable": True}})
        assert (info.value.status.code, info.value.status.message) == (503, "etcdserver: request timed out")
    api.recover()
    client.patch(Node, "node-1", {"spec": {"unschedulable": True}})
    assert api.node("node-1")["spec"]["unschedulable"] is True
    with pytest.raises(ApiError):  # recover() ends fail_always only; fail_next stays queued
        client.get(Node, "node-1")
    assert [r.status for r in api.requests] == [503, 503, 503, 200, 500]
    client.close()


def test_the_stand_in_serves_https_with_its_ca_in_the_kubeconfig(tls_api: KubeApi, tmp_path: Path) -> None:
    tls_api.add_node("node-1")
    config = yaml.safe_load(tls_api.kubeconfig(tmp_path / "kubeconfig").read_text())
    cluster = config["clusters"][0]["cluster"]
    assert cluster["server"] == f"https://127.0.0.1:{tls_api.port}" and tls_api.ca_pem is not None
    assert base64.b64decode(cluster["certificate-authority-data"]) == tls_api.ca_pem
    actor = build_actor("node-1", str(tmp_path / "kubeconfig"))
    try:
        assert actor.get_node()["metadata"]["name"] == "node-1"
    finally:
        actor.close()
    with pytest.raises(requests.exceptions.SSLError):  # not trusted without that CA
        requests.get(f"{tls_api.url}/api/v1/nodes/node-1", timeout=5)
    account = tls_api.service_account(tmp_path / "sa")
    assert sorted(p.name for p in account.iterdir()) == ["ca.crt", "namespace", "token"]
    assert (account / "namespace").read_text() == "forewarn" and (account / "token").read_text() == TOKEN
    with KubeApi() as plain, pytest.raises(ValueError, match="tls=True"):
        plain.service_account(tmp_path / "plain")


def _kubeconfig(api: KubeApi, tmp_path: Path) -> KubeConfig:
    return KubeConfig.from_file(api.kubeconfig(tmp_path / "kubeconfig-admin", admin=True))


def test_undo_removes_forewarns_condition_and_leaves_npd_and_the_kubelet_alone(
        api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    api.add_node("node-1", conditions=[NPD])
    others = {kind: c for kind, c in conditions(api.node("node-1")).items()}
    h = harnesses(api, CORDON_CONDITION)
    h.poll(imds_event())
    wait_until(lambda: h.approver.stage("E1") is Stage.ACTED, timeout=10, message="the actions")
    assert conditions(api.node("node-1"))[CONDITION]["status"] == "True"
    h.poll()  # the event ends
    h.settle()
    node = api.node("node-1")
    assert CONDITION not in conditions(node)
    assert conditions(node) == others  # NPD's VMEventScheduled, Ready and the rest exactly as they were
    assert not node["spec"].get("unschedulable") and ledger(api) == {}
    assert "removed condition ForewarnScheduledEvent" in h.detail("undo") and h.actions()[-1] == ("undo", "ok")
    for record in h.records:
        jsonschema.validate(record, RECORD_SCHEMA)


def test_a_condition_two_events_hold_stays_until_the_last_one_ends(
        api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    api.add_node("node-1")
    h = harnesses(api, CORDON_CONDITION)
    h.poll(imds_event("E1"), imds_event("E2"))
    wait_until(lambda: h.approver.stage("E1") is Stage.ACTED and h.approver.stage("E2") is Stage.ACTED,
               timeout=10, message="the actions of both events")
    assert set(ledger(api)) == {"E1", "E2"}
    h.poll(imds_event("E2"))  # E1 ends; E2 still holds the cordon and the condition
    h.settle()
    node = api.node("node-1")
    assert conditions(node)[CONDITION]["status"] == "True" and node["spec"]["unschedulable"] is True
    assert set(ledger(api)) == {"E2"}
    h.poll()
    h.settle()
    node = api.node("node-1")
    assert CONDITION not in conditions(node) and not node["spec"].get("unschedulable") and ledger(api) == {}


def test_a_failed_condition_removal_keeps_the_ledger_entry_so_the_retry_removes_it(
        api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    api.add_node("node-1")
    h = harnesses(api, CORDON_CONDITION)
    h.poll(imds_event())
    wait_until(lambda: h.approver.stage("E1") is Stage.ACTED, timeout=10)
    api.fail_next("PATCH", r"^/api/v1/nodes/node-1/status$", 503, "etcdserver: request timed out")
    h.poll()
    wait_until(lambda: ("undo", "failed") in h.actions(), timeout=10, message="the failed undo")
    assert "E1" in ledger(api), "nothing forgotten while the condition is still there"

    def undone() -> bool:
        h.poll()
        return CONDITION not in conditions(api.node("node-1"))

    wait_until(undone, timeout=10, message="the undo tried again")
    h.settle()
    assert ledger(api) == {} and not api.node("node-1")["spec"].get("unschedulable")
    assert h.actions()[-2:] == [("undo", "failed"), ("undo", "ok")]


# --- 2. what the node holds from before a restart -----------------------------------------------------

def test_a_restart_undoes_what_the_node_holds_for_events_no_longer_in_the_document(
        api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    api.add_node("node-1", conditions=[NPD])
    first = harnesses(api, CORDON_CONDITION)
    first.poll(imds_event("E1"), imds_event("E2"))
    wait_until(lambda: first.approver.stage("E1") is Stage.ACTED and first.approver.stage("E2") is Stage.ACTED,
               timeout=10)
    first.close()
    # A new instance whose first document has E2 only: E1 ended while it was down and no saved state says so.
    second = harnesses(api, CORDON_CONDITION)
    second.poll(imds_event("E2"))
    wait_until(lambda: set(ledger(api)) == {"E2"}, timeout=10, message="E1's entry undone")
    second.settle()
    node = api.node("node-1")
    assert node["spec"]["unschedulable"] is True and conditions(node)[CONDITION]["status"] == "True"  # E2's
    undo = [r for r in second.records if r["data"]["action"] == "undo"]
    assert [(r["subject"], r["data"]["result"]) for r in undo] == [("E1", "ok")]
    assert undo[0]["data"]["affects_this_vm"] is True and undo[0]["data"]["event"]["EventId"] == "E1"
    for record in second.records:
        jsonschema.validate(record, RECORD_SCHEMA)
    second.poll()  # E2 ends as well: now everything goes
    second.settle()
    node = api.node("node-1")
    assert ledger(api) == {} and not node["spec"].get("unschedulable") and CONDITION not in conditions(node)
    assert conditions(node)["VMEventScheduled"] == NPD
    assert second.counter("undo", "ok") == 2


def test_reading_the_node_at_start_is_tried_again_when_the_api_fails(
        api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    api.add_node("node-1", unschedulable=True, annotations={APPLIED: json.dumps({"OLD": {"cordon": True}})})
    api.fail_next("GET", r"^/api/v1/nodes/node-1$", 503, "etcdserver: leader changed")
    h = harnesses(api, CORDON_CONDITION)

    def undone() -> bool:
        h.poll()  # every poll may try again, once its backoff has passed
        return not api.node("node-1")["spec"].get("unschedulable")

    wait_until(undone, timeout=10, message="the second look at the node")
    h.settle()
    assert ledger(api) == {} and h.actions() == [("undo", "ok")]
    assert next(r.status for r in api.requests if r.method == "GET") == 503


def test_reading_the_node_at_start_is_given_up_after_undo_retry_for(
        api: KubeApi, harnesses: Callable[..., Harness], caplog: pytest.LogCaptureFixture) -> None:
    api.add_node("node-1", unschedulable=True, annotations={APPLIED: json.dumps({"OLD": {"cordon": True}})})
    api.fail_always("GET", r"^/api/v1/nodes/node-1$", 503, "etcdserver: leader changed")
    h = harnesses(api, CORDON_CONDITION)
    now = [1000.0]
    h.approver.clock = lambda: now[0]
    h.poll()
    h.settle()
    assert "trying again" in caplog.text
    now[0] += UNDO_RETRY_FOR  # the next try would be past the hour: the last one
    h.poll()
    h.settle()
    assert "giving up" in caplog.text
    api.recover()
    gets = len(api.requests)
    for _ in range(3):
        now[0] += 60
        h.poll()
    h.settle()
    assert len(api.requests) == gets, "not read again in this run"
    assert api.node("node-1")["spec"]["unschedulable"] is True and h.actions() == []


def test_at_a_restart_in_dry_run_the_undo_is_recorded_and_nothing_written(
        api: KubeApi, harnesses: Callable[..., Harness]) -> None:
    api.add_node("node-1", unschedulable=True, annotations={APPLIED: json.dumps({"OLD": {"cordon": True}})})
    h = harnesses(api, CORDON_CONDITION, dry_run=True)
    h.poll()
    wait_until(lambda: h.actions(), timeout=10, message="the dry-run undo")
    for _ in range(3):
        h.poll()  # once per start: not again at later polls
    h.settle()
    assert writes(api) == [] and api.node("node-1")["spec"]["unschedulable"] is True
    assert h.actions() == [("undo", "dry_run")] and "uncordoned" in h.detail("undo")
    assert h.counter("undo", "dry_run") == 1


def _restart_setup(api: KubeApi, tmp_path: Path, simulator: Callable[..., SimulatorHandle],
                   ) -> tuple[SimulatorHandle, list[str]]:
    api.add_node("node-1", conditions=[NPD])
    sim = simulator({"vm_name": "vm-1", "vms": ["vm-1"],
                     "events": [{"id": "E1", "type": "Reboot", "notice": 3600, "run_for": 60}]})
    policy = tmp_path / "policy.yaml"
    policy.write_text(CORDON_CONDITION)
    args = ["--policy", str(policy), "--node-name", "node-1", "--kubeconfig",
            str(api.kubeconfig(tmp_path / "kubeconfig", namespace="forewarn"))]
    return sim, args


def _acted(api: KubeApi) -> bool:
    node = api.node("node-1")
    return bool(node["spec"].get("unschedulable")) and conditions(node).get(CONDITION, {}).get("status") == "True" \
        and "condition" in ledger(api).get("E1", {})


def _assert_undone(api: KubeApi, others: dict[str, dict[str, Any]]) -> None:
    node = api.node("node-1")
    assert not node["spec"].get("unschedulable")
    assert APPLIED not in node["metadata"].get("annotations", {})
    assert conditions(node) == others, "forewarn's condition gone, everyone else's as it was"


def _undos(proc: CollectorProcess) -> float | None:
    return sample(proc.metrics(), "azure_scheduled_events_node_actions_total", action="undo", result="ok")


@pytest.mark.slow
def test_an_undo_failing_at_sigterm_is_done_after_the_restart(
        tmp_path: Path, api: KubeApi, simulator: Callable[..., SimulatorHandle],
        collector: Callable[..., CollectorProcess]) -> None:
    sim, args = _restart_setup(api, tmp_path, simulator)
    others = conditions(api.node("node-1"))
    first = collector(sim.url, *args)
    wait_until(lambda: _acted(api), timeout=20, message="the cordon and the condition")
    api.fail_always("PATCH", r"^/api/v1/nodes/node-1(/status)?$", 503, "etcdserver: request timed out")
    assert sim.sim.remove("E1")  # cancelled: forewarn tries the undo, and the API refuses it
    wait_until(lambda: (sample(first.metrics(), "azure_scheduled_events_node_actions_total", action="undo",
                               result="failed") or 0) >= 1, timeout=20, message="a failed undo")
    wait_for_polls(first, 2)  # the removal is in the saved state: the next start has no change to go by
    assert first.stop() == 0
    assert _acted(api), "still as forewarn left it"
    api.recover()
    second = collector(sim.url, *args)
    wait_until(lambda: not api.node("node-1")["spec"].get("unschedulable"), timeout=20, message="the uncordon")
    wait_until(lambda: _undos(second) == 1, timeout=10, message="the undo counted")
    _assert_undone(api, others)
    wait_until(lambda: [(r["subject"], r["data"]["result"]) for r in second.records()
                        if r["data"].get("action") == "undo"][-1:] == [("E1", "ok")], timeout=10,
               message="the undo record")
    wait_for_polls(second, 2)
    assert _undos(second) == 1, "once"
    assert "Traceback" not in first.log() + second.log()
    for record in second.records():
        jsonschema.validate(record, RECORD_SCHEMA)


@pytest.mark.slow
@pytest.mark.parametrize("state", ["kept", "lost"])
def test_an_event_that_ended_while_forewarn_was_killed_is_undone_at_the_restart(
        state: str, tmp_path: Path, api: KubeApi, simulator: Callable[..., SimulatorHandle],
        collector: Callable[..., CollectorProcess]) -> None:
    # kept: the saved document still has the event, so the restart sees it leave; lost: the state dir is
    # gone (a new pod on an emptyDir), so only the node's annotation remembers.
    sim, args = _restart_setup(api, tmp_path, simulator)
    others = conditions(api.node("node-1"))
    first = collector(sim.url, *args)
    wait_until(lambda: _acted(api), timeout=20, message="the cordon and the condition")
    first.kill()
    assert sim.sim.remove("E1")
    second = collector(sim.url, *args, name="state" if state == "kept" else "new-pod")
    wait_until(lambda: not api.node("node-1")["spec"].get("unschedulable"), timeout=20, message="the uncordon")
    wait_until(lambda: _undos(second) == 1, timeout=10, message="the undo counted")
    _assert_undone(api, others)
    wait_for_polls(second, 2)
    assert _undos(second) == 1 and "Traceback" not in second.log()


@pytest.mark.slow
def test_at_a_restart_an_event_still_in_the_document_keeps_what_it_holds(
        tmp_path: Path, api: KubeApi, simulator: Callable[..., SimulatorHandle],
        collector: Callable[..., CollectorProcess]) -> None:
    sim, args = _restart_setup(api, tmp_path, simulator)
    first = collector(sim.url, *args)
    wait_until(lambda: _acted(api), timeout=20, message="the cordon and the condition")
    assert first.stop() == 0
    # Left over from long ago as well, by a version before owners (a legacy entry, keyed by the bare event id,
    # which the per-VM agent adopts): a label of an event that is in no document any more.
    raw = json.loads(api.node("node-1")["metadata"]["annotations"][APPLIED])
    held = ledger(api)["E1"]
    api.update_node("node-1", lambda node: (
        node["metadata"]["labels"].update({"forewarn.io/scheduled-event": "Freeze"}),
        node["metadata"]["annotations"].update(
            {APPLIED: json.dumps({**raw, "OLD": {"labels": ["forewarn.io/scheduled-event"]}})})))
    second = collector(sim.url, *args)
    wait_until(lambda: "OLD" not in json.loads(api.node("node-1")["metadata"]["annotations"][APPLIED]), timeout=20,
               message="the old entry undone")
    wait_for_polls(second, 3)
    node = api.node("node-1")
    assert ledger(api) == {"E1": held}, "E1 is still in the document: nothing of it undone"
    assert node["spec"]["unschedulable"] is True and conditions(node)[CONDITION]["status"] == "True"
    assert "forewarn.io/scheduled-event" not in node["metadata"]["labels"]
    undo = [(r["subject"], r["data"]["result"]) for r in second.records() if r["data"].get("action") == "undo"]
    assert undo == [("OLD", "ok")]
    assert _undos(second) == 1


# --- 3. in-cluster: the pod's service account ---------------------------------------------------------

@pytest.fixture
def tls_api() -> Iterator[KubeApi]:
    server = KubeApi(cluster_role=CLUSTER_ROLE, tls=True)
    yield server
    server.stop()


@pytest.fixture
def in_cluster(tls_api: KubeApi, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> KubeApi:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(tls_api.port))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.kube/config to fall back on
    tls_api.add_node("node-1")
    return tls_api


def test_in_cluster_the_service_account_is_used_over_https(in_cluster: KubeApi, tmp_path: Path) -> None:
    api = in_cluster
    account = api.service_account(tmp_path / "serviceaccount")
    assert api.url.startswith("https://")
    actor = build_actor("node-1", None, service_account=account)
    try:
        outcomes: list[ActionOutcome] = []
        (event,) = parse_document({"DocumentIncarnation": 1, "Events": [imds_event()]}).events
        assert actor.act(parse_policy(CORDON_CONDITION).rules[0].node[:1], event, False, outcomes.append)
        assert api.node("node-1")["spec"]["unschedulable"] is True and outcomes[0].result == "ok"
        assert {r.headers["authorization"] for r in api.requests} == {f"Bearer {TOKEN}"}
        # RBAC applies to that token: the ClusterRole grants nodes get and patch, not list.
        with pytest.raises(ApiError) as info:
            next(iter(actor.client.list(Node)))
        assert info.value.status.code == 403 and api.requests[-1].status == 403
    finally:
        actor.close()


def test_in_cluster_with_the_wrong_ca_is_a_clear_error_naming_the_api(in_cluster: KubeApi, tmp_path: Path) -> None:
    api = in_cluster
    account = api.service_account(tmp_path / "serviceaccount")
    (account / "ca.crt").write_bytes(Authority("someone-else").pem)
    actor = build_actor("node-1", None, service_account=account)
    try:
        with pytest.raises(KubeError) as info:
            actor.get_node()
    finally:
        actor.close()
    message = str(info.value)
    assert message.startswith(f"get node node-1: cannot reach the Kubernetes API at https://127.0.0.1:{api.port} ")
    assert "CERTIFICATE_VERIFY_FAILED" in message and TOKEN not in message
    assert api.requests == [], "nothing reached the API"


def test_in_cluster_without_a_token_and_no_kubeconfig_names_the_option(in_cluster: KubeApi, tmp_path: Path) -> None:
    account = in_cluster.service_account(tmp_path / "serviceaccount")
    (account / "token").unlink()
    with pytest.raises(KubeError) as info:
        build_actor("node-1", None, service_account=account)
    message = str(info.value)
    assert message.startswith("--kubeconfig not given and no Kubernetes configuration found: no in-cluster service "
                              f"account ({account}/token")
    assert "pass --kubeconfig FILE" in message
