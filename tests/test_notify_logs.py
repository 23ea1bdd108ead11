"""The logs-ingestion sink against a Logs Ingestion stand-in over TLS on loopback.

azure-core sends a bearer token over https only, so the stand-in serves TLS with a certificate made here
(a CA and a server certificate for 127.0.0.1); the agent trusts it through REQUESTS_CA_BUNDLE, as a user
would for a private endpoint behind a private CA. In process the sink gets a credential that returns a
fixed token (the TokenCredential protocol azure-identity implements); the `forewarn run` test uses the real
ManagedIdentityCredential, pointed at the stand-in's IMDS token endpoint (AZURE_POD_IDENTITY_AUTHORITY_HOST).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from azure.core.credentials import AccessToken
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from forewarn.sinks import SinkError
from forewarn.sinks.logsingestion import LogsIngestionSink, to_row
from test_notify import make_records, preload

from conftest import CollectorProcess, SimulatorHandle, sample, wait_until
from peers.notify import NotifyPeer

DEPLOY = Path(__file__).parent.parent / "deploy/azure-monitor/forewarn-logs.json"
DCR = "dcr-00000000000000000000000000000000"
TOKEN = "SECRET-TOKEN-eyJ0eXAiOiJKV1Qi"


def stream_columns() -> tuple[str, dict[str, str]]:
    """The stream name and its columns as the deploy file declares them."""
    template = json.loads(DEPLOY.read_text())
    (rule,) = [r for r in template["resources"] if r["type"] == "Microsoft.Insights/dataCollectionRules"]
    ((_, stream),) = rule["properties"]["streamDeclarations"].items()
    return template["variables"]["streamName"], {c["name"]: c["type"] for c in stream["columns"]}


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_certificates(directory: Path) -> tuple[Path, tuple[str, str]]:
    """A CA bundle and the server's (certificate, key) for 127.0.0.1, valid for a day."""
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("forewarn test CA")).issuer_name(_name("forewarn test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    server = (x509.CertificateBuilder().subject_name(_name("127.0.0.1")).issuer_name(ca.subject)
              .public_key(key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
              .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                             critical=False)
              .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                             critical=False)
              .sign(ca_key, hashes.SHA256()))
    bundle, cert_file, key_file = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    bundle.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_file.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return bundle, (str(cert_file), str(key_file))


class FixedToken:
    """A TokenCredential (azure-core's protocol, what azure-identity's credentials implement) with one token."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.scopes: list[tuple[str, ...]] = []

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        self.scopes.append(scopes)
        return AccessToken(self.token, int(time.time()) + 3600)


@pytest.fixture
def logs_peer(tmp_path: Path) -> Iterator[tuple[NotifyPeer, Path]]:
    stream, columns = stream_columns()
    bundle, tls = make_certificates(tmp_path)
    peer = NotifyPeer("logs", token=TOKEN, dcr=DCR, stream=stream, columns=columns, tls=tls)
    yield peer, bundle
    peer.stop()


def make_sink(peer: NotifyPeer, state_dir: Path, token: str = TOKEN) -> LogsIngestionSink:
    return LogsIngestionSink(peer.base, DCR, peer.stream, credential=FixedToken(token), state_dir=str(state_dir))


def test_rows_arrive_with_the_stream_columns(logs_peer: tuple[NotifyPeer, Path], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    peer, bundle = logs_peer
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(bundle))
    records = make_records(3)
    sink = make_sink(peer, tmp_path / "state")
    sink.send(records)
    sink.close()
    assert peer.received.errors == []
    assert peer.received.ids() == [record.id for record in records]
    rows = [item["row"] for item in peer.received.accepted]
    assert rows == [json.loads(json.dumps(to_row(record))) for record in records]
    assert {"TimeGenerated", "RecordId", "EventId", "EventType", "VmName", "Record"} <= set(rows[0])
    assert rows[0]["EventType"] == "Reboot" and rows[0]["VmName"] == "vm-0" and rows[0]["Resources"] == ["vm-0", "vm-1"]


def test_a_record_id_is_uploaded_once_across_restarts(logs_peer: tuple[NotifyPeer, Path], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    peer, bundle = logs_peer
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(bundle))
    records = make_records(4)
    for batch in (records[:2], records):  # the second run is handed the first two again, as after a crash
        sink = make_sink(peer, tmp_path / "state")
        sink.send(batch)
        sink.close()
    assert peer.received.ids() == [record.id for record in records]


def test_the_stand_in_refuses_a_wrong_token(logs_peer: tuple[NotifyPeer, Path], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The bearer check can fail; the sink's error then names the endpoint and status, not the token."""
    peer, bundle = logs_peer
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(bundle))
    sink = make_sink(peer, tmp_path / "state", token="SECRET-WRONG")
    with pytest.raises(SinkError) as failed:
        sink.send(make_records(1))
    sink.close()
    assert peer.received.ids() == [] and peer.received.errors == ["ValueError: no valid bearer token"]
    assert "SECRET" not in str(failed.value) and "https://127.0.0.1" in str(failed.value)


def test_an_untrusted_certificate_is_refused(logs_peer: tuple[NotifyPeer, Path], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    peer, _ = logs_peer
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    sink = make_sink(peer, tmp_path / "state")
    with pytest.raises(SinkError, match="ServiceRequestError"):
        sink.send(make_records(1))
    sink.close()
    assert peer.received.attempts == []


@pytest.mark.slow
def test_outage_throttling_and_sigkill_lose_nothing_and_repeat_nothing(
        logs_peer: tuple[NotifyPeer, Path], tmp_path: Path, simulator: Callable[..., SimulatorHandle],
        collector: Callable[..., CollectorProcess]) -> None:
    peer, bundle = logs_peer
    records = make_records(1500)  # three outbox batches of 500: the kill can land between them
    expected = [record.id for record in records]
    preload(tmp_path / "state", "logs-ingestion", records)
    sim = simulator("quiet")
    args = ["--sink", "logs-ingestion", "--logs-endpoint", peer.base, "--logs-rule-id", DCR,
            "--logs-stream", peer.stream, "--logs-client-id", "00000000-0000-0000-0000-00000000c11d"]
    env = {"REQUESTS_CA_BUNDLE": str(bundle), "AZURE_POD_IDENTITY_AUTHORITY_HOST": peer.base}

    # An outage first: nothing accepted, records kept.
    peer.received.down = True
    proc = collector(sim.url, *args, env=env)
    wait_until(lambda: len(peer.received.attempts) >= 2, timeout=20, message="retries during the outage")
    assert peer.received.ids() == []
    # Then a 429 asking for 2 s: the next attempt waits that long.
    peer.received.throttle, peer.received.retry_after = 1, 2
    peer.received.delay = 0.5
    peer.received.down = False
    got = peer.received
    # SIGKILL while the second batch is in flight: the first one taken (and remembered by the agent, which
    # sends the next batch only then), the second not yet answered. The stand-in drops a request whose
    # client has gone, so it must come again from the new process. (A kill between the service taking a
    # batch and the agent hearing so would repeat that batch: at-least-once, see docs/notifications.md.)
    wait_until(lambda: got.ids() and got.attempts[-1] > got.accepted_at[0], timeout=40,
               message="the second batch in flight")
    proc.kill()
    after_429 = [at for at in got.attempts if at > got.throttled[0]]
    assert after_429[0] - got.throttled[0] >= 1.9
    assert len(got.ids()) == 500, "the kill came after the second batch was taken"
    proc = collector(sim.url, *args, env=env, name="state")
    wait_until(lambda: len(peer.received.ids()) >= len(expected), timeout=40, message="every record")
    wait_until(lambda: sample(proc.metrics(), "azure_scheduled_events_outbox_records", sink="logs-ingestion") == 0,
               timeout=10, message="an empty backlog")
    proc.stop()
    assert peer.received.errors == []
    assert peer.received.ids() == expected, "every record, in order, each id once"
    assert got.abandoned == 1, "the batch in flight at the kill was dropped, then sent again"
    assert peer.tokens_issued >= 1 and TOKEN not in proc.log()


def test_a_webhook_behind_a_private_ca_is_trusted_through_requests_ca_bundle(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The notification sinks honour the same REQUESTS_CA_BUNDLE as the logs-ingestion sink."""
    from forewarn.sinks.notify import Filter
    from forewarn.sinks.webhook import WebhookSink

    bundle, tls = make_certificates(tmp_path)
    peer = NotifyPeer("cloudevents", tls=tls)
    try:
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(bundle))
        sink = WebhookSink(peer.url, "structured", Filter(), 0, str(tmp_path / "state"))
        records = make_records(2)
        sink.send(records)
        sink.close()
        assert peer.received.ids() == [record.id for record in records]
    finally:
        peer.stop()
