"""The Event Hubs sink: the real azure-eventhub producer against a local AMQP 1.0 peer."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import CollectorProcess, SimulatorHandle, outbox_backlog, sample, wait_until
from peers.amqp import AmqpPeer

pytestmark = pytest.mark.slow


@pytest.fixture
def peer() -> Iterator[AmqpPeer]:
    amqp = AmqpPeer()
    yield amqp
    amqp.stop()


def run(collector: Callable[..., CollectorProcess], sim: SimulatorHandle, connection_string: str,
        **kwargs: Any) -> CollectorProcess:
    env = {"FOREWARN_EVENTHUBS_CONNECTION_STRING": connection_string}
    return collector(sim.url, "--sink", "eventhubs", env=env, **kwargs)


def bodies(peer: AmqpPeer) -> list[dict[str, Any]]:
    return [json.loads(bytes(m.data[0])) for m in peer.received.events()]


def delivered_ids(peer: AmqpPeer) -> list[str]:
    return [body["id"] for body in bodies(peer)]


def test_records_arrive_as_cloudevents_with_routing_properties(peer: AmqpPeer,
                                                                simulator: Callable[..., SimulatorHandle],
                                                                collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator("cancelled-maintenance", speed=60)
    proc = run(collector, sim, peer.connection_string)
    wait_until(lambda: len(peer.received.events()) == 2, timeout=20)
    records = wait_until(lambda: len(proc.records()) == 2 and proc.records(), timeout=5)
    messages = peer.received.events()
    assert bodies(peer) == records, "the body is the CloudEvents record, unchanged"
    for message, record in zip(messages, records, strict=True):
        assert message.properties.content_type == b"application/cloudevents+json"
        props = {key.decode(): (value.decode() if isinstance(value, bytes) else value)
                 for key, value in message.application_properties.items()}
        assert props["record_type"] == record["data"]["change"]
        assert props["event_type"] == "Reboot" and props["vm_name"] == "vm-0"
        assert props["event_id"] == record["subject"]
        assert message.message_annotations[b"x-opt-partition-key"].decode() == record["data"]["vm"]["vm_id"]
    assert peer.received.tokens >= 1
    assert sample(proc.metrics(), "azure_scheduled_events_records_total", sink="eventhubs") == 2


def test_connection_string_from_a_file(tmp_path: Path, peer: AmqpPeer, simulator: Callable[..., SimulatorHandle],
                                       collector: Callable[..., CollectorProcess]) -> None:
    secret = tmp_path / "eventhubs.secret"
    secret.write_text(peer.connection_string + "\n")
    sim = simulator("hardware-failure", speed=100)
    proc = collector(sim.url, "--sink", "eventhubs", "--eventhubs-connection-string-file", str(secret))
    wait_until(lambda: len(peer.received.events()) == 2, timeout=20)
    assert "SAS_KEY_VALUE" not in proc.log()


def test_refusing_peer_then_recovery_delivers_everything_in_order(
        peer: AmqpPeer, simulator: Callable[..., SimulatorHandle], collector: Callable[..., CollectorProcess]) -> None:
    peer.received.reject = True
    sim = simulator("cancelled-maintenance", speed=60)
    proc = run(collector, sim, peer.connection_string)
    wait_until(lambda: len(proc.records()) == 2, timeout=15)
    wait_until(lambda: (sample(proc.metrics(), "azure_scheduled_events_record_failures_total", sink="eventhubs")
                        or 0) >= 1, timeout=20, message="failures counted")
    assert peer.received.events() == []
    peer.received.reject = False
    wait_until(lambda: len(set(delivered_ids(peer))) == 2, timeout=40)
    assert list(dict.fromkeys(delivered_ids(peer))) == [r["id"] for r in proc.records()]


def test_peer_down_at_start_and_mid_stream(simulator: Callable[..., SimulatorHandle],
                                           collector: Callable[..., CollectorProcess]) -> None:
    import requests

    from peers.amqp import connection_string, free_port

    port = free_port()
    sim = simulator("quiet")
    proc = run(collector, sim, connection_string(port))

    requests.post(sim.url + "/admin/events", json={"type": "Reboot", "notice": 900, "id": "A"}, timeout=5)
    wait_until(lambda: len(proc.records()) == 1, timeout=10)
    wait_until(lambda: (sample(proc.metrics(), "azure_scheduled_events_record_failures_total", sink="eventhubs")
                        or 0) >= 1, timeout=30, message="failures while the peer is down")
    peer = AmqpPeer(port=port)
    try:
        wait_until(lambda: delivered_ids(peer), timeout=60, message="delivery once the peer is up")
        failures = sample(proc.metrics(), "azure_scheduled_events_record_failures_total", sink="eventhubs") or 0
        peer.stop()  # down mid-stream
        requests.delete(sim.url + "/admin/events/A", timeout=5)
        requests.post(sim.url + "/admin/events", json={"type": "Freeze", "notice": 900, "id": "B"}, timeout=5)
        wait_until(lambda: len(proc.records()) == 3, timeout=10)
        wait_until(lambda: (sample(proc.metrics(), "azure_scheduled_events_record_failures_total", sink="eventhubs")
                            or 0) > failures, timeout=30, message="a failed attempt during the second outage")
        peer2 = AmqpPeer(port=port)
        try:
            wait_until(lambda: len(set(delivered_ids(peer) + delivered_ids(peer2))) == 3, timeout=60,
                       message="the rest after the second outage")
            got = list(dict.fromkeys(delivered_ids(peer) + delivered_ids(peer2)))
            assert got == [r["id"] for r in proc.records()]
        finally:
            peer2.stop()
    finally:
        peer.stop()


def test_sigkill_with_a_backlog_then_restart(peer: AmqpPeer, simulator: Callable[..., SimulatorHandle],
                                             collector: Callable[..., CollectorProcess]) -> None:
    peer.received.reject = True
    sim = simulator("hardware-failure", speed=100)
    proc = run(collector, sim, peer.connection_string)
    wait_until(lambda: len(proc.records()) == 2, timeout=15)
    proc.kill()
    peer.received.reject = False
    again = run(collector, sim, peer.connection_string)
    wait_until(lambda: len(set(delivered_ids(peer))) == 2, timeout=40)
    wait_until(lambda: outbox_backlog(again.metrics()) == 0, timeout=20, message="both sinks delivered everything")
    # At least once: the file sink may repeat a record written just before the kill, and the peer may get one
    # twice, but always under the same id; each change has exactly one id, and the peer got every one of them.
    records = again.records()
    (event_id,) = {r["subject"] for r in records}
    assert {(r["subject"], r["data"]["change"]) for r in records} == {(event_id, "added"), (event_id, "removed")}
    assert len({r["id"] for r in records}) == 2, "each change under one id"
    assert list(dict.fromkeys(delivered_ids(peer))) == list(dict.fromkeys(r["id"] for r in records))


def forewarn_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "forewarn", "run", "--simulate", "quiet", "--listen-address",
                           "127.0.0.1:0", *args], capture_output=True, text=True, timeout=30,
                          env={**os.environ, **(env or {})})


def test_bad_connection_string_fails_at_start_without_echoing_the_key() -> None:
    result = forewarn_run("--sink", "eventhubs",
                          env={"FOREWARN_EVENTHUBS_CONNECTION_STRING": "Endpoint=sb://x;SharedAccessKey=TOPSECRETKEY"})
    assert result.returncode == 2
    assert "connection string is not valid" in result.stderr
    assert "TOPSECRETKEY" not in result.stderr + result.stdout and "Traceback" not in result.stderr


def test_connection_string_flag_is_refused_and_secrets_never_logged(peer: AmqpPeer) -> None:
    result = forewarn_run("--sink", "eventhubs", "--eventhubs-connection-string", peer.connection_string)
    assert result.returncode == 2 and "visible to every user through ps" in result.stderr
    assert "SAS_KEY_VALUE" not in result.stderr
    missing = forewarn_run("--sink", "eventhubs")
    assert missing.returncode == 2 and "FOREWARN_EVENTHUBS_CONNECTION_STRING" in missing.stderr


def test_slow_peer_still_gets_everything_in_order(peer: AmqpPeer, simulator: Callable[..., SimulatorHandle],
                                                  collector: Callable[..., CollectorProcess]) -> None:
    peer.received.delay = 1.0
    sim = simulator("cancelled-maintenance", speed=60)
    proc = run(collector, sim, peer.connection_string)
    wait_until(lambda: len(proc.records()) == 2, timeout=15)
    wait_until(lambda: len(set(delivered_ids(peer))) == 2, timeout=40)
    assert list(dict.fromkeys(delivered_ids(peer))) == [r["id"] for r in proc.records()]


def test_azure_ad_authentication_uses_the_namespace_and_a_managed_identity() -> None:
    from azure.identity import DefaultAzureCredential, ManagedIdentityCredential

    from forewarn.sinks.eventhubs import EventHubsSink

    managed = EventHubsSink(namespace="myns.servicebus.windows.net", hub="events", client_id="1111-2222")
    assert managed.target == "myns.servicebus.windows.net/events"
    assert isinstance(managed.credential, ManagedIdentityCredential)
    default = EventHubsSink(namespace="myns.servicebus.windows.net", hub="events")
    assert isinstance(default.credential, DefaultAzureCredential)
    managed.close()
    default.close()
