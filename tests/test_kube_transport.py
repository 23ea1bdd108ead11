"""The Kubernetes client's transport (forewarn.node.transport): the real lightkube client over it, against
the strict API stand-in for the ordinary path and a hostile peer on raw sockets for what no API server
should do (trickle, hang, an endless or huge answer, a dropped kept-alive connection)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from lightkube import Client, KubeConfig
from lightkube.config.models import Cluster, User
from lightkube.resources.core_v1 import Node
from lightkube.types import PatchType

from forewarn.node.transport import DeadlineTransport, ReplyTooLarge

from peers.hostile_imds import Hang, HostileImds, Huge, Reply, Trickle
from peers.kube_api import KubeApi

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_ROLE = ROOT / "deploy" / "kubernetes" / "components" / "node-actions" / "clusterrole.yaml"


class Halted(Exception):
    """What the transport raises when its stop signal is set."""


def client_for(server: str, kubeconfig: Path | None = None, *, timeout: float = 10.0,
               stop: threading.Event | None = None, max_reply_bytes: int = 2**20) -> Client:
    transport = DeadlineTransport(server, None, timeout=timeout, stop=stop or threading.Event(),
                                  stopped=Halted, max_reply_bytes=max_reply_bytes)
    if kubeconfig is None:
        config = KubeConfig.from_one(cluster=Cluster(server=server), user=User(token="hostile-peer-token"))
    else:
        config = KubeConfig.from_file(kubeconfig)
    return Client(config, transport=transport, trust_env=False, field_manager="forewarn")


@pytest.fixture
def api() -> Iterator[KubeApi]:
    with KubeApi(cluster_role=CLUSTER_ROLE) as server:
        yield server


@pytest.fixture
def hostile() -> Iterator[HostileImds]:
    peer = HostileImds()
    try:
        yield peer
    finally:
        peer.stop()


def test_the_real_client_reads_and_patches_through_it_on_one_kept_alive_connection(
        api: KubeApi, tmp_path: Path) -> None:
    api.add_node("aks-1")
    client = client_for(api.url, api.kubeconfig(tmp_path / "kubeconfig"))
    for _ in range(5):
        assert client.get(Node, "aks-1").metadata.name == "aks-1"  # type: ignore[union-attr]
    client.patch(Node, "aks-1", {"spec": {"unschedulable": True}}, patch_type=PatchType.MERGE)
    assert api.node("aks-1")["spec"]["unschedulable"] is True
    # the bearer token went through (the stand-in checks RBAC against it) and 404s are API errors
    with pytest.raises(Exception, match="not found"):
        client.get(Node, "missing")
    sent = [r for r in api.requests if r.path.startswith("/api/v1/nodes")]
    assert len(sent) == 7
    client.close()


def test_a_trickled_answer_ends_at_the_deadline_not_at_each_reads_timeout(hostile: HostileImds) -> None:
    # 200 bytes at one every 0.2 s would take 40 s; each read gets a byte well within any socket timeout
    hostile.behaviour = Trickle(b'{"kind": "Node", "apiVersion": "v1", "metadata": {"name": "x"}}' + b" " * 130,
                                interval=0.2)
    client = client_for(hostile.url, timeout=2.0)
    started = time.monotonic()
    with pytest.raises(httpx2.ReadTimeout, match="no complete answer within 2 s"):
        client.get(Node, "x")
    assert time.monotonic() - started < 8


def test_a_stop_signal_ends_a_hung_request(hostile: HostileImds) -> None:
    hostile.behaviour = Hang()
    stop = threading.Event()
    client = client_for(hostile.url, timeout=60.0, stop=stop)
    threading.Timer(0.5, stop.set).start()
    started = time.monotonic()
    with pytest.raises(Halted):
        client.get(Node, "x")
    assert time.monotonic() - started < 5


def test_an_answer_over_the_cap_is_refused_and_its_connection_dropped(hostile: HostileImds) -> None:
    hostile.behaviour = Huge(size=5 * 2**20)
    client = client_for(hostile.url, max_reply_bytes=2**20)
    with pytest.raises(ReplyTooLarge, match="exceeds 1048576 bytes"):
        client.get(Node, "x")
    # and the next request, on a new connection, works
    hostile.behaviour = Reply(body={"kind": "Node", "apiVersion": "v1", "metadata": {"name": "x"}})
    assert client.get(Node, "x").metadata.name == "x"  # type: ignore[union-attr]


def test_a_kept_alive_connection_the_server_closed_is_replaced_once(api: KubeApi, hostile: HostileImds) -> None:
    node = {"kind": "Node", "apiVersion": "v1", "metadata": {"name": "x"}}
    hostile.behaviour = Reply(body=node)
    client = client_for(hostile.url)
    assert client.get(Node, "x").metadata.name == "x"  # type: ignore[union-attr]
    hostile.close_connections()      # the server drops the idle kept-alive connection
    assert client.get(Node, "x").metadata.name == "x"  # type: ignore[union-attr]
    assert len(hostile.requests) == 2


def test_a_refused_connection_is_a_transport_error_that_names_no_secret(tmp_path: Path) -> None:
    client = client_for("http://127.0.0.1:9")
    with pytest.raises(httpx2.ConnectError) as raised:
        client.get(Node, "x")
    assert "Connection refused" in str(raised.value) and "hostile-peer-token" not in str(raised.value)


def test_an_https_server_needs_a_tls_context() -> None:
    with pytest.raises(ValueError, match="needs a TLS context"):
        DeadlineTransport("https://127.0.0.1:6443", None, timeout=1, stop=threading.Event(), stopped=Halted)
