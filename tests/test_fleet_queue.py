"""Fleet mode's Storage-queue source: the real azure-storage-queue client against Azurite, Microsoft's Azure
Storage emulator (tests/azurite, installed by `npm ci --prefix tests/azurite`), and against local peers that
refuse, stall or fail."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from azure.storage.queue import QueueClient, QueueSasPermissions, generate_queue_sas

from fleet_samples import as_base64, cloud_event, event_grid_event, other_event, properties, target_id
from forewarn.config import ConfigError
from forewarn.fleet.queue import (
    CONNECTION_STRING_ENV,
    QueueOptions,
    QueueSource,
    QueueUnavailable,
    connection_string_from,
)

from conftest import free_port, require_tool, wait_until

pytestmark = pytest.mark.slow

AZURITE = Path(__file__).parent / "azurite" / "node_modules" / "azurite" / "dist" / "src" / "queue" / "main.js"
#: Azurite's well-known development account (published in its README; not a secret anywhere).
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
#: Short everything, so a test waits seconds, not minutes.
FAST = QueueOptions(visibility_timeout=1, poll_interval=0.2, max_backoff=0.5, connection_timeout=1,
                    read_timeout=1, operation_timeout=2)


def require_azurite() -> str:
    """node's path; skips locally when Azurite is not installed, fails in CI, where scripts/test installs it."""
    node = require_tool("node", "Node.js, with `npm ci --prefix tests/azurite`")
    if not AZURITE.is_file():
        if os.environ.get("CI"):
            pytest.fail("Azurite is missing in CI: scripts/test installs it (npm ci --prefix tests/azurite)")
        pytest.skip("Azurite not installed: npm ci --prefix tests/azurite")
    return node


class Azurite:
    """azurite-queue on a loopback port, its data in `location`; stop() and start() keep both."""

    def __init__(self, node: str, location: Path, port: int | None = None) -> None:
        self.node, self.location, self.port = node, location, port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        # --skipApiVersionCheck: the Python SDK speaks a newer service version than Azurite knows.
        # --disableTelemetry: Azurite reports usage by default; tests must not try to reach the internet.
        self.proc = subprocess.Popen(
            [self.node, str(AZURITE), "--queueHost", "127.0.0.1", "--queuePort", str(self.port),
             "--location", str(self.location), "--skipApiVersionCheck", "--disableTelemetry", "--silent"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_until(self._listening, timeout=20, message=f"Azurite on port {self.port}")

    def _listening(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"Azurite exited: {self.proc.stderr.read().decode() if self.proc.stderr else ''}")
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
            return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    @property
    def connection_string(self) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
                f"QueueEndpoint=http://127.0.0.1:{self.port}/{ACCOUNT};")

    def queue(self, name: str | None = None, create: bool = True) -> QueueClient:
        """A plain client, the test's own hands on a queue (a fresh one by default)."""
        client = QueueClient.from_connection_string(self.connection_string, name or new_name(),
                                                    connection_timeout=2, read_timeout=5, retry_total=0)
        if create:
            client.create_queue()
        return client

    def source(self, queue: QueueClient, options: QueueOptions = FAST) -> QueueSource:
        return QueueSource.from_connection_string(self.connection_string, queue.queue_name, options)


def new_name() -> str:
    return "q" + uuid.uuid4().hex[:12]


@pytest.fixture(scope="module")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    peer = Azurite(require_azurite(), tmp_path_factory.mktemp("azurite"))
    yield peer
    peer.stop()


def count(queue: QueueClient) -> int:
    """Messages in the queue, hidden ones included."""
    return int(queue.get_queue_properties().approximate_message_count or 0)


def event(name: str, status: str = "Scheduled", event_id: str | None = None) -> dict[str, Any]:
    """Properties of an event on VM `name`, with an EventId of its own."""
    event_id = event_id or str(uuid.UUID(int=abs(hash((name, status))) % (1 << 128)))
    return properties(event_id=event_id, status=status, resources=(name,))


# --- reading ---------------------------------------------------------------------------------------------

def test_both_schemas_plain_and_base64_single_and_batch_are_received_and_parsed(azurite: Azurite) -> None:
    queue = azurite.queue()
    single_eg = event_grid_event(event("vm-a"), target_id(name="vm-a"), delivery_id="eg-1")
    single_ce = cloud_event(event("vm-b"), target_id(name="vm-b"), delivery_id="ce-1")
    batch = [event_grid_event(event("vm-c"), target_id(name="vm-c"), delivery_id="eg-2"),
             event_grid_event(event("vm-d", "Started"), target_id(name="vm-d"), delivery_id="eg-3"),
             other_event("eg-4")]
    ce_batch = [cloud_event(event("vm-e"), target_id(name="vm-e"), delivery_id="ce-2")]
    sent = {
        "eg plain": json.dumps(single_eg), "eg base64": as_base64(single_eg),
        "ce plain": json.dumps(single_ce), "ce base64": as_base64(single_ce),
        "batch base64": as_base64(batch), "ce batch plain": json.dumps(ce_batch),
        "other only": as_base64(other_event("eg-5")),
    }
    for text in sent.values():
        queue.send_message(text)
    source = azurite.source(queue)

    deliveries = source.receive()
    assert len(deliveries) == len(sent)
    got = sorted((tuple((e.delivery_id, e.resource_id.rsplit("/", 1)[1], e.status) for e in d.events), d.skipped)
                 for d in deliveries)
    assert got == sorted([
        ((("eg-1", "vm-a", "Scheduled"),), 0), ((("eg-1", "vm-a", "Scheduled"),), 0),
        ((("ce-1", "vm-b", "Scheduled"),), 0), ((("ce-1", "vm-b", "Scheduled"),), 0),
        ((("eg-2", "vm-c", "Scheduled"), ("eg-3", "vm-d", "Started")), 1),
        ((("ce-2", "vm-e", "Scheduled"),), 0),
        ((), 1),
    ])
    assert source.stats.received == len(sent) and source.stats.parse_failures == 0
    assert source.stats.state == "ok" and source.stats.last_success is not None

    for delivery in deliveries:  # skipped-only messages too: they have nothing to commit
        assert source.delete(delivery)
    assert count(queue) == 0
    assert source.stats.deleted == len(sent)


def test_a_received_message_stays_until_deleted(azurite: Azurite) -> None:
    queue = azurite.queue()
    queue.send_message(as_base64(event_grid_event()))
    source = azurite.source(queue, QueueOptions(visibility_timeout=30, poll_interval=0.2, max_backoff=0.5))

    (delivery,) = source.receive()
    assert count(queue) == 1, "receiving hides the message, it does not remove it"
    assert source.receive() == [], "hidden for the visibility timeout"
    assert source.delete(delivery)
    assert count(queue) == 0


def test_a_message_comes_back_when_the_process_dies_before_deleting(azurite: Azurite) -> None:
    queue = azurite.queue()
    queue.send_message(as_base64(event_grid_event(delivery_id="eg-crash")))

    first = azurite.source(queue)  # visibility timeout 1 s
    (delivery,) = first.receive()
    first.close()
    del first  # "crashed": the handle is gone without a delete

    second = azurite.source(queue)
    again = wait_until(second.receive, timeout=5, interval=0.2, message="the message to reappear")
    assert [(d.message_id, d.events[0].delivery_id) for d in again] == [(delivery.message_id, "eg-crash")]
    assert again[0].dequeue_count == 2
    assert not second.delete(delivery), "the old handle's lease has ended"
    assert second.stats.delete_failures == 1 and second.stats.state == "ok"
    assert second.delete(again[0])
    assert count(queue) == 0


def test_the_deletes_of_one_receive_go_out_together_and_a_lost_one_is_only_counted(azurite: Azurite) -> None:
    queue = azurite.queue()
    for n in range(20):
        queue.send_message(as_base64(event_grid_event(event(f"vm-{n}"), target_id(name=f"vm-{n}"),
                                                      delivery_id=f"eg-{n}")))
    source = azurite.source(queue, QueueOptions(visibility_timeout=30, poll_interval=0.2, max_backoff=0.5))
    deliveries = source.receive()
    assert len(deliveries) == 20
    stale = replace(deliveries[7], pop_receipt="AAAAAAAAAAAAAAAAAAAAAA==")  # a lease that is no longer ours

    results = source.delete_all([*deliveries[:7], stale, *deliveries[8:]])
    assert results == [True] * 7 + [False] + [True] * 12
    assert source.stats.deleted == 19 and source.stats.delete_failures == 1
    assert count(queue) == 1, "the message whose delete failed stays, to be delivered again"
    source.close()


class ForwardProxy:
    """A plain HTTP forward proxy on a loopback port: forwards each absolute-URI request and notes its URL."""

    def __init__(self) -> None:
        import http.client
        from urllib.parse import urlsplit

        seen: list[str] = []
        self.seen = seen

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def forward(self) -> None:
                seen.append(self.path)
                url = urlsplit(self.path)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                upstream = http.client.HTTPConnection(url.hostname or "", url.port, timeout=10)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("proxy-connection", "host")}
                upstream.request(self.command, url.path + (f"?{url.query}" if url.query else ""), body, headers)
                reply = upstream.getresponse()
                data = reply.read()
                self.send_response(reply.status)
                for name, value in reply.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                upstream.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_proxy_from_the_environment_carries_the_queue_requests_unless_no_proxy_names_the_host(
        azurite: Azurite, monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = ForwardProxy()
    try:
        queue = azurite.queue()
        queue.send_message(as_base64(event_grid_event(delivery_id="eg-proxied")))
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy",
                     "all_proxy", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        source = azurite.source(queue, QueueOptions(visibility_timeout=30, poll_interval=0.2, max_backoff=0.5))
        (delivery,) = source.receive()
        assert delivery.events[0].delivery_id == "eg-proxied"
        assert source.delete(delivery)
        assert count(queue) == 0
        proxied = [url for url in proxy.seen if queue.queue_name in url]
        assert any("/messages" in url for url in proxied), proxy.seen
        source.close()

        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        queue.send_message(as_base64(event_grid_event(delivery_id="eg-direct")))
        before = len(proxy.seen)
        direct = azurite.source(queue, QueueOptions(visibility_timeout=30, poll_interval=0.2, max_backoff=0.5))
        (delivery,) = direct.receive()
        assert direct.delete(delivery)
        assert len(proxy.seen) == before, "NO_PROXY names the host: no request through the proxy"
        direct.close()
    finally:
        proxy.stop()


# --- unreadable messages ---------------------------------------------------------------------------------

def poison_of(azurite: Azurite, queue: QueueClient) -> QueueClient:
    return azurite.queue(queue.queue_name + "-poison", create=False)


def test_an_unreadable_message_is_moved_to_the_poison_queue_with_its_text(azurite: Azurite,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    queue = azurite.queue()
    garbage = ["this is not an event", "neither is this one", '[{"id": 3}]']
    for text in garbage:
        queue.send_message(text)
    queue.send_message(as_base64(event_grid_event(delivery_id="eg-good")))
    source = azurite.source(queue)

    with caplog.at_level(logging.WARNING, logger="forewarn"):
        deliveries = source.receive()
    assert [d.events[0].delivery_id for d in deliveries] == ["eg-good"], "the good message is not held back"
    assert source.stats.parse_failures == 3 and source.stats.poisoned == 3
    poisoned = sorted(m.content for m in poison_of(azurite, queue).peek_messages(max_messages=32))
    assert poisoned == sorted(garbage), "moved with the text unchanged"
    assert count(queue) == 1, "only the good message is left, waiting for its delete"
    warnings = [r.getMessage() for r in caplog.records if r.name == "forewarn.fleet.queue"]
    assert len(warnings) == 2, f"the two plain-text messages share a reason, logged once: {warnings}"
    assert all("cannot be read" in w and queue.queue_name + "-poison" in w for w in warnings)


def sas_source(queue: QueueClient, options: QueueOptions = FAST) -> QueueSource:
    """A source from a queue URL with a SAS for that queue alone: it may not touch the poison queue, as an
    identity with only "Storage Queue Data Message Processor" may not."""
    sas = generate_queue_sas(ACCOUNT, queue.queue_name, ACCOUNT_KEY,
                             permission=QueueSasPermissions(read=True, process=True, update=True),
                             expiry=datetime.now(timezone.utc) + timedelta(hours=1))
    return QueueSource.from_queue_url(f"{queue.url}?{sas}", options=options)


def test_an_unreadable_message_that_cannot_be_moved_stays_and_is_left_after_max_dequeue(azurite: Azurite) -> None:
    queue = azurite.queue()
    queue.send_message("garbage")
    source = sas_source(queue, QueueOptions(visibility_timeout=1, poll_interval=0.2, max_backoff=0.5,
                                            max_dequeue=2, stranded_visibility=600))
    assert source.receive() == []
    assert source.stats.poison_failures == 1 and source.stats.stranded == 0
    assert count(queue) == 1, "a failed move leaves the message where it was"

    wait_until(lambda: source.receive() == [] and source.stats.poison_failures == 2, timeout=5, interval=0.3,
               message="the second delivery")
    assert source.stats.stranded == 1 and source.stats.poisoned == 0
    time.sleep(1.5)  # past the short visibility timeout: a stranded message stays hidden far longer
    assert source.receive() == [] and source.stats.parse_failures == 2
    assert count(queue) == 1, "left in the queue, counted, not lost"
    assert source.stats.state == "ok", "a poison queue out of reach is not a queue outage"


# --- stopping, outages -----------------------------------------------------------------------------------

def test_a_stop_signal_ends_the_wait_between_polls(azurite: Azurite) -> None:
    source = azurite.source(azurite.queue(), QueueOptions(poll_interval=30, max_backoff=60))
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    assert source.poll(stop) == []
    assert time.monotonic() - started < 0.3 + 0.5
    assert source.poll(stop) == [], "a set stop returns at once"


def test_an_outage_is_a_state_with_backoff_and_recovery_follows(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    peer = Azurite(require_azurite(), tmp_path / "azurite")
    try:
        queue = peer.queue()
        source = peer.source(queue)
        stop = threading.Event()
        assert source.poll(stop) == [] and source.stats.state == "ok"
        peer.stop()

        with caplog.at_level(logging.INFO, logger="forewarn"):
            with pytest.raises(QueueUnavailable) as raised:
                source.receive()
            assert raised.value.reason == "unreachable" and raised.value.retryable
            assert "connection refused" in str(raised.value) and queue.url in str(raised.value)
            for _ in range(3):
                assert source.poll(stop) == [], "poll never raises"
            stats = source.stats
            assert (stats.state, stats.reason, stats.consecutive_failures) == ("unavailable", "unreachable", 4)

            peer.start()  # same port, same data
            queue.send_message(as_base64(event_grid_event(delivery_id="eg-after")))
            deliveries = wait_until(lambda: source.poll(stop), timeout=10, message="deliveries after recovery")
        assert [d.events[0].delivery_id for d in deliveries] == ["eg-after"]
        assert source.stats.state == "ok" and source.stats.consecutive_failures == 0
        ours = [r for r in caplog.records if r.name == "forewarn.fleet.queue"]
        assert [r.levelname for r in ours] == ["ERROR", "INFO"], "the outage logged once, then its end"
        assert "recovered" in ours[1].getMessage()
    finally:
        peer.stop()


def test_an_outage_wait_is_cut_short_by_the_stop_signal() -> None:
    source = QueueSource.from_connection_string(unreachable_connection_string(), "events",
                                                QueueOptions(poll_interval=20, max_backoff=60))
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    assert source.poll(stop) == []
    assert time.monotonic() - started < 0.3 + 0.5
    assert source.stats.state == "unavailable"


class _Stalls:
    """A peer that accepts connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]

    def close(self) -> None:
        self.sock.close()


def _answering(status: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = (f'<?xml version="1.0" encoding="utf-8"?><Error><Code>Code{status}</Code>'
                    "<Message>no</Message></Error>").encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def unreachable_connection_string(port: int | None = None) -> str:
    return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
            f"QueueEndpoint=http://127.0.0.1:{port or free_port()}/{ACCOUNT};")


@pytest.mark.parametrize(("peer", "reason"), [("stall", "timeout"), (500, "server_error"), (503, "throttled"),
                                              (403, "denied"), (404, "not_found")])
def test_each_kind_of_failure_has_its_reason(peer: str | int, reason: str) -> None:
    server: Any = _Stalls() if peer == "stall" else _answering(int(peer))
    port = server.port if peer == "stall" else server.server_address[1]
    try:
        source = QueueSource.from_connection_string(unreachable_connection_string(port), "events", FAST)
        started = time.monotonic()
        with pytest.raises(QueueUnavailable) as raised:
            source.receive()
        assert time.monotonic() - started < 3, "bounded by the read timeout"
        assert raised.value.reason == reason, str(raised.value)
        assert source.stats.reason == reason and source.stats.state == "unavailable"
    finally:
        if peer == "stall":
            server.close()
        else:
            server.shutdown()
            server.server_close()


# --- secrets ---------------------------------------------------------------------------------------------

def test_the_connection_string_never_reaches_logs_or_errors(azurite: Azurite, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, the SDK's included
    queue = azurite.queue()
    queue.send_message("garbage")
    source = azurite.source(queue)
    texts = []
    source.receive()
    down = QueueSource.from_connection_string(unreachable_connection_string(), "events", FAST)
    with pytest.raises(QueueUnavailable) as raised:
        down.receive()
    texts += [str(raised.value), str(down.stats), str(source.stats)]
    with pytest.raises(ConfigError) as bad:
        QueueSource.from_connection_string(f"AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};Nonsense", "events")
    texts.append(str(bad.value))
    with pytest.raises(ConfigError, match="AccountKey is not base64") as bad:
        QueueSource.from_connection_string(f"AccountName={ACCOUNT};AccountKey=not*{ACCOUNT_KEY}", "events")
    texts.append(str(bad.value))
    texts.append(caplog.text)
    for text in texts:
        assert ACCOUNT_KEY not in text and ACCOUNT_KEY[:20] not in text


def test_a_sas_url_is_logged_without_its_query(azurite: Azurite, caplog: pytest.LogCaptureFixture) -> None:
    queue = azurite.queue()
    queue.send_message("garbage")
    queue.send_message(as_base64(event_grid_event()))
    source = sas_source(queue)
    with caplog.at_level(logging.DEBUG, logger="forewarn"):
        (delivery,) = source.receive()
        assert source.delete(delivery)
    assert source.url == f"{queue.url}?<redacted>"
    ours = " ".join(r.getMessage() for r in caplog.records if r.name.startswith("forewarn"))
    assert queue.url in ours, "the unreadable message's warning names the queue"
    assert "sig=" not in ours and "sig=" not in str(source.stats)
    assert source.stats.poison_failures == 1 and count(queue) == 1


def test_the_connection_string_comes_from_the_variable_or_a_file(tmp_path: Path) -> None:
    secret = tmp_path / "queue.secret"
    secret.write_text("  AccountName=a;AccountKey=k  \n")
    assert connection_string_from(str(secret), environ={}) == "AccountName=a;AccountKey=k"
    assert connection_string_from(str(secret), environ={CONNECTION_STRING_ENV: "from-env"}) == "from-env"
    assert connection_string_from(None, environ={}) is None
    with pytest.raises(ConfigError, match="cannot read"):
        connection_string_from(str(tmp_path / "missing"), environ={})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        connection_string_from(str(tmp_path / "empty"), environ={})


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"visibility_timeout": 0}, "visibility_timeout"),
    ({"max_messages": 33}, "max_messages"),
    ({"poll_interval": 5, "max_backoff": 1}, "max_backoff"),
])
def test_options_out_of_range_are_refused_by_name(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        QueueOptions(**kwargs)


@pytest.mark.parametrize("name", ["UPPER", "a", "two--hyphens", "x" * 57])
def test_queue_names_are_checked_with_their_poison_queue(name: str) -> None:
    with pytest.raises(ConfigError, match="not valid"):
        QueueSource.from_connection_string(unreachable_connection_string(), name)
