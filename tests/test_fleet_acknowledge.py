"""The acknowledge call (forewarn.fleet.acknowledge) against the strict ARM stand-in over TLS on loopback: the real
azure-identity ManagedIdentityCredential gets its token from the stand-in's token endpoint, for the ARM audience
only; one call per event, or the list form where the api-version has it; 429 storms ridden out; refusals
named; a hung answer bounded by the deadline and the stop signal."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from forewarn.fleet.acknowledge import AcknowledgeError, Acknowledger
from forewarn.fleet.resourcegraph import Stopped

from peers.arm import ArmPeer
from peers.pki import Authority

SUB = str(uuid.UUID(int=7))
CLIENT_ID = "00000000-0000-0000-0000-00000000c11d"
VM = f"/subscriptions/{SUB}/resourceGroups/rg-a/providers/Microsoft.Compute/virtualMachines/vm-1"
VMSS = (f"/subscriptions/{SUB}/resourceGroups/MC_rg_aks_westeurope/providers/Microsoft.Compute/"
        "virtualMachineScaleSets/pool")


def eid(n: int) -> str:
    return str(uuid.UUID(int=90_000 + n))


def row(target: str, n: int) -> dict[str, Any]:
    return {"id": f"{target}/providers/Microsoft.Maintenance/scheduledevents/{eid(n)}", "name": eid(n),
            "subscriptionId": SUB, "properties": {"EventId": eid(n), "EventStatus": "Scheduled"}}


@pytest.fixture(scope="module")
def authority() -> Authority:
    return Authority("ack-test-ca")


@pytest.fixture
def arm(authority: Authority) -> Iterator[ArmPeer]:
    peer = ArmPeer(authority, rows=[row(VM, 1), row(VM, 2), row(VMSS, 3), row(VMSS, 4), row(VMSS, 5)])
    yield peer
    peer.stop()


@pytest.fixture
def identity(arm: ArmPeer, authority: Authority, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """azure-identity's managed identity credential, asking the stand-in's token endpoint and trusting its CA."""
    from azure.identity import ManagedIdentityCredential

    bundle = tmp_path / "ca.pem"
    bundle.write_bytes(authority.pem)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(bundle))
    monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", arm.base)
    return ManagedIdentityCredential(client_id=CLIENT_ID)


def acknowledger(arm: ArmPeer, identity: Any, authority: Authority, **options: Any) -> Acknowledger:
    return Acknowledger(arm.base, identity, **options)  # trusting REQUESTS_CA_BUNDLE, as the service does


def test_one_call_per_event_with_a_managed_identity_token_for_arm(arm: ArmPeer, identity: Any,
                                                                  authority: Authority) -> None:
    client = acknowledger(arm, identity, authority, api_version="2023-10-01-preview")
    done = client.acknowledge(VM, [eid(1), eid(2), eid(1)])
    assert done.event_ids == (eid(1), eid(2)) and done.requests == 2
    assert arm.received.acks == [(VM.lower(), eid(1), "single", "2023-10-01-preview"),
                                 (VM.lower(), eid(2), "single", "2023-10-01-preview")]
    assert arm.received.tokens_issued == 1 and not arm.received.errors  # one token, for ARM's audience


def test_the_list_form_approves_a_scale_sets_events_in_one_call(arm: ArmPeer, identity: Any,
                                                                authority: Authority) -> None:
    client = acknowledger(arm, identity, authority)   # the default api-version has the list form
    done = client.acknowledge(VMSS, [eid(3), eid(4), eid(5)])
    assert done.requests == 1
    assert [(event, form) for _, event, form, _ in arm.received.acks] == [(eid(3), "list"), (eid(4), "list"),
                                                                          (eid(5), "list")]
    client.acknowledge(VMSS, [eid(3)])                # a single event needs no list
    assert arm.received.acks[-1][2] == "single"


def test_a_429_storm_is_ridden_out_and_a_longer_one_is_a_retryable_error(arm: ArmPeer, identity: Any,
                                                                         authority: Authority) -> None:
    arm.ack_faults.throttle, arm.ack_faults.retry_after = 3, "0.2"
    client = acknowledger(arm, identity, authority, attempts=5)
    started = time.monotonic()
    done = client.acknowledge(VM, [eid(1)])
    assert (done.requests, done.throttled) == (4, 3) and time.monotonic() - started >= 0.6  # Retry-After kept
    assert arm.received.ack_statuses == [429, 429, 429, 200]
    arm.ack_faults.fail, arm.ack_faults.fail_retry_after = 9, "0"
    with pytest.raises(AcknowledgeError) as failed:
        client.acknowledge(VM, [eid(2)])
    assert failed.value.retryable and failed.value.status == 503 and "after 5 attempts" in str(failed.value)
    assert [event for _, event, _, _ in arm.received.acks] == [eid(1)]


def test_refusals_are_named_and_not_retried(arm: ArmPeer, identity: Any, authority: Authority) -> None:
    client = acknowledger(arm, identity, authority)
    with pytest.raises(AcknowledgeError) as unknown:
        client.acknowledge(VM, [eid(4)])                     # an event of another resource
    assert unknown.value.status == 404 and not unknown.value.retryable
    assert "ScheduledEventNotFound" in str(unknown.value) and "no such event" in str(unknown.value)
    assert arm.received.ack_statuses == [404]
    with pytest.raises(AcknowledgeError) as old:
        acknowledger(arm, identity, authority, api_version="2021-01-01").acknowledge(VM, [eid(1)])
    assert old.value.status == 400 and "InvalidApiVersionParameter" in str(old.value)
    assert arm.token not in str(unknown.value) + str(old.value)
    with pytest.raises(ValueError, match="not a VM, scale set or availability set"):
        client.acknowledge(f"/subscriptions/{SUB}/resourceGroups/rg-a/providers/Microsoft.Storage/"
                           "storageAccounts/sa", [eid(1)])
    with pytest.raises(ValueError, match="is not an ARM resource ID"):
        client.acknowledge(f"/subscriptions/{SUB}/resourceGroups/rg-a", [eid(1)])
    with pytest.raises(ValueError, match="event ids"):
        client.acknowledge(VM, ["../../x"])
    assert arm.received.ack_statuses == [404, 400]          # none of those was sent


def test_a_hung_answer_ends_at_the_deadline_and_at_a_stop(arm: ArmPeer, identity: Any, authority: Authority) -> None:
    client = acknowledger(arm, identity, authority, timeout=1.0)
    client.acknowledge(VM, [eid(1)])  # the token first
    arm.ack_faults.hang = True
    started = time.monotonic()
    with pytest.raises(AcknowledgeError, match="no complete answer within 1 s") as hung:
        client.acknowledge(VM, [eid(2)])
    assert hung.value.retryable and time.monotonic() - started < 3
    stop = threading.Event()
    stopping = acknowledger(arm, identity, authority, timeout=30.0, stop=stop)
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    with pytest.raises(Stopped):
        stopping.acknowledge(VM, [eid(2)])
    assert time.monotonic() - started < 2
