"""The Resource Graph client against a strict ARM stand-in over TLS on loopback (tests/peers/arm.py).

Most tests hand the client a credential with a fixed token (azure-core's TokenCredential protocol); one
uses the real azure-identity ManagedIdentityCredential pointed at the stand-in's IMDS token endpoint
(AZURE_POD_IDENTITY_AUTHORITY_HOST), trusting the stand-in's CA through REQUESTS_CA_BUNDLE as a user would.
"""

from __future__ import annotations

import http.client
import json
import logging
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from azure.core.credentials import AccessToken

from forewarn.fleet.resourcegraph import (
    ALL_STATUSES,
    DEFAULT_QUERY,
    ResourceGraphClient,
    ResourceGraphError,
    Stopped,
    parse_resets_after,
    scheduled_events_query,
)

from peers.arm import RESOURCES_PATH, ArmPeer
from peers.pki import Authority

TOKEN = "SECRET-ARM-TOKEN-eyJ0eXAiOiJKV1Qi"


class FixedToken:
    """A TokenCredential that hands out its tokens in turn (the last one from then on) and counts calls."""

    def __init__(self, *tokens: str, lifetime: int = 3600) -> None:
        self.tokens = list(tokens or (TOKEN,))
        self.lifetime = lifetime
        self.calls: list[tuple[str, ...]] = []

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        self.calls.append(scopes)
        token = self.tokens[min(len(self.calls), len(self.tokens)) - 1]
        return AccessToken(token, int(time.time()) + self.lifetime)


def subscription(n: int) -> str:
    return str(uuid.UUID(int=n + 1))


def event_row(sub: str, n: int) -> dict[str, Any]:
    event_id = str(uuid.UUID(int=10_000 + n))
    target = f"/subscriptions/{sub}/resourceGroups/rg-{n % 3}/providers/Microsoft.Compute/virtualMachines/vm-{n}"
    return {"id": f"{target}/providers/Microsoft.Maintenance/scheduledevents/{event_id}", "name": event_id,
            "subscriptionId": sub, "resourceGroup": f"rg-{n % 3}", "location": "westeurope",
            "properties": {"EventId": event_id, "EventType": "Reboot", "ResourceType": "VirtualMachine",
                           "Resources": [f"vm-{n}"], "EventStatus": "Scheduled",
                           "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT", "Description": "", "EventSource": "Platform",
                           "DurationInSeconds": -1}}


@pytest.fixture(scope="module")
def authority() -> Authority:
    return Authority("arm-test-ca")


@pytest.fixture
def peer(authority: Authority) -> Iterator[ArmPeer]:
    arm = ArmPeer(authority, token=TOKEN, rows=[event_row(subscription(0), n) for n in range(7)])
    yield arm
    arm.stop()


@pytest.fixture
def stop() -> threading.Event:
    return threading.Event()


@pytest.fixture
def client(peer: ArmPeer, authority: Authority,
           stop: threading.Event) -> Iterator[Callable[..., ResourceGraphClient]]:
    made: list[ResourceGraphClient] = []

    def make(credential: Any = None, **options: Any) -> ResourceGraphClient:
        settings: dict[str, Any] = {"timeout": 2.0, "max_wait": 2.0, "stop": stop,
                                    "context": ssl.create_default_context(cadata=authority.pem.decode())}
        made.append(ResourceGraphClient(peer.base, credential or FixedToken(), **{**settings, **options}))
        return made[-1]

    yield make
    for one in made:
        one.close()


def raw(peer: ArmPeer, authority: Authority, method: str, path: str, body: Any = None,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """One request to the stand-in as any client could send it."""
    conn = http.client.HTTPSConnection("127.0.0.1", int(peer.base.rsplit(":", 1)[1]), timeout=5,
                                       context=ssl.create_default_context(cadata=authority.pem.decode()))
    try:
        payload = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=payload, headers=headers or {})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        conn.close()


# --- pages and batches ----------------------------------------------------------------------------------
def test_each_page_is_converted_before_the_next_is_asked_for_and_left_out_rows_are_counted(
        peer: ArmPeer, client: Callable[..., ResourceGraphClient]) -> None:
    requests_when_converted: list[int] = []

    def convert(row: dict[str, Any]) -> str | None:
        requests_when_converted.append(len(peer.received.statuses))
        return None if row["id"] == peer.rows[4]["id"] else row["id"]

    snap = client(page_size=3).snapshot(subscriptions=[subscription(0)], convert=convert)
    assert list(snap.rows) == [row["id"] for n, row in enumerate(peer.rows) if n != 4]
    assert (snap.rows_read, snap.left_out, snap.pages, snap.total_records) == (7, 1, 3, 7)
    assert requests_when_converted == [1, 1, 1, 2, 2, 2, 3], "a page's rows become values before the next request"


def test_rows_on_three_pages_arrive_whole_and_in_order(peer: ArmPeer,
                                                       client: Callable[..., ResourceGraphClient]) -> None:
    snap = client(page_size=3).snapshot(subscriptions=[subscription(0)])
    assert list(snap.rows) == peer.rows
    assert (snap.pages, snap.requests, snap.batches, snap.total_records, snap.warnings) == (3, 3, 1, 7, ())
    assert peer.received.errors == [] and peer.received.statuses == [200, 200, 200]
    first, *rest = peer.received.queries
    assert first == {"subscriptions": [subscription(0)], "query": DEFAULT_QUERY,
                     "options": {"$top": 3, "resultFormat": "objectArray"}}
    for later in rest:  # the same request, with the token of the page before
        assert {k: v for k, v in later.items() if k != "options"} == {k: v for k, v in first.items() if k != "options"}
        assert later["options"]["$top"] == 3 and later["options"]["$skipToken"]
    assert rest[0]["options"]["$skipToken"] != rest[1]["options"]["$skipToken"]


def test_250_subscriptions_are_asked_in_three_batches_of_the_right_scopes(
        peer: ArmPeer, client: Callable[..., ResourceGraphClient]) -> None:
    subs = [subscription(n) for n in range(250)]
    peer.rows = [event_row(sub, n) for n, sub in enumerate(subs)]
    snap = client(batch_size=100).snapshot(subscriptions=[*subs, subs[0]])  # a repeat is asked once
    assert [q["subscriptions"] for q in peer.received.queries] == [subs[:100], subs[100:200], subs[200:]]
    assert list(snap.rows) == peer.rows
    assert (snap.batches, snap.pages, snap.requests, snap.total_records) == (3, 3, 3, 250)


def test_management_groups_are_a_scope_too(peer: ArmPeer, client: Callable[..., ResourceGraphClient]) -> None:
    peer.rows = [event_row(subscription(n), n) for n in range(3)]
    peer.groups = {"mg-a": [subscription(0)], "mg-b": [subscription(2)]}
    snap = client().snapshot(management_groups=["mg-a", "mg-b"])
    assert [row["subscriptionId"] for row in snap.rows] == [subscription(0), subscription(2)]
    assert peer.received.queries[0]["managementGroups"] == ["mg-a", "mg-b"]


def test_a_truncated_result_without_a_skip_token_is_reported(peer: ArmPeer,
                                                             client: Callable[..., ResourceGraphClient]) -> None:
    # As Resource Graph does: a projection without id cannot be paged, so the rest is cut off.
    snap = client(page_size=3).snapshot(subscriptions=[subscription(0)],
                                        query="maintenanceresources | project name, properties")
    assert len(snap.rows) == 3 and snap.total_records == 7
    assert len(snap.warnings) == 1 and "resultTruncated" in snap.warnings[0] and "rows are missing" in snap.warnings[0]


# --- throttling and failures ------------------------------------------------------------------------------
def test_a_429_is_retried_after_its_retry_after(peer: ArmPeer, client: Callable[..., ResourceGraphClient]) -> None:
    peer.faults.throttle, peer.faults.retry_after = 1, "1"
    snap = client().snapshot(subscriptions=[subscription(0)])
    assert len(snap.rows) == 7 and (snap.throttled, snap.requests, snap.pages) == (1, 2, 1)
    assert peer.received.statuses == [429, 200]
    assert peer.received.times[1] - peer.received.times[0] >= 0.95


def test_5xx_is_retried_then_the_rows_arrive(peer: ArmPeer, client: Callable[..., ResourceGraphClient]) -> None:
    peer.faults.fail, peer.faults.fail_status, peer.faults.fail_retry_after = 2, 500, "0.1"
    snap = client().snapshot(subscriptions=[subscription(0)])
    assert len(snap.rows) == 7 and snap.requests == 3 and peer.received.statuses == [500, 500, 200]


def test_persistent_5xx_fails_naming_endpoint_and_status_not_the_token(
        peer: ArmPeer, client: Callable[..., ResourceGraphClient], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    peer.faults.fail, peer.faults.fail_status = 100, 503
    with pytest.raises(ResourceGraphError) as failed:
        client(attempts=3, max_wait=0.05).snapshot(subscriptions=[subscription(0)])
    message = str(failed.value)
    assert f"{peer.base}{RESOURCES_PATH}" in message and "HTTP 503 after 3 attempts" in message
    assert failed.value.status == 503 and failed.value.retryable
    assert peer.received.statuses == [503] * 3
    assert TOKEN not in message and TOKEN not in repr(failed.value.args)
    assert len([r for r in caplog.records if "trying again" in r.getMessage()]) == 2
    assert all(TOKEN not in r.getMessage() for r in caplog.records) and TOKEN not in caplog.text


def test_a_spent_quota_makes_the_client_wait_instead_of_being_throttled(
        peer: ArmPeer, client: Callable[..., ResourceGraphClient]) -> None:
    peer.faults.quota_limit, peer.faults.quota_window = 2, 1.0
    snap = client(page_size=3).snapshot(subscriptions=[subscription(0)])
    assert len(snap.rows) == 7 and snap.pages == 3
    assert snap.quota_waits == 1 and snap.throttled == 0 and peer.received.over_quota == 0
    times = peer.received.times
    assert times[2] - times[1] >= 0.5, "the third page waited for the quota to return"
    assert snap.quota_remaining == 1 and snap.quota_resets_after is not None and 0 < snap.quota_resets_after <= 1


def test_quota_headers_are_reported(peer: ArmPeer, client: Callable[..., ResourceGraphClient]) -> None:
    peer.faults.quota_limit, peer.faults.quota_window = 15, 5.0
    snap = client(page_size=3).snapshot(subscriptions=[subscription(0)])
    assert snap.quota_remaining == 12 and snap.quota_resets_after is not None and 4 <= snap.quota_resets_after <= 5
    assert snap.quota_waits == 0


@pytest.mark.parametrize(("text", "seconds"), [("00:00:05", 5.0), ("00:01:00", 60.0), ("1.02:00:00", 93600.0),
                                               ("00:00:01.500", 1.5), (" 00:00:03 ", 3.0), ("5", None),
                                               ("soon", None), ("", None), (None, None)])
def test_resets_after_is_read_as_a_time_span(text: str | None, seconds: float | None) -> None:
    assert parse_resets_after(text) == seconds


# --- deadlines, stops, sizes ------------------------------------------------------------------------------
def test_a_hung_request_ends_at_its_deadline(peer: ArmPeer, client: Callable[..., ResourceGraphClient]) -> None:
    peer.faults.hang = True
    started = time.monotonic()
    with pytest.raises(ResourceGraphError, match=r"no complete answer within 1 s") as failed:
        client(timeout=1.0).snapshot(subscriptions=[subscription(0)])
    assert 0.9 <= time.monotonic() - started < 1.6 and failed.value.retryable


def test_a_trickled_reply_ends_at_its_deadline(peer: ArmPeer, client: Callable[..., ResourceGraphClient]) -> None:
    peer.faults.trickle = 0.05  # a byte every 50 ms: each read succeeds, the whole never arrives in time
    started = time.monotonic()
    with pytest.raises(ResourceGraphError, match=r"no complete answer within 1 s"):
        client(timeout=1.0).snapshot(subscriptions=[subscription(0)])
    assert time.monotonic() - started < 1.6


def test_stop_ends_a_hung_request_at_once(peer: ArmPeer, client: Callable[..., ResourceGraphClient],
                                          stop: threading.Event) -> None:
    peer.faults.hang = True
    rg = client(timeout=30.0)
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    with pytest.raises(Stopped):
        rg.snapshot(subscriptions=[subscription(0)])
    assert time.monotonic() - started < 0.3 + 0.5


def test_stop_ends_a_retry_after_wait_at_once(peer: ArmPeer, client: Callable[..., ResourceGraphClient],
                                              stop: threading.Event) -> None:
    peer.faults.throttle, peer.faults.retry_after = 1, "30"
    rg = client(max_wait=60.0)
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    with pytest.raises(Stopped):
        rg.snapshot(subscriptions=[subscription(0)])
    assert time.monotonic() - started < 0.3 + 0.5 and peer.received.statuses == [429]


def test_stop_ends_a_wait_for_a_token(peer: ArmPeer, client: Callable[..., ResourceGraphClient],
                                      stop: threading.Event) -> None:
    release = threading.Event()

    class Hanging(FixedToken):
        def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
            release.wait(10)
            return super().get_token(*scopes)

    try:
        rg = client(Hanging())
        threading.Timer(0.3, stop.set).start()
        started = time.monotonic()
        with pytest.raises(Stopped):
            rg.snapshot(subscriptions=[subscription(0)])
        assert time.monotonic() - started < 0.3 + 0.5
        stop.clear()
        started = time.monotonic()
        with pytest.raises(ResourceGraphError, match=r"no token for https://127\.0\.0\.1:\d+/\.default within 0\.5 s"):
            client(Hanging(), token_timeout=0.5).snapshot(subscriptions=[subscription(0)])
        assert time.monotonic() - started < 1.0 and peer.received.queries == []
    finally:
        release.set()


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "until-close"])
def test_an_oversized_reply_is_refused(peer: ArmPeer, client: Callable[..., ResourceGraphClient],
                                       declared: bool) -> None:
    peer.faults.oversize, peer.faults.oversize_declared = 300_000, declared
    with pytest.raises(ResourceGraphError, match=r"reply larger than 100000 bytes \(max_reply_bytes\)"):
        client(max_reply_bytes=100_000).snapshot(subscriptions=[subscription(0)])


def test_a_reply_that_is_not_json_is_refused(peer: ArmPeer, client: Callable[..., ResourceGraphClient]) -> None:
    peer.faults.bad_json = True
    with pytest.raises(ResourceGraphError, match=r"reply is not JSON") as failed:
        client().snapshot(subscriptions=[subscription(0)])
    assert f"{peer.base}{RESOURCES_PATH}" in str(failed.value)


def test_a_reply_of_the_wrong_shape_is_refused(peer: ArmPeer, client: Callable[..., ResourceGraphClient]) -> None:
    peer.faults.bad_shape = True  # the table format's shape, where objectArray was asked for
    with pytest.raises(ResourceGraphError, match=r"no data array \(resultFormat objectArray was asked for\)"):
        client().snapshot(subscriptions=[subscription(0)])


# --- tokens -------------------------------------------------------------------------------------------------
def test_the_stand_in_refuses_a_wrong_token_and_the_error_does_not_carry_it(
        peer: ArmPeer, client: Callable[..., ResourceGraphClient], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = "SECRET-WRONG-TOKEN"
    credential = FixedToken(wrong)
    with pytest.raises(ResourceGraphError) as failed:
        client(credential).snapshot(subscriptions=[subscription(0)])
    assert failed.value.status == 401 and "HTTP 401" in str(failed.value) and not failed.value.retryable
    assert len(credential.calls) == 2, "a 401 asks the credential once more"
    assert peer.received.errors == ["401 AuthenticationFailed: missing or invalid bearer token"] * 2
    for text in (str(failed.value), caplog.text):
        assert wrong not in text and TOKEN not in text


def test_a_401_gets_a_fresh_token_once(peer: ArmPeer, client: Callable[..., ResourceGraphClient]) -> None:
    credential = FixedToken("SECRET-REVOKED", TOKEN)
    snap = client(credential).snapshot(subscriptions=[subscription(0)])
    assert len(snap.rows) == 7 and peer.received.statuses == [401, 200] and len(credential.calls) == 2


def test_the_token_is_cached_until_near_its_expiry(peer: ArmPeer, client: Callable[..., ResourceGraphClient]) -> None:
    credential = FixedToken()
    rg = client(credential, page_size=3)
    rg.snapshot(subscriptions=[subscription(0)])
    rg.snapshot(subscriptions=[subscription(0)])
    assert credential.calls == [(f"{peer.base}/.default",)]
    short = FixedToken(lifetime=60)  # inside the refresh margin: asked for again before each request
    client(short, page_size=3).snapshot(subscriptions=[subscription(0)])
    assert len(short.calls) == 3


def test_a_managed_identity_token_from_imds_reaches_resource_graph(
        peer: ArmPeer, authority: Authority, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        stop: threading.Event, caplog: pytest.LogCaptureFixture) -> None:
    from azure.identity import ManagedIdentityCredential

    caplog.set_level(logging.DEBUG)
    bundle = tmp_path / "ca.pem"
    bundle.write_bytes(authority.pem)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(bundle))       # the token request (requests) and the client
    monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", peer.base)
    credential = ManagedIdentityCredential(client_id="00000000-0000-0000-0000-00000000c11d")
    rg = ResourceGraphClient(peer.base, credential, timeout=2.0, page_size=3, stop=stop)  # default TLS trust
    try:
        snap = rg.snapshot(subscriptions=[subscription(0)])
    finally:
        rg.close()
        credential.close()
    assert list(snap.rows) == peer.rows and peer.received.errors == []
    assert peer.received.tokens_issued == 1
    assert TOKEN not in caplog.text


# --- the query, the arguments, the stand-in's own checks ---------------------------------------------------
def test_the_default_query_asks_for_open_events_and_keeps_id() -> None:
    assert "microsoft.maintenance/scheduledevents" in DEFAULT_QUERY
    assert '("Scheduled", "Started")' in DEFAULT_QUERY
    assert "| project id, " in DEFAULT_QUERY
    history = scheduled_events_query(None)
    assert "EventStatus" not in history and "| project id, " in history
    assert '"Completed", "Canceled"' in scheduled_events_query(ALL_STATUSES)
    with pytest.raises(ValueError, match="statuses"):
        scheduled_events_query(['Started") | union (Resources'])


def test_arguments_are_checked_before_any_request(peer: ArmPeer, client: Callable[..., ResourceGraphClient]) -> None:
    rg = client()
    for bad in ({}, {"subscriptions": [subscription(0)], "management_groups": ["mg"]}, {"subscriptions": []},
                {"subscriptions": subscription(0)}, {"subscriptions": [subscription(0)], "query": " "}):
        with pytest.raises(ValueError):
            rg.snapshot(**bad)
    for endpoint in ("http://127.0.0.1:1", "https://127.0.0.1:1/sub", "management.azure.com"):
        with pytest.raises(ValueError, match="https base URL"):
            ResourceGraphClient(endpoint, FixedToken())
    with pytest.raises(ValueError, match="page_size"):
        client(page_size=1001)
    assert peer.received.times == []


def test_a_wrong_api_version_is_refused_by_the_stand_in(peer: ArmPeer,
                                                        client: Callable[..., ResourceGraphClient]) -> None:
    with pytest.raises(ResourceGraphError, match=r"HTTP 400 \(.*InvalidApiVersionParameter") as failed:
        client(api_version="2021-03-01").snapshot(subscriptions=[subscription(0)])
    assert failed.value.status == 400 and peer.received.statuses == [400]


@pytest.mark.parametrize(("method", "path", "body", "status", "reason"), [
    ("POST", "/providers/Microsoft.ResourceGraph/resourcez?api-version=2024-04-01", {}, 404, "no route"),
    ("GET", f"{RESOURCES_PATH}?api-version=2024-04-01", None, 405, "only POST"),
    ("POST", RESOURCES_PATH, {}, 400, "api-version"),
    ("POST", f"{RESOURCES_PATH}?api-version=2024-04-01", [], 400, "not a JSON object"),
    ("POST", f"{RESOURCES_PATH}?api-version=2024-04-01", {"query": "maintenanceresources"}, 400,
     "subscriptions or managementGroups"),
    ("POST", f"{RESOURCES_PATH}?api-version=2024-04-01", {"subscriptions": ["not-a-guid"],
                                                          "query": "maintenanceresources"}, 400, "GUIDs"),
    ("POST", f"{RESOURCES_PATH}?api-version=2024-04-01", {"subscriptions": [subscription(0)],
                                                          "query": "Resources"}, 400, "maintenanceresources"),
    ("POST", f"{RESOURCES_PATH}?api-version=2024-04-01", {"subscriptions": [subscription(0)],
     "query": "maintenanceresources", "options": {"$top": 5000}}, 400, "$top"),
    ("POST", f"{RESOURCES_PATH}?api-version=2024-04-01", {"subscriptions": [subscription(0)],
     "query": "maintenanceresources", "options": {"resultFormat": "table"}}, 400, "objectArray"),
    ("POST", f"{RESOURCES_PATH}?api-version=2024-04-01", {"subscriptions": [subscription(0)],
     "query": "maintenanceresources", "options": {"$skipToken": "bm9wZQ"}}, 400, "skipToken"),
    ("POST", f"{RESOURCES_PATH}?api-version=2024-04-01", {"subscriptions": [subscription(n) for n in range(301)],
     "query": "maintenanceresources"}, 400, "at most 300"),
    ("GET", "/metadata/identity/oauth2/token?api-version=2018-02-01&resource=https://management.azure.com", None,
     400, "issues tokens for"),
])
def test_the_stand_in_refuses_what_arm_would(peer: ArmPeer, authority: Authority, method: str, path: str,
                                             body: Any, status: int, reason: str) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json", "Metadata": "true"}
    got, answer = raw(peer, authority, method, path, body, headers)
    assert got == status and reason in answer["error"]["message"]
    assert len(peer.received.errors) == 1 and reason in peer.received.errors[0]


def test_the_stand_in_refuses_a_skip_token_of_another_query(peer: ArmPeer, authority: Authority) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    path = f"{RESOURCES_PATH}?api-version=2024-04-01"
    first = {"subscriptions": [subscription(0)], "query": DEFAULT_QUERY, "options": {"$top": 2}}
    status, page = raw(peer, authority, "POST", path, first, headers)
    assert status == 200 and page["count"] == 2 and page["$skipToken"]
    other = {**first, "query": "maintenanceresources | project id", "options": {"$skipToken": page["$skipToken"]}}
    status, answer = raw(peer, authority, "POST", path, other, headers)
    assert status == 400 and "another query" in answer["error"]["message"]
