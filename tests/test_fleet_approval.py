"""Approving the fleet's events: the policy's fleet mode (place keys, what only one mode can mean) and the
FleetApprover deciding and acknowledging through the real Acknowledger against the strict ARM stand-in."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from azure.core.credentials import AccessToken

from forewarn.approval.policy import Place, PolicyError, decide, parse_policy
from forewarn.fleet.acknowledge import Acknowledger
from forewarn.fleet.approval import FleetApprover, place_of
from forewarn.fleet.feed import FleetEvent
from forewarn.fleet.metrics import FleetMetrics
from forewarn.fleet.tracker import FleetView
from forewarn.imds.document import Event
from forewarn.records import Record

from conftest import wait_until
from peers.arm import ArmPeer
from peers.pki import Authority

SUB = str(uuid.UUID(int=11))
RG = "MC_rg-aks_cluster_westeurope"
VMSS = f"/subscriptions/{SUB}/resourceGroups/{RG}/providers/Microsoft.Compute/virtualMachineScaleSets/aks-pool"
VM = f"/subscriptions/{SUB}/resourceGroups/rg-web/providers/Microsoft.Compute/virtualMachines/web-1"
NOW = 1_800_000_000.0

FLEET_POLICY = f"""
rules:
  - name: web-reboots
    action: approve
    match: {{event_type: [Reboot], vm: ["web-*"], resource_group: [RG-WEB]}}
  - name: aks-pools
    action: approve
    delay: 30
    match: {{subscription: ["{SUB.upper()}"], scale_set: ["aks-*"]}}
"""


def event_at(target: str, n: int, resources: tuple[str, ...], event_type: str = "Reboot",
             status: str = "Scheduled") -> FleetEvent:
    event_id = str(uuid.UUID(int=70_000 + n))
    not_before = datetime.fromtimestamp(NOW, tz=timezone.utc) + timedelta(minutes=15)
    raw = {"EventId": event_id, "EventType": event_type, "EventStatus": status, "ResourceType": "VirtualMachine",
           "Resources": list(resources), "NotBefore": not_before.strftime("%a, %d %b %Y %H:%M:%S GMT"),
           "Description": "", "EventSource": "Platform", "DurationInSeconds": -1}
    event = Event(event_id, event_type, status, "VirtualMachine", resources, not_before, "", "Platform", -1, raw=raw)
    group = target.split("/resourceGroups/")[1].split("/")[0]
    return FleetEvent(target, SUB, group, event, "resourcegraph", location="westeurope")


def test_fleet_keys_match_where_the_event_is_and_every_vm_it_releases() -> None:
    policy = parse_policy(FLEET_POLICY, fleet=True)
    web = event_at(VM, 1, ("web-1",))
    assert place_of(web) == Place(SUB, "rg-web", "", ("web-1",))
    decision = decide(policy, web.event, None, NOW, NOW, place_of(web))
    assert (decision.action, decision.rule and decision.rule.name) == ("approve", "web-reboots")
    pool = event_at(VMSS, 2, ("aks-pool_0", "aks-pool_3"))
    assert place_of(pool).scale_set == "aks-pool"
    decision = decide(policy, pool.event, None, NOW, NOW, place_of(pool))
    assert decision.rule is not None and decision.rule.name == "aks-pools" and decision.earliest == NOW + 30
    # a rule's vm patterns must cover every VM in Resources: an approval releases all of them
    avset = f"/subscriptions/{SUB}/resourceGroups/rg-web/providers/Microsoft.Compute/availabilitySets/web"
    assert decide(policy, event_at(avset, 4, ("web-1", "web-2")).event, None, NOW, NOW,
                  place_of(event_at(avset, 4, ("web-1", "web-2")))).action == "approve"
    mixed = event_at(avset, 5, ("web-1", "db-1"))
    decision = decide(policy, mixed.event, None, NOW, NOW, place_of(mixed))
    assert decision.action == "hold" and "VM db-1 in Resources matches none" in " ".join(decision.skipped)
    other = replace(pool, subscription_id=str(uuid.UUID(int=12)))
    assert decide(policy, other.event, None, NOW, NOW, place_of(other)).action == "hold"


@pytest.mark.parametrize(("text", "fleet", "message"), [
    ("rules: [{name: a, action: approve, match: {affects_this_vm: true}}]", True,
     "rules[0].match.affects_this_vm: forewarn fleet is none of the VMs"),
    ("leader: {mode: first}\nrules: [{name: a, action: approve}]", True, "there is no leader"),
    ("rules: [{name: a, action: approve, match: {vm: [web-*]}}]", False, "matches only in forewarn fleet"),
    ("rules: [{name: a, action: approve, match: {subscription: [not-a-guid]}}]", True, "subscription"),
])
def test_what_only_one_mode_can_mean_is_refused_with_the_field(text: str, fleet: bool, message: str) -> None:
    with pytest.raises(PolicyError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_policy(text, "policy.yaml", fleet=fleet)


# --- the approver, through the real Acknowledger -------------------------------------------------------------

class FixedToken:
    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        return AccessToken("ack-token", 2_000_000_000)


@pytest.fixture
def arm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ArmPeer]:
    authority = Authority("approval-test-ca")
    bundle = tmp_path / "ca.pem"
    bundle.write_bytes(authority.pem)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(bundle))
    peer = ArmPeer(authority, token="ack-token")
    yield peer
    peer.stop()


def serve(arm: ArmPeer, *events: FleetEvent) -> None:
    arm.rows = [{"id": f"{e.resource_id}/providers/Microsoft.Maintenance/scheduledevents/{e.event.event_id}",
                 "name": e.event.event_id, "subscriptionId": SUB} for e in events]


class Harness:
    def __init__(self, arm: ArmPeer, policy_text: str, dry_run: bool = False) -> None:
        self.events: list[FleetEvent] = []
        self.records: list[Record] = []
        self.now = NOW
        self.metrics = FleetMetrics(["resourcegraph"])
        self.approver = FleetApprover(parse_policy(policy_text, fleet=True), Acknowledger(arm.base, FixedToken()),
                                      self.view, self.records.extend, self.metrics.approvals,
                                      dry_run=dry_run, clock=lambda: self.now)

    def view(self) -> FleetView:
        """In these tests an event leaves the open events only by ending (as a final status does)."""
        events = tuple(self.events)
        open_ids = {event.event.event_id.lower() for event in events}
        return FleetView(events, ended=lambda event_id: event_id.lower() not in open_ids)

    def step(self, seconds: float = 0.0) -> None:
        self.now += seconds
        self.approver.step(threading.Event())
        assert self.approver.wait_idle(30)

    def approved(self, result: str = "approved") -> float:
        return sum(self.metrics.approvals.labels(t, result).value for t in ("Reboot", "Freeze"))


def test_events_are_acknowledged_once_by_rule_with_a_record_per_vm(arm: ArmPeer) -> None:
    web, pool = event_at(VM, 1, ("web-1",)), event_at(VMSS, 2, ("aks-pool_0", "aks-pool_3"))
    held = event_at(VM, 3, ("web-1",), event_type="Freeze")          # no rule matches a Freeze
    serve(arm, web, pool, held)
    harness = Harness(arm, FLEET_POLICY)
    harness.events = [web, pool, held]
    harness.step()
    assert [(target, event) for target, event, _, _ in arm.received.acks] == [(VM.lower(), web.event.event_id)]
    harness.step(29)
    assert len(arm.received.acks) == 1                               # the pool's rule waits 30 s
    harness.step(1)
    harness.step(5)
    assert [event for _, event, _, _ in arm.received.acks] == [web.event.event_id, pool.event.event_id]
    assert [(r.data["vm"]["name"], r.data["policy_rule"], r.data["dry_run"]) for r in harness.records] == [
        ("web-1", "web-reboots", False), ("aks-pool_0", "aks-pools", False), ("aks-pool_3", "aks-pools", False)]
    assert harness.approved() == 2 and not arm.received.errors


def test_a_dry_run_decides_and_records_but_sends_nothing(arm: ArmPeer) -> None:
    web = event_at(VM, 1, ("web-1",))
    serve(arm, web)
    harness = Harness(arm, FLEET_POLICY, dry_run=True)
    harness.events = [web]
    harness.step()
    harness.step(60)
    assert arm.received.acks == [] and arm.received.ack_statuses == []
    assert [(r.data["policy_rule"], r.data["dry_run"]) for r in harness.records] == [("web-reboots", True)]
    assert harness.approved("dry_run") == 1


def test_a_failed_acknowledgement_is_tried_again_and_a_refused_one_is_not(arm: ArmPeer) -> None:
    web, gone = event_at(VM, 1, ("web-1",)), event_at(VM, 9, ("web-1",))
    serve(arm, web)                                                  # `gone` is unknown to ARM: 404
    arm.ack_faults.fail, arm.ack_faults.fail_retry_after = 5, "0"
    harness = Harness(arm, FLEET_POLICY)
    harness.approver.acknowledger = Acknowledger(arm.base, FixedToken(), attempts=2)
    harness.events = [web]
    harness.step()
    assert arm.received.acks == [] and harness.approved("failed") == 1 and harness.records == []
    arm.ack_faults.fail = 0
    harness.step(120)                                                # after the backoff
    assert [event for _, event, _, _ in arm.received.acks] == [web.event.event_id]
    harness.events = [web, gone]
    harness.step(5)
    harness.step(300)
    assert arm.received.ack_statuses.count(404) == 1                 # refused for good: asked once
    assert [r.data["event"]["EventId"] for r in harness.records] == [web.event.event_id]


def test_policy_check_and_explain_in_fleet_mode(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    policy = tmp_path / "fleet-policy.yaml"
    policy.write_text(FLEET_POLICY)
    rows = tmp_path / "rows.json"
    web = {"id": f"{VM}/providers/Microsoft.Maintenance/scheduledevents/{uuid.UUID(int=1)}",
           "name": str(uuid.UUID(int=1)), "subscriptionId": SUB, "resourceGroup": "rg-web",
           "properties": {"EventId": str(uuid.UUID(int=1)), "EventType": "Reboot", "EventStatus": "Scheduled",
                          "ResourceType": "VirtualMachine", "Resources": ["web-1"], "NotBefore": "",
                          "EventSource": "Platform"}}
    freeze = json.loads(json.dumps(web).replace(str(uuid.UUID(int=1)), str(uuid.UUID(int=2))))
    freeze["properties"]["EventType"] = "Freeze"
    rows.write_text(json.dumps({"data": [web, freeze, {"id": "nonsense"}]}))

    def forewarn(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "forewarn", "policy", *args], capture_output=True, text=True,
                              timeout=60)

    checked = forewarn("check", "--fleet", str(policy))
    assert checked.returncode == 0 and "OK (2 rule(s), fleet mode)" in checked.stdout
    refused = forewarn("check", str(policy))          # the fleet keys mean nothing to the per-VM agent
    assert refused.returncode == 2 and "matches only in forewarn fleet" in refused.stderr
    explained = forewarn("explain", "--fleet", str(policy), "--rows", str(rows))
    assert explained.returncode == 0, explained.stderr
    blocks = explained.stdout.split("\n\n")
    assert "row 2: skipped" in explained.stdout
    web_block = next(block for block in blocks if str(uuid.UUID(int=1)) in block)
    assert "subscription " + SUB in web_block and "VMs web-1" in web_block
    assert "matched  web-reboots" in web_block and "decision APPROVE" in web_block
    freeze_block = next(block for block in blocks if str(uuid.UUID(int=2)) in block)
    assert "matched  (no rule)" in freeze_block and "decision HOLD" in freeze_block


def test_rollout_limits_events_in_progress_per_group_and_fleet_wide_and_staggers_them(arm: ArmPeer) -> None:
    a, b = event_at(VMSS, 11, ("aks-pool_0",)), event_at(VMSS, 12, ("aks-pool_1",))   # one scale set
    web, db = event_at(VM, 13, ("web-1",)), event_at(VM.replace("web-1", "web-2"), 14, ("web-2",))
    serve(arm, a, b, web, db)
    harness = Harness(arm, "rollout: {max_in_progress: 2, max_in_progress_per_group: 1, stagger: 10}\n"
                           "rules: [{name: all, action: approve, match: {event_type: [Reboot]}}]\n")
    harness.events = [a, b, web, db]

    def acked() -> list[str]:
        return [event for _, event, _, _ in arm.received.acks]

    harness.step()
    assert acked() == [a.event.event_id]                          # b waits for its scale set; the VMs for stagger
    harness.step(5)
    assert acked() == [a.event.event_id]
    harness.step(5)
    assert len(acked()) == 2 and acked()[1] in (web.event.event_id, db.event.event_id)
    harness.step(20)
    assert len(acked()) == 2                                      # two in progress: the fleet's limit
    harness.events = [b, web, db]                                 # a ended
    harness.step(1)
    assert len(acked()) == 3 and acked()[2] in (b.event.event_id, web.event.event_id, db.event.event_id)
    assert len(set(acked())) == 3


def test_rollout_is_refused_outside_fleet_mode() -> None:
    with pytest.raises(PolicyError, match="rollout: applies only in forewarn fleet"):
        parse_policy("rollout: {stagger: 5}\nrules: [{name: a, action: hold}]\n", "p.yaml")


def test_prepare_hooks_run_once_per_event_before_its_approval_and_a_failing_one_holds(
        arm: ArmPeer, tmp_path: Path) -> None:
    import json
    import sys

    log = tmp_path / "hooks.log"
    writer = ("import json, sys; payload = json.load(sys.stdin); "
              "open(sys.argv[1], 'a').write(payload['hook'] + ' ' + payload['event']['EventId'] + ' ' + "
              "payload['vm']['name'] + '\\n'); sys.exit(1 if payload['vm']['name'] == 'web-2' else 0)")
    hook = json.dumps({"command": [sys.executable, "-c", writer, str(log)]})
    policy = (f"hooks: {{recover: [{hook}]}}\n"
              f"rules: [{{name: all, action: approve, match: {{event_type: [Reboot]}}, prepare: [{hook}]}}]\n")
    web, failing = event_at(VM, 21, ("web-1",)), event_at(VM.replace("web-1", "web-2"), 22, ("web-2",))
    serve(arm, web, failing)
    harness = Harness(arm, policy)
    harness.approver.hook_runs = harness.metrics.hook_runs
    harness.events = [web, failing]
    harness.step()                                               # hooks start; nothing approved yet
    assert arm.received.acks == []
    wait_until(lambda: log.exists() and len(log.read_text().splitlines()) == 2, timeout=30,
               message="both prepare hooks")
    # the hooks' results come back once their processes have ended: step until the approval follows them
    wait_until(lambda: harness.step(1) or arm.received.acks, timeout=30, message="the approval after the hooks")
    harness.step(1)
    assert [event for _, event, _, _ in arm.received.acks] == [web.event.event_id]   # the failing one holds
    assert sorted(log.read_text().splitlines()) == sorted([f"prepare {web.event.event_id} web-1",
                                                            f"prepare {failing.event.event_id} web-2"])
    assert harness.metrics.hook_runs.labels("prepare", "failure").value == 1
    from forewarn.fleet.tracker import EndedBy, FleetChange
    from forewarn.tracker import ChangeKind, Outcome

    harness.approver.ended([FleetChange(ChangeKind.REMOVED, web, web, Outcome.COMPLETED, EndedBy.STATUS)])
    wait_until(lambda: f"recover {web.event.event_id} web-1" in log.read_text(), timeout=30,
               message="the recover hook after the event completed")
