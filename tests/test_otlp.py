"""The OTLP sink: the real OpenTelemetry exporters against local receivers, over gRPC and HTTP."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import CollectorProcess, SimulatorHandle, outbox_backlog, sample, wait_until
from peers.otlp import GrpcReceiver, HttpReceiverServer

pytestmark = pytest.mark.slow
FAST = {"OTEL_EXPORTER_OTLP_TIMEOUT": "2"}


@pytest.fixture(params=["grpc", "http/protobuf"])
def receiver(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    peer: Any = GrpcReceiver() if request.param == "grpc" else HttpReceiverServer()
    yield request.param, peer
    peer.stop()


def run_otlp(collector: Callable[..., CollectorProcess], sim: SimulatorHandle, protocol: str, peer: Any,
             *extra: str, **kwargs: Any) -> CollectorProcess:
    return collector(sim.url, "--sink", "otlp", "--otlp-protocol", protocol, "--otlp-endpoint", peer.endpoint,
                     *extra, env=FAST, **kwargs)


def test_one_log_record_per_change_with_semantic_resource(receiver: tuple[str, Any],
                                                          simulator: Callable[..., SimulatorHandle],
                                                          collector: Callable[..., CollectorProcess]) -> None:
    protocol, peer = receiver
    sim = simulator("cancelled-maintenance", speed=60)
    proc = run_otlp(collector, sim, protocol, peer)
    logs = wait_until(lambda: len(peer.received.log_records()) == 2 and peer.received.log_records(), timeout=20)
    records = wait_until(lambda: len(proc.records()) == 2 and proc.records(), timeout=5)
    assert [log["event_name"] for log in logs] == ["azure.scheduled_event.added", "azure.scheduled_event.removed"]
    for log, record in zip(logs, records, strict=True):
        assert log["body_value"]["id"] == record["id"]
        assert log["body_value"]["data"]["event"]["EventId"] == record["subject"]
        assert log["attrs"]["cloudevents.event_id"] == record["id"]
        assert log["attrs"]["azure.scheduled_event.type"] == "Reboot"
    assert logs[1]["attrs"]["azure.scheduled_event.outcome"] == "cancelled"
    resource = logs[0]["resource"]
    assert resource["cloud.provider"] == "azure" and resource["cloud.platform"] == "azure_vm"
    assert resource["cloud.region"] == "westeurope" and resource["host.name"] == "vm-0"
    assert resource["cloud.resource_id"].startswith("/subscriptions/") and resource["host.id"]
    assert resource["cloud.account.id"] and resource["service.name"] == "forewarn"
    assert sample(proc.metrics(), "azure_scheduled_events_records_total", sink="otlp") == 2


def test_standard_environment_variables_configure_the_exporter(simulator: Callable[..., SimulatorHandle],
                                                               collector: Callable[..., CollectorProcess]) -> None:
    peer = GrpcReceiver()
    try:
        sim = simulator("hardware-failure", speed=100)
        collector(sim.url, "--sink", "otlp", env={**FAST, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                                                  "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": peer.endpoint})
        wait_until(lambda: len(peer.received.log_records()) == 2, timeout=20)
    finally:
        peer.stop()


def delivered_ids(peer: Any) -> list[str]:
    return [log["attrs"]["cloudevents.event_id"] for log in peer.received.log_records()]


def test_refusing_receiver_gets_everything_in_order_once_it_recovers(
        receiver: tuple[str, Any], simulator: Callable[..., SimulatorHandle],
        collector: Callable[..., CollectorProcess]) -> None:
    protocol, peer = receiver
    peer.received.fail = True
    sim = simulator("live-migration", speed=10)  # approved at once; Started lasts 1.5 s, several polls
    proc = run_otlp(collector, sim, protocol, peer)
    wait_until(lambda: len(proc.records()) == 1, timeout=10)
    requests_post = __import__("requests").post
    requests_post(sim.url + "/metadata/scheduledevents?api-version=2020-07-01", headers={"Metadata": "true"},
                  json={"StartRequests": [{"EventId": proc.records()[0]["subject"]}]}, timeout=5)
    wait_until(lambda: len(proc.records()) == 3, timeout=15)
    wait_until(lambda: (sample(proc.metrics(), "azure_scheduled_events_record_failures_total", sink="otlp") or 0) >= 1,
               timeout=15, message="failed attempts counted")
    wait_until(lambda: sample(proc.metrics(), "azure_scheduled_events_outbox_records", sink="otlp") == 3, timeout=15)
    assert delivered_ids(peer) == []
    peer.received.fail = False
    wait_until(lambda: len(set(delivered_ids(peer))) == 3, timeout=40, message="backlog after recovery")
    expected = [r["id"] for r in proc.records()]
    got = delivered_ids(peer)
    assert list(dict.fromkeys(got)) == expected, "in order, repeats only of the same id"
    wait_until(lambda: sample(proc.metrics(), "azure_scheduled_events_outbox_records", sink="otlp") == 0, timeout=10)


def test_receiver_down_at_start_then_up(simulator: Callable[..., SimulatorHandle],
                                        collector: Callable[..., CollectorProcess]) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    sim = simulator("cancelled-maintenance", speed=60)
    proc = collector(sim.url, "--sink", "otlp", "--otlp-protocol", "http/protobuf", "--otlp-endpoint",
                     f"http://127.0.0.1:{port}/v1/logs", env=FAST)
    wait_until(lambda: len(proc.records()) == 2, timeout=15)
    wait_until(lambda: (sample(proc.metrics(), "azure_scheduled_events_record_failures_total", sink="otlp") or 0) >= 1,
               timeout=15, message="failed attempts counted")
    from peers.otlp import HttpReceiverServer as Server

    class Fixed(Server):
        def __init__(self) -> None:
            from http.server import ThreadingHTTPServer

            from peers.otlp import Received, _HttpHandler
            self.received = Received()
            ThreadingHTTPServer.__init__(self, ("127.0.0.1", port), _HttpHandler)
            __import__("threading").Thread(target=self.serve_forever, daemon=True).start()

    peer = Fixed()
    try:
        wait_until(lambda: len(set(delivered_ids(peer))) == 2, timeout=45, message="delivery once the peer is up")
        assert list(dict.fromkeys(delivered_ids(peer))) == [r["id"] for r in proc.records()]
    finally:
        peer.stop()


def test_sigkill_with_a_backlog_then_restart_delivers_it(simulator: Callable[..., SimulatorHandle],
                                                         collector: Callable[..., CollectorProcess]) -> None:
    peer = HttpReceiverServer()
    try:
        peer.received.fail = True
        sim = simulator("hardware-failure", speed=100)
        proc = collector(sim.url, "--sink", "otlp", "--otlp-protocol", "http/protobuf", "--otlp-endpoint",
                         peer.endpoint, env=FAST)
        wait_until(lambda: len(proc.records()) == 2, timeout=15)
        proc.kill()
        peer.received.fail = False
        again = collector(sim.url, "--sink", "otlp", "--otlp-protocol", "http/protobuf", "--otlp-endpoint",
                          peer.endpoint, env=FAST)
        wait_until(lambda: len(set(delivered_ids(peer))) == 2, timeout=30)
        wait_until(lambda: outbox_backlog(again.metrics()) == 0, timeout=20, message="both sinks delivered everything")
        # At least once: the file sink may repeat a record written just before the kill, and the receiver may get
        # one twice, but always under the same id; each change has one id, and the receiver got every one.
        records = again.records()
        (event_id,) = {r["subject"] for r in records}
        assert {(r["subject"], r["data"]["change"]) for r in records} == {(event_id, "added"), (event_id, "removed")}
        assert len({r["id"] for r in records}) == 2, "each change under one id"
        assert list(dict.fromkeys(delivered_ids(peer))) == list(dict.fromkeys(r["id"] for r in records))
    finally:
        peer.stop()


def test_missing_packages_or_bad_protocol_are_configuration_errors() -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "forewarn", "run", "--simulate", "quiet", "--sink", "otlp",
                             "--otlp-protocol", "carrier-pigeon", "--listen-address", "127.0.0.1:0"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "--otlp-protocol" in result.stderr and "Traceback" not in result.stderr


def test_grpc_receiver_down_mid_stream(simulator: Callable[..., SimulatorHandle],
                                       collector: Callable[..., CollectorProcess]) -> None:
    import requests

    peer = GrpcReceiver()
    port, received = peer.port, peer.received
    sim = simulator("quiet")
    proc = run_otlp(collector, sim, "grpc", peer)
    requests.post(sim.url + "/admin/events", json={"type": "Reboot", "notice": 900, "id": "A"}, timeout=5)
    wait_until(lambda: len(delivered_ids(peer)) == 1, timeout=20)
    peer.stop()
    requests.delete(sim.url + "/admin/events/A", timeout=5)
    requests.post(sim.url + "/admin/events", json={"type": "Freeze", "notice": 900, "id": "B"}, timeout=5)
    wait_until(lambda: len(proc.records()) == 3, timeout=10)
    wait_until(lambda: (sample(proc.metrics(), "azure_scheduled_events_record_failures_total", sink="otlp") or 0) >= 1,
               timeout=20, message="a failed attempt while the receiver is down")
    back = GrpcReceiver(port=port, received=received)
    try:
        wait_until(lambda: len(set(delivered_ids(back))) == 3, timeout=60, message="the rest after the outage")
        assert list(dict.fromkeys(delivered_ids(back))) == [r["id"] for r in proc.records()]
    finally:
        back.stop()


def test_slow_receiver_delays_nothing_but_its_own_delivery(simulator: Callable[..., SimulatorHandle],
                                                           collector: Callable[..., CollectorProcess]) -> None:
    peer = HttpReceiverServer()
    try:
        peer.received.delay = 1.5
        sim = simulator("cancelled-maintenance", speed=60)
        proc = collector(sim.url, "--sink", "otlp", "--otlp-protocol", "http/protobuf", "--otlp-endpoint",
                         peer.endpoint, env={"OTEL_EXPORTER_OTLP_TIMEOUT": "10"})
        polls_before = sample(proc.metrics(), "azure_scheduled_events_imds_requests_total", method="GET", code="200")
        wait_until(lambda: len(proc.records()) == 2, timeout=15)
        wait_until(lambda: len(set(delivered_ids(peer))) == 2, timeout=30)
        polls_after = sample(proc.metrics(), "azure_scheduled_events_imds_requests_total", method="GET", code="200")
        assert polls_before is not None and polls_after is not None and polls_after - polls_before >= 5
        assert list(dict.fromkeys(delivered_ids(peer))) == [r["id"] for r in proc.records()]
    finally:
        peer.stop()


def connections_to(port: int) -> int:
    """Established TCP connections from this machine to 127.0.0.1:`port` (the client ends, from /proc; gRPC
    uses IPv6 sockets, where 127.0.0.1 is the IPv4-mapped ::ffff:127.0.0.1)."""
    loopback = ("0100007F", "0000000000000000FFFF00000100007F")
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            remote, state = line.split()[2:4]
            address, hex_port = remote.split(":")
            count += address in loopback and int(hex_port, 16) == port and state == "01"  # 01: ESTABLISHED
    return count


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads connections from /proc/net/tcp (Linux)")
def test_grpc_channel_is_closed_while_idle_and_reopened_for_the_next_records(tmp_path: Any) -> None:
    from datetime import datetime, timezone

    from forewarn.imds.document import parse_document
    from forewarn.imds.instance import VmInfo
    from forewarn.outbox.delivery import DeliveryWorker
    from forewarn.outbox.outbox import Outbox
    from forewarn.records import to_record
    from forewarn.sinks.otlp import OtlpSink
    from forewarn.tracker import diff_documents

    def records(first: int) -> list[Any]:
        document = parse_document({"DocumentIncarnation": first, "Events": [
            {"EventId": f"IDLE-{first}", "EventType": "Reboot", "Resources": ["vm-0"], "EventStatus": "Scheduled",
             "NotBefore": ""}]})
        return [to_record(change, VmInfo(name="vm-0"), datetime.now(timezone.utc))
                for change in diff_documents(None, document)]

    peer = GrpcReceiver()
    sink = OtlpSink(endpoint=peer.endpoint, protocol="grpc")
    outbox = Outbox(tmp_path, [sink.name])
    worker = DeliveryWorker(sink, outbox, idle_refresh=1.0)
    worker.start()
    try:
        outbox.append(records(1))
        wait_until(lambda: len(peer.received.log_records()) == 1, timeout=10)
        assert connections_to(peer.port) == 1  # open after the delivery (the quiet spell is 1 s away)
        wait_until(lambda: connections_to(peer.port) == 0, timeout=5,  # the quiet spell closed the channel
                   message="the gRPC channel closed")
        outbox.append(records(2))
        wait_until(lambda: len(peer.received.log_records()) == 2, timeout=10)
        assert [r["attrs"]["azure.scheduled_event.id"] for r in peer.received.log_records()] == ["IDLE-1", "IDLE-2"]
    finally:
        worker.stop()
        sink.close()
        outbox.close()
        peer.stop()
