"""The Event Grid push route (fleet/push.py) on a real HttpServer on loopback: both validation handshakes,
deliveries in both schemas committed before the 200, the shared secret, the bounds, and the answers Event
Grid retries (503) or gives up on (400, 401, 413); once over TLS with a web configuration file."""

from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import requests
import yaml

from fleet_samples import SUB, cloud_event, event_grid_event, other_event, properties, target_id
from forewarn.fleet import push
from forewarn.fleet.feed import FleetEvent
from forewarn.fleet.push import EVENT_GRID_ORIGIN, RESULTS, VALIDATION_EVENT, add_eventgrid_route
from forewarn.web.config import WebGate
from forewarn.web.server import HttpServer

from peers.pki import Authority

SECRET = "4f1c9a7e2b6d0853c1e7a9f24b6d8e01"
EVENT_GRID_JSON = "application/json"
CLOUDEVENT = "application/cloudevents+json"
CLOUDEVENT_BATCH = "application/cloudevents-batch+json"


@dataclass
class Committer:
    """A stand-in for FleetCommitter.news: records what it was given; can fail, or wait to be let go."""

    batches: list[tuple[FleetEvent, ...]] = field(default_factory=list)
    results: list[str] = field(default_factory=list)
    failing: bool = False
    hold: threading.Event | None = None
    entered: threading.Event = field(default_factory=threading.Event)

    def news(self, events: Sequence[FleetEvent]) -> None:
        self.entered.set()
        if self.hold is not None:
            assert self.hold.wait(10)
        if self.failing:
            raise OSError("disk full (a test's failure)")
        self.batches.append(tuple(events))

    @property
    def events(self) -> list[FleetEvent]:
        return [event for batch in self.batches for event in batch]


@dataclass
class Push:
    server: HttpServer
    committer: Committer

    def url(self, secret: str | None = SECRET, path: str = "/eventgrid") -> str:
        return self.server.url + path + ("" if secret is None else f"?code={secret}")

    def post(self, body: Any, content_type: str = EVENT_GRID_JSON, secret: str | None = SECRET,
             headers: dict[str, str] | None = None) -> requests.Response:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return requests.post(self.url(secret), data=data, timeout=10,
                             headers={"Content-Type": content_type, **(headers or {})})


@pytest.fixture
def serve() -> Iterator[Callable[..., Push]]:
    started: list[HttpServer] = []

    def start(committer: Committer | None = None, gate: WebGate | None = None, **options: Any) -> Push:
        committer = committer or Committer()
        server = HttpServer("127.0.0.1", 0, read_timeout=2.0, gate=gate)
        add_eventgrid_route(server, secret=SECRET, accept=committer.news, on_result=committer.results.append,
                            **options)
        server.start()
        started.append(server)
        return Push(server, committer)

    yield start
    for server in started:
        server.stop()


def validation_event(code: str = "512d38b6-c7b8-40c8-89fe-f46f9e9622b6") -> dict[str, Any]:
    return {
        "id": "2d1781af-3a4c-4d7c-bd0c-e34b19da4e66", "topic": f"/subscriptions/{SUB}/resourceGroups/rg-fleet/"
        "providers/Microsoft.EventGrid/systemTopics/maintenance", "subject": "", "eventType": VALIDATION_EVENT,
        "eventTime": "2025-10-14T09:00:00Z", "dataVersion": "2", "metadataVersion": "1",
        "data": {"validationCode": code, "validationUrl": "https://rp-westeurope.eventgrid.azure.net:553/"
                 "eventsubscriptions/fleet/validate?id=512D38B6&t=2025-10-14T09:00:00Z&apiVersion=2025-02-15"},
    }


# --- deliveries --------------------------------------------------------------------------------------------

def test_an_event_grid_delivery_is_committed_and_answered_200(serve: Callable[..., Push]) -> None:
    push_ = serve()
    answer = push_.post([event_grid_event(delivery_id="eg-1")])
    assert answer.status_code == 200
    [event] = push_.committer.events
    assert event.delivery_id == "eg-1" and event.resource_id == target_id() and event.status == "Scheduled"
    assert push_.committer.results == ["accepted"]


@pytest.mark.parametrize(("content_type", "body", "ids"), [
    (CLOUDEVENT, cloud_event(delivery_id="ce-1"), ["ce-1"]),
    (CLOUDEVENT_BATCH, [cloud_event(properties(event_id="E-1"), delivery_id="ce-1"),
                        cloud_event(properties(event_id="E-2"), delivery_id="ce-2")], ["ce-1", "ce-2"]),
    (EVENT_GRID_JSON + "; charset=utf-8", [event_grid_event(delivery_id="eg-1"),
                                           event_grid_event(properties(event_id="E-2"), delivery_id="eg-2")],
     ["eg-1", "eg-2"]),
], ids=["cloudevent", "cloudevents-batch", "event-grid-batch"])
def test_both_schemas_single_and_batch_are_committed_in_order(serve: Callable[..., Push], content_type: str,
                                                              body: Any, ids: list[str]) -> None:
    push_ = serve()
    assert push_.post(body, content_type).status_code == 200
    assert len(push_.committer.batches) == 1  # one delivery, one commit
    assert [event.delivery_id for event in push_.committer.events] == ids


def test_the_200_comes_only_after_accept_returned(serve: Callable[..., Push]) -> None:
    committer = Committer(hold=threading.Event())
    push_ = serve(committer)
    answers: list[requests.Response] = []
    poster = threading.Thread(target=lambda: answers.append(push_.post([event_grid_event()])))
    poster.start()
    assert committer.entered.wait(5)
    time.sleep(0.3)
    assert answers == [] and committer.batches == []  # accept has not returned: no answer yet
    assert committer.hold is not None
    committer.hold.set()
    poster.join(5)
    assert [a.status_code for a in answers] == [200]
    assert len(committer.events) == 1


def test_a_failed_commit_is_503_so_event_grid_retries_and_the_retry_is_taken(serve: Callable[..., Push]) -> None:
    committer = Committer(failing=True)
    push_ = serve(committer)
    assert push_.post([event_grid_event(delivery_id="eg-1")]).status_code == 503
    assert committer.events == [] and committer.results == ["failed"]
    committer.failing = False
    assert push_.post([event_grid_event(delivery_id="eg-1")]).status_code == 200
    assert [e.delivery_id for e in committer.events] == ["eg-1"]
    assert committer.results == ["failed", "accepted"]


def test_past_max_concurrent_commits_a_delivery_is_503_and_leaves_workers_free(serve: Callable[..., Push]) -> None:
    committer = Committer(hold=threading.Event())
    push_ = serve(committer, max_concurrent=1)
    first = threading.Thread(target=lambda: push_.post([event_grid_event(delivery_id="eg-1")]))
    first.start()
    assert committer.entered.wait(5)
    assert push_.post([event_grid_event(delivery_id="eg-2")]).status_code == 503
    assert committer.hold is not None
    committer.hold.set()
    first.join(5)
    assert [e.delivery_id for e in committer.events] == ["eg-1"]
    assert sorted(committer.results) == ["accepted", "failed"]


def test_events_of_other_kinds_are_answered_200_without_a_commit(serve: Callable[..., Push]) -> None:
    push_ = serve()
    answer = push_.post([other_event()])
    assert answer.status_code == 200 and "skipped 1" in answer.text
    assert push_.committer.batches == [] and push_.committer.results == ["accepted"]


# --- the validation handshakes -----------------------------------------------------------------------------

def test_the_event_grid_subscription_validation_is_answered_with_its_code(serve: Callable[..., Push]) -> None:
    push_ = serve()
    answer = push_.post([validation_event("0f5d5c8a-1111-4e2e-9a7b-3c4d5e6f7a8b")])
    assert answer.status_code == 200
    assert answer.headers["Content-Type"] == "application/json"
    assert answer.json() == {"validationResponse": "0f5d5c8a-1111-4e2e-9a7b-3c4d5e6f7a8b"}
    assert push_.committer.batches == [] and push_.committer.results == ["validated"]


@pytest.mark.parametrize("body", [
    [validation_event(), event_grid_event()],                       # never comes with others
    [{**validation_event(), "data": {"validationUrl": "https://x"}}],  # no code
    [{**validation_event(), "data": {"validationCode": "x" * 1000}}],  # not a GUID-sized code
], ids=["with-others", "no-code", "long-code"])
def test_a_validation_event_that_cannot_be_answered_is_400(serve: Callable[..., Push], body: Any) -> None:
    push_ = serve()
    answer = push_.post(body)
    assert answer.status_code == 400 and "validationResponse" not in answer.text
    assert push_.committer.results == ["invalid"]


def test_the_cloudevents_handshake_allows_event_grid_and_no_other_origin(serve: Callable[..., Push]) -> None:
    push_ = serve()
    answer = requests.options(push_.url(), timeout=5, headers={"WebHook-Request-Origin": EVENT_GRID_ORIGIN,
                                                                "WebHook-Request-Rate": "120"})
    assert answer.status_code == 200
    assert answer.headers["WebHook-Allowed-Origin"] == EVENT_GRID_ORIGIN
    assert answer.headers["WebHook-Allowed-Rate"] == "*"
    assert {m.strip() for m in answer.headers["Allow"].split(",")} == {"POST", "OPTIONS"}

    other = requests.options(push_.url(), timeout=5, headers={"WebHook-Request-Origin": "evil.example.com"})
    assert other.status_code == 403 and "WebHook-Allowed-Origin" not in other.headers
    missing = requests.options(push_.url(), timeout=5)
    assert missing.status_code == 400 and "WebHook-Allowed-Origin" not in missing.headers
    assert push_.committer.results == ["validated", "invalid", "invalid"]
    assert push_.committer.batches == []


def test_allowed_origins_are_configurable_and_matched_without_regard_to_case(serve: Callable[..., Push]) -> None:
    push_ = serve(allowed_origins=("eventgrid.azure.cn",))
    china = requests.options(push_.url(), timeout=5, headers={"WebHook-Request-Origin": "EventGrid.Azure.CN"})
    assert china.status_code == 200 and china.headers["WebHook-Allowed-Origin"] == "EventGrid.Azure.CN"
    public = requests.options(push_.url(), timeout=5, headers={"WebHook-Request-Origin": EVENT_GRID_ORIGIN})
    assert public.status_code == 403


# --- the secret ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["query", "header", "bearer"])
def test_the_secret_is_taken_from_the_query_the_key_header_or_a_bearer_token(serve: Callable[..., Push],
                                                                            where: str) -> None:
    push_ = serve()
    headers = {"header": {"X-Forewarn-Key": SECRET}, "bearer": {"Authorization": f"Bearer {SECRET}"}}.get(where)
    answer = push_.post([event_grid_event()], secret=SECRET if where == "query" else None, headers=headers)
    assert answer.status_code == 200
    assert len(push_.committer.events) == 1


WRONG = {
    "missing": None,
    "empty": "",
    "same-length": SECRET[:-1] + ("0" if SECRET[-1] != "0" else "1"),
    "same-length-first-char": ("0" if SECRET[0] != "0" else "1") + SECRET[1:],
    "prefix": SECRET[:-1],
    "longer": SECRET + "0",
    "much-longer": SECRET * 8,
    "upper-case": SECRET.upper(),
}


@pytest.mark.parametrize("place", ["query", "header", "bearer"])
@pytest.mark.parametrize("wrong", list(WRONG), ids=list(WRONG))
def test_a_wrong_or_missing_secret_is_a_bare_401_and_nothing_is_committed(serve: Callable[..., Push], wrong: str,
                                                                         place: str) -> None:
    push_ = serve()
    candidate = WRONG[wrong]
    assert candidate != SECRET
    headers: dict[str, str] = {}
    if candidate is not None and place == "header":
        headers["X-Forewarn-Key"] = candidate
    elif candidate is not None and place == "bearer":
        headers["Authorization"] = f"Bearer {candidate}"
    answer = push_.post([event_grid_event()], secret=candidate if place == "query" else None, headers=headers)
    assert answer.status_code == 401
    assert answer.text == "unauthorized\n"  # nothing echoed
    assert push_.committer.batches == [] and push_.committer.results == ["unauthorized"]


@pytest.mark.parametrize("request_", [
    lambda p: requests.options(p.url(None), timeout=5, headers={"WebHook-Request-Origin": EVENT_GRID_ORIGIN}),
    lambda p: requests.post(p.url(None), data=json.dumps([validation_event()]), timeout=5),
    lambda p: requests.get(p.url(None), timeout=5),
    lambda p: requests.post(p.url(None), data=b"garbage", timeout=5),
    lambda p: requests.post(p.url(None), timeout=5, headers={"Authorization": f"Basic {SECRET}"},
                            data=json.dumps([event_grid_event()])),
    lambda p: requests.post(p.server.url + f"/eventgrid?key={SECRET}", data=json.dumps([event_grid_event()]),
                            timeout=5),
], ids=["options-handshake", "validation-event", "get", "garbage", "basic-scheme", "other-parameter"])
def test_every_request_is_authenticated_before_it_is_looked_at(serve: Callable[..., Push],
                                                               request_: Callable[[Push], requests.Response]) -> None:
    push_ = serve()
    answer = request_(push_)
    assert answer.status_code == 401
    assert "WebHook-Allowed-Origin" not in answer.headers and "validationResponse" not in answer.text
    assert push_.committer.results == ["unauthorized"]


def test_secrets_are_compared_as_equal_length_digests_with_compare_digest(serve: Callable[..., Push],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[int, int]] = []
    original = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((len(a), len(b)))
        return original(a, b)

    monkeypatch.setattr(push.hmac, "compare_digest", spy)
    push_ = serve()
    for candidate in (SECRET, SECRET[:-1], SECRET + "0", SECRET * 8, "x"):
        push_.post([event_grid_event()], secret=candidate)
    assert compared and set(compared) == {(32, 32)}  # every comparison: two SHA-256 digests, whatever came
    assert push_.committer.results == ["accepted"] + ["unauthorized"] * 4


@pytest.mark.parametrize("secret", ["short", "", "has spaces in it 0123", "plus+and/slash=0123456789",
                                    "ü" * 20, "x" * 2000])
def test_a_weak_or_unsafe_secret_is_refused_at_start_without_being_repeated(secret: str) -> None:
    server = HttpServer("127.0.0.1", 0)
    try:
        with pytest.raises(ValueError, match="openssl rand -hex 32") as refused:
            add_eventgrid_route(server, secret=secret, accept=lambda events: None)
        assert not secret or secret not in str(refused.value)
    finally:
        server.stop()


def test_the_secret_never_reaches_the_log(serve: Callable[..., Push], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    committer = Committer(failing=True)
    push_ = serve(committer)
    wrong = SECRET[:-1] + "0"
    push_.post([event_grid_event()])                       # a failed commit: logged with its traceback
    committer.failing = False
    push_.post([event_grid_event()])                       # accepted
    push_.post([validation_event()])                       # validated
    push_.post(b"garbage")                                 # invalid
    push_.post([event_grid_event()], secret=wrong)         # unauthorized, in the query
    push_.post([event_grid_event()], secret=None, headers={"X-Forewarn-Key": wrong})
    requests.get(push_.url(), timeout=5)                   # 405
    requests.get(push_.server.url + f"/elsewhere?code={SECRET}", timeout=5)  # 404 from the server
    ours = [r for r in caplog.records if r.name.startswith("forewarn")]
    text = "\n".join(r.getMessage() + (caplog.handler.format(r) if r.exc_info else "") for r in ours)
    assert '"POST /eventgrid HTTP/1.1"' in text  # the server's request lines are there, without the query
    assert SECRET not in text and wrong not in text
    assert push_.committer.results == ["failed", "accepted", "validated", "invalid", "unauthorized",
                                       "unauthorized", "invalid"]


# --- bounds and refusals --------------------------------------------------------------------------------------

def test_a_body_over_the_limit_is_413_before_it_is_sent(serve: Callable[..., Push]) -> None:
    push_ = serve(max_body_bytes=4096)
    assert push_.server.max_body_bytes == 4096  # the server's own limit holds the route's
    port = push_.server.server_address[1]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        # Only the head: the server answers from Content-Length alone and never waits for the 10 MB.
        sock.sendall(f"POST /eventgrid?code={SECRET} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {10 * 1024 * 1024}\r\n\r\n".encode())
        started = time.monotonic()
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413")
    assert time.monotonic() - started < 1.5  # well within the 2 s read timeout: not waiting for the body
    assert push_.committer.batches == []
    # Just under the limit is read and parsed (garbage of that size: 400, not 413).
    assert push_.post(b"x" * 4000).status_code == 400


def test_the_route_keeps_its_limit_when_the_server_takes_larger_bodies(serve: Callable[..., Push]) -> None:
    committer = Committer()
    server = HttpServer("127.0.0.1", 0, max_body_bytes=64 * 1024)
    add_eventgrid_route(server, secret=SECRET, accept=committer.news, max_body_bytes=1024,
                        on_result=committer.results.append)
    server.start()
    try:
        assert server.max_body_bytes == 64 * 1024
        big = [event_grid_event(delivery_id=f"eg-{i}") for i in range(3)]
        answer = requests.post(f"{server.url}/eventgrid?code={SECRET}", data=json.dumps(big), timeout=5)
        assert answer.status_code == 413 and committer.batches == [] and committer.results == ["invalid"]
    finally:
        server.stop()


@pytest.mark.parametrize("body", [
    b"not json", b"\xff\xfe[]", b"[1, 2]", b'"a string"', b"[" * 50 + b"]" * 50,
    json.dumps([{**event_grid_event(), "id": ""}]).encode(),
    json.dumps([{**event_grid_event(), "data": {"resourceInfo": {
        "id": event_grid_event()["subject"], "properties": "not an object"}}}]).encode(),
], ids=["not-json", "not-utf8", "numbers", "string", "deep", "no-id", "bad-properties"])
def test_an_unreadable_delivery_is_400_so_event_grid_dead_letters_it(serve: Callable[..., Push],
                                                                   body: bytes) -> None:
    push_ = serve()
    answer = push_.post(body)
    assert answer.status_code == 400 and answer.text.startswith("body: ")
    assert push_.committer.batches == [] and push_.committer.results == ["invalid"]


def test_too_many_events_in_one_delivery_is_400(serve: Callable[..., Push]) -> None:
    push_ = serve(max_body_bytes=1024 * 1024)
    answer = push_.post([{"id": str(i)} for i in range(5001)])
    assert answer.status_code == 400 and push_.committer.batches == []


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH", "HEAD"])
def test_methods_other_than_post_and_options_are_405(serve: Callable[..., Push], method: str) -> None:
    push_ = serve()
    answer = requests.request(method, push_.url(), timeout=5)
    assert answer.status_code == 405
    assert {m.strip() for m in answer.headers["Allow"].split(",")} == {"POST", "OPTIONS"}
    assert push_.committer.results == ["invalid"]


def test_a_body_that_is_not_json_by_its_content_type_is_415(serve: Callable[..., Push]) -> None:
    push_ = serve()
    answer = push_.post([event_grid_event()], content_type="text/plain")
    assert answer.status_code == 415 and push_.committer.batches == []


def test_every_result_is_one_of_the_documented_kinds() -> None:
    assert RESULTS == ("accepted", "validated", "unauthorized", "invalid", "failed")


# --- over TLS, behind a web configuration with basic auth ----------------------------------------------------

def test_over_tls_the_push_needs_its_secret_not_the_web_password(tmp_path: Path, serve: Callable[..., Push]) -> None:
    ca = Authority("push-ca")
    cert, key = ca.issue_server("forewarn")
    for name, pem in (("ca.crt", ca.pem), ("tls.crt", cert), ("tls.key", key)):
        (tmp_path / name).write_bytes(pem)
    hashed = bcrypt.hashpw(b"correct horse", bcrypt.gensalt(4)).decode()
    (tmp_path / "web.yml").write_text(yaml.safe_dump({
        "tls_server_config": {"cert_file": str(tmp_path / "tls.crt"), "key_file": str(tmp_path / "tls.key")},
        "basic_auth_users": {"prometheus": hashed}}))
    push_ = serve(gate=WebGate(tmp_path / "web.yml"))
    assert push_.server.url.startswith("https://")
    session = requests.Session()
    session.trust_env = False  # REQUESTS_CA_BUNDLE would otherwise win over session.verify
    session.verify = str(tmp_path / "ca.crt")  # the server's certificate is verified: this is real HTTPS

    answer = session.post(push_.url(), data=json.dumps([event_grid_event()]), timeout=5,
                          headers={"Content-Type": EVENT_GRID_JSON})
    assert answer.status_code == 200 and len(push_.committer.events) == 1
    assert session.post(push_.url(SECRET[:-1]), data=b"[]", timeout=5).status_code == 401
    handshake = session.options(push_.url(), timeout=5, headers={"WebHook-Request-Origin": EVENT_GRID_ORIGIN})
    assert handshake.headers["WebHook-Allowed-Origin"] == EVENT_GRID_ORIGIN
    # The rest of the server stays behind the password; plain HTTP to the TLS port is refused.
    assert session.get(push_.server.url + "/other", timeout=5).status_code == 401
    plain = requests.post(push_.url().replace("https://", "http://"), data=b"[]", timeout=5)
    assert plain.status_code == 400 and "HTTPS" in plain.text
    assert push_.committer.results == ["accepted", "unauthorized", "validated"]
