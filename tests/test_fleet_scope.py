"""`forewarn fleet --resource-group`: one instance scoped below the subscription, so that clusters sharing a
subscription each run their own. The option as flag, variable and config-file key; Resource Graph asked only
for those resource groups (the strict stand-in evaluates the filter); queue messages and push deliveries keep
only the events within the scope, count the others, and still delete the message and answer 200."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from fleet_samples import event_grid_event, properties, resource_graph_row, target_id
from forewarn.cli import build_parser
from forewarn.config import resolve_fleet
from forewarn.fleet.feed import parse_resource_graph_row
from forewarn.fleet.scope import FleetScope
from test_fleet_queue import Azurite, count, require_azurite
from test_fleet_service import CLIENT_ID, PUSH_SECRET, Fleet

from conftest import wait_until
from peers.arm import ArmPeer
from peers.pki import Authority

SUB, OTHER_SUB = str(uuid.UUID(int=0xA1)), str(uuid.UUID(int=0xB2))


def eid(n: int) -> str:
    return str(uuid.UUID(int=70_000 + n))


def target(n: int, rg: str, sub: str = SUB) -> str:
    return target_id("vm", f"vm-{n}", sub=sub, rg=rg)


def row(n: int, rg: str, sub: str = SUB) -> dict[str, Any]:
    """A Resource Graph row as the service stores it: resourceGroup lower-cased, the ID as created."""
    found = resource_graph_row(properties(event_id=eid(n), resources=(f"vm-{n}",)), target(n, rg, sub))
    return {**found, "subscriptionId": sub, "resourceGroup": rg.lower()}


def grid(n: int, rg: str, sub: str = SUB) -> dict[str, Any]:
    return event_grid_event(properties(event_id=eid(n), resources=(f"vm-{n}",)), target(n, rg, sub), f"d-{n}")


def recorded_vms(fleet: Fleet) -> set[str]:
    return {record["data"]["vm"]["name"] for record in fleet.records()}


def arm_args(arm: ArmPeer, *scope: str, interval: str = "1") -> tuple[str, ...]:
    return (*scope, "--arm-endpoint", arm.base, "--arm-client-id", CLIENT_ID, "--arm-timeout", "30",
            "--reconcile-interval", interval)


def arm_env(arm: ArmPeer) -> dict[str, str]:
    return {"AZURE_POD_IDENTITY_AUTHORITY_HOST": arm.base}


@pytest.fixture(scope="module")
def authority() -> Authority:
    return Authority("fleet-scope-test-ca")


@pytest.fixture(scope="module")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    peer = Azurite(require_azurite(), tmp_path_factory.mktemp("azurite"))
    yield peer
    peer.stop()


# --- the option ------------------------------------------------------------------------------------------

def test_resource_group_is_read_from_flags_the_environment_and_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "fleet.yaml"
    config.write_text("resource-group: [rg-Workers, 'rg.(blue)_1']\n")
    parse = build_parser().parse_args
    from_flags = resolve_fleet(parse(["fleet", "--resource-group", "rg-a", "--resource-group", "RG-B"]), environ={})
    assert from_flags.resource_group == ["rg-a", "RG-B"]
    from_env = resolve_fleet(parse(["fleet"]), environ={"FOREWARN_RESOURCE_GROUP": "rg-a, rg-b"})
    assert from_env.resource_group == ["rg-a", "rg-b"]
    from_file = resolve_fleet(parse(["fleet", "--config", str(config)]), environ={})
    assert from_file.resource_group == ["rg-Workers", "rg.(blue)_1"]
    assert resolve_fleet(parse(["fleet"]), environ={}).resource_group == []


@pytest.mark.parametrize(("argv", "env", "file", "named"), [
    (["--resource-group", "rg-a", "--resource-group", "rg-a."], {}, None, "--resource-group: 'rg-a.'"),
    (["--resource-group", "x" * 91], {}, None, "--resource-group"),
    ([], {"FOREWARN_RESOURCE_GROUP": 'rg-a,rg"b'}, None, "FOREWARN_RESOURCE_GROUP: 'rg\"b'"),
    ([], {}, "resource-group: [rg-a, 'rg b']\n", "(resource-group): 'rg b'"),
])
def test_a_name_azure_would_refuse_stops_start_up_with_exit_2_naming_the_option(
        tmp_path: Path, argv: list[str], env: dict[str, str], file: str | None, named: str) -> None:
    if file is not None:
        (tmp_path / "fleet.yaml").write_text(file)
        argv = [*argv, "--config", str(tmp_path / "fleet.yaml")]
    done = subprocess.run([sys.executable, "-m", "forewarn", "fleet", *argv, "--eventgrid-path", "/eventgrid"],
                          capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "FOREWARN_EVENTGRID_SECRET": PUSH_SECRET, **env})
    assert done.returncode == 2, done.stderr
    assert named in done.stderr and "--resource-group" in done.stderr, done.stderr
    assert "1 to 90 letters, digits and _ . - ( ), not ending in '.'" in done.stderr
    assert "Traceback" not in done.stderr


# --- the scope --------------------------------------------------------------------------------------------

def test_scope_compares_subscriptions_and_resource_groups_without_regard_to_case() -> None:
    in_scope = parse_resource_graph_row(resource_graph_row(target=target(1, "RG-Workers", SUB.upper())))
    other_group = parse_resource_graph_row(resource_graph_row(target=target(2, "rg-other")))
    other_sub = parse_resource_graph_row(resource_graph_row(target=target(3, "rg-workers", OTHER_SUB)))
    scoped = FleetScope.of([SUB.upper()], resource_groups=["rg-WORKERS"])
    assert scoped.contains(in_scope)
    assert not scoped.contains(other_group) and not scoped.contains(other_sub)
    # a management group cannot be checked here: only the resource group is
    by_group = FleetScope.of(management_groups=["mg-1"], resource_groups=["RG-workers"])
    assert by_group.contains(in_scope) and by_group.contains(other_sub) and not by_group.contains(other_group)
    assert FleetScope.of().contains(other_group) and FleetScope.of([SUB]).contains(other_group)


# --- the sources ------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("scope", ["subscription", "management-group"])
def test_resource_graph_is_asked_only_for_the_resource_groups_and_other_rows_are_not_recorded(
        tmp_path: Path, authority: Authority, scope: str) -> None:
    """rg-a's events, in either subscription of the management group; rg-b's, in the same subscription, not.
    The stand-in answers the query as Resource Graph would, so a row of rg-b would reach the service unless
    the query leaves it out."""
    arm = ArmPeer(authority, rows=[row(1, "rg-A"), row(2, "rg-b"), row(3, "rg-a", OTHER_SUB)],
                  groups={"mg-1": [SUB, OTHER_SUB]})
    flags = ("--subscription", SUB) if scope == "subscription" else ("--management-group", "mg-1")
    expected = {"vm-1"} if scope == "subscription" else {"vm-1", "vm-3"}
    fleet = Fleet(tmp_path, None, authority, None, None, extra=(*arm_args(arm, *flags), "--resource-group", "RG-A"),
                  env=arm_env(arm)).start()
    try:
        wait_until(lambda: recorded_vms(fleet) == expected and len(arm.received.queries) >= 2, timeout=30,
                   message="two snapshots, and the in-scope events recorded")
        text = fleet.metrics() or ""
    finally:
        assert fleet.stop() == 0, fleet.log.read_text()[-3000:]
        arm.stop()
    assert recorded_vms(fleet) == expected
    assert not arm.received.errors, arm.received.errors
    assert all('| where resourceGroup in~ ("rg-a")' in query["query"] for query in arm.received.queries)
    assert 'resource_group="rg-b"' not in text and 'resource_group="rg-a"' in text.lower()


@pytest.mark.slow
def test_queue_and_push_record_only_events_within_the_scope_and_count_the_others(
        tmp_path: Path, authority: Authority, azurite: Azurite) -> None:
    """Scope: SUB's rg-a. The queue brings a batch of one event in it and one of rg-b, a message of only another
    subscription's event, and one in RG-A (Event Grid keeps the case a resource group was created with); the
    push a delivery of one in and one of rg-c, then one of rg-c only. Every message is deleted, every push
    answered 200, and the five strangers counted."""
    arm = ArmPeer(authority, rows=[])
    queue = azurite.queue()
    queue.send_message(json.dumps([grid(1, "rg-a"), grid(2, "rg-b")]))
    queue.send_message(json.dumps(grid(3, "rg-a", OTHER_SUB)))
    queue.send_message(json.dumps(grid(4, "RG-A")))
    fleet = Fleet(tmp_path, None, authority, azurite, queue.queue_name,
                  extra=(*arm_args(arm, "--subscription", SUB, interval="3600"), "--resource-group", "rg-a",
                         "--eventgrid-path", "/eventgrid"),
                  env={**arm_env(arm), "FOREWARN_EVENTGRID_SECRET": PUSH_SECRET}).start()

    def push(*events: dict[str, Any]) -> requests.Response:
        return requests.post(f"http://127.0.0.1:{fleet.port}/eventgrid", params={"code": PUSH_SECRET},
                             json=list(events), timeout=10)

    try:
        wait_until(lambda: count(queue) == 0 and recorded_vms(fleet) == {"vm-1", "vm-4"}, timeout=60,
                   message="every message deleted, and the in-scope events recorded")
        mixed, strangers, again = push(grid(5, "rg-a"), grid(6, "rg-c")), push(grid(7, "rg-c")), push(grid(8, "rg-c"))
        text = fleet.metrics() or ""
        records = fleet.records()
    finally:
        assert fleet.stop() == 0, fleet.log.read_text()[-3000:]
        arm.stop()
    assert (mixed.status_code, strangers.status_code, again.status_code) == (200, 200, 200), strangers.text
    assert {record["data"]["vm"]["name"] for record in records} == {"vm-1", "vm-4", "vm-5"}
    assert 'azure_scheduled_events_out_of_scope_total{source="queue"} 2.0' in text
    assert 'azure_scheduled_events_out_of_scope_total{source="eventgrid"} 3.0' in text
    assert 'azure_scheduled_events_queue_messages_total{result="deleted"} 3.0' in text
    assert 'azure_scheduled_events_eventgrid_push_requests_total{result="accepted"} 3.0' in text
    log = fleet.log.read_text()
    assert log.count("resource group rg-c is not one of --resource-group") == 1, "once per reason, not per event"
    assert f"subscription {OTHER_SUB} is not one of --subscription" in log


@pytest.mark.slow
def test_resource_groups_alone_scope_an_event_grid_push_in_any_subscription(tmp_path: Path,
                                                                            authority: Authority) -> None:
    """Without --subscription, a resource group name means that name in every subscription the feed brings."""
    fleet = Fleet(tmp_path, None, authority, None, None, extra=("--resource-group", "rg-a", "--eventgrid-path",
                                                               "/eventgrid"),
                  env={"FOREWARN_EVENTGRID_SECRET": PUSH_SECRET}).start()
    try:
        answer = requests.post(f"http://127.0.0.1:{fleet.port}/eventgrid", params={"code": PUSH_SECRET},
                               json=[grid(1, "rg-a"), grid(2, "rg-a", OTHER_SUB), grid(3, "rg-b")], timeout=10)
        text = fleet.metrics() or ""
    finally:
        assert fleet.stop() == 0, fleet.log.read_text()[-3000:]
    assert answer.status_code == 200, answer.text
    assert recorded_vms(fleet) == {"vm-1", "vm-2"}
    assert 'azure_scheduled_events_out_of_scope_total{source="eventgrid"} 1.0' in text
