"""Stand-ins for the services the notification sinks post to, on loopback, each checking what the real
service requires and refusing (400) what it would refuse:

- CloudEvents: parses every request with the CloudEvents SDK (structured or binary content mode);
- Slack: an incoming webhook enforcing Block Kit limits (at most 50 blocks, a header's plain_text at most
  150 characters, a section's text at most 3000, at most 10 fields of at most 2000);
- Teams: a Workflows webhook validating the card against the Adaptive Card JSON schema (vendored from
  the npm package adaptivecards-designer 2.4.4, MIT, file adaptive-card.schema.json beside this one);
- Logs Ingestion: URL /dataCollectionRules/{dcr}/streams/{stream}?api-version=2023-01-01, a bearer token,
  a gzipped JSON array of rows with only the stream's columns, each value of the column's type. It runs
  over TLS (`tls=(certfile, keyfile)`): azure-core sends a bearer token over https only. It also answers
  the IMDS managed identity token request (GET /metadata/identity/oauth2/token with `Metadata: true`),
  so a real ManagedIdentityCredential pointed here (AZURE_POD_IDENTITY_AUTHORITY_HOST) gets `token`.

Every stand-in can be taken down (503), told to answer 429 with a Retry-After a given number of times,
and records what it accepted (`accepted`) and what it refused and why (`errors`).
"""

from __future__ import annotations

import gzip
import json
import select
import ssl
import threading
import time
from collections.abc import Callable
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import jsonschema

SCHEMA = json.loads((Path(__file__).parent / "adaptive-card.schema.json").read_text())


def _is_datetime(value: Any) -> bool:
    try:
        return isinstance(value, str) and datetime.fromisoformat(value.replace("Z", "+00:00")).tzinfo is not None
    except ValueError:
        return False


#: What a value of each DCR column type may be in the JSON rows (the service refuses or drops the others).
COLUMN_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str), "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "long": lambda v: isinstance(v, int) and not isinstance(v, bool), "boolean": lambda v: isinstance(v, bool),
    "real": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "datetime": _is_datetime,
    "dynamic": lambda v: True,
}


class Received:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.accepted: list[dict[str, Any]] = []     # {"id": ..., "headers": ..., "body": ...}
        self.errors: list[str] = []
        self.throttled: list[float] = []             # monotonic times of the 429s sent
        self.attempts: list[float] = []              # monotonic times of every request, as it arrives
        self.accepted_at: list[float] = []           # monotonic times of every request taken
        self.down = False
        self.throttle = 0                            # answer 429 this many more times
        self.retry_after = 1
        self.delay = 0.0                             # seconds each POST takes before it is looked at
        self.in_flight = 0                           # POSTs arrived and not yet answered
        self.abandoned = 0                           # POSTs whose client went away before the answer

    def ids(self) -> list[str]:
        with self.lock:
            return [item["id"] for item in self.accepted]


class NotifyPeer:
    """kind: cloudevents, slack, teams or logs."""

    def __init__(self, kind: str, token: str = "test-token", dcr: str = "dcr-0123", stream: str = "Custom-Forewarn",
                 columns: dict[str, str] | None = None, tls: tuple[str, str] | None = None) -> None:
        self.kind = kind
        self.received = Received()
        self.token = token
        self.dcr = dcr
        self.stream = stream
        self.columns = columns or {}
        peer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # the status line and the body go out in two writes

            def log_message(self, format: str, *args: Any) -> None:
                return None

            def setup(self) -> None:
                # The handshake here, in the request's thread, not in accept(): a client killed mid-handshake
                # then holds up nobody else.
                if isinstance(self.request, ssl.SSLSocket):
                    self.request.settimeout(10)
                    self.request.do_handshake()
                super().setup()

            def _client_gone(self) -> bool:
                # A kept-alive client sends nothing while it waits for the answer: readable means closed.
                return bool(select.select([self.connection], [], [], 0)[0])

            def do_GET(self) -> None:
                status, body = peer.token_request(self.path, {k.lower(): v for k, v in self.headers.items()})
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                status, extra = peer.handle(self.path, dict(self.headers.items()), body, self._client_gone)
                if status == 0:  # nobody to answer: the request is dropped, as a service drops a cut request
                    self.close_connection = True
                    return
                answer = b"ok"
                if peer.kind == "logs":  # as the service: 204 without a body, or an Azure error object
                    status = 204 if status == 200 else status
                    answer = b"" if status == 204 else json.dumps(
                        {"error": {"code": f"Http{status}", "message": "refused by the stand-in"}}).encode()
                    extra = {**extra, "Content-Type": "application/json"} if answer else extra
                self.send_response(status)
                for key, value in extra.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.tokens_issued = 0
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True,
                                                     do_handshake_on_connect=False)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        host, port = self.server.server_address[:2]
        self.base = f"{'https' if tls else 'http'}://{host}:{port}"
        # Slack and Teams URLs carry their key in the path; tests check it never shows up in logs.
        self.url = f"{self.base}/hooks/SECRET-KEY-PATH?sig=SECRET-SIG"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def token_request(self, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
        """IMDS's managed identity token endpoint, as ManagedIdentityCredential calls it."""
        url = urlsplit(path)
        query = parse_qs(url.query)
        if url.path != "/metadata/identity/oauth2/token" or headers.get("metadata") != "true" \
                or not query.get("resource") or not query.get("api-version"):
            with self.received.lock:
                self.received.errors.append(f"token request refused: {url.path} {sorted(query)}")
            return 400, b'{"error": "invalid_request"}'
        with self.received.lock:
            self.tokens_issued += 1
        return 200, json.dumps({"access_token": self.token, "expires_in": "86399", "token_type": "Bearer",
                                "resource": query["resource"][0]}).encode()

    # --- one request ----------------------------------------------------------------------------------
    def handle(self, path: str, headers: dict[str, str], body: bytes,
               client_gone: Callable[[], bool] = lambda: False) -> tuple[int, dict[str, str]]:
        """The status and headers of the answer; 0: the client left before the answer, nothing taken."""
        got = self.received
        with got.lock:
            got.attempts.append(time.monotonic())
            got.in_flight += 1
        try:
            if got.delay:
                time.sleep(got.delay)  # a slow service: a SIGKILL can land while a request is in flight
                if client_gone():
                    with got.lock:
                        got.abandoned += 1
                    return 0, {}
            return self._answer(path, headers, body)
        finally:
            with got.lock:
                got.in_flight -= 1

    def _answer(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str]]:
        got = self.received
        with got.lock:
            if got.down:
                return 503, {}
            if got.throttle > 0:
                got.throttle -= 1
                got.throttled.append(time.monotonic())
                return 429, {"Retry-After": str(got.retry_after)}
        try:
            items = getattr(self, f"_check_{self.kind}")(path, {k.lower(): v for k, v in headers.items()}, body)
        except (ValueError, KeyError, TypeError, jsonschema.ValidationError) as exc:
            with got.lock:
                got.errors.append(f"{type(exc).__name__}: {str(exc)[:300]}")
            return 400, {}
        with got.lock:
            got.accepted.extend(items)
            got.accepted_at.append(time.monotonic())
        return 200, {}

    def _check_cloudevents(self, path: str, headers: dict[str, str], body: bytes) -> list[dict[str, Any]]:
        try:
            from cloudevents.v1.http import from_http
        except ImportError:  # cloudevents 1.x
            from cloudevents.http import from_http
        event = from_http(headers, body)
        mode = "structured" if headers.get("content-type", "").startswith("application/cloudevents+json") \
            else "binary"
        return [{"id": event["id"], "mode": mode, "attributes": dict(event.get_attributes()), "data": event.data,
                 "headers": headers}]

    def _check_slack(self, path: str, headers: dict[str, str], body: bytes) -> list[dict[str, Any]]:
        message = json.loads(body)
        blocks = message.get("blocks", [])
        if not isinstance(message.get("text"), str) or not message["text"]:
            raise ValueError("text (the notification fallback) is missing")
        if len(blocks) > 50:
            raise ValueError(f"{len(blocks)} blocks, at most 50")
        for block in blocks:
            if block["type"] == "header":
                if block["text"]["type"] != "plain_text" or len(block["text"]["text"]) > 150:
                    raise ValueError("header text must be plain_text of at most 150 characters")
            elif block["type"] == "section":
                if "text" in block and len(block["text"]["text"]) > 3000:
                    raise ValueError("section text over 3000 characters")
                fields = block.get("fields", [])
                if len(fields) > 10 or any(len(f["text"]) > 2000 for f in fields):
                    raise ValueError("section fields: at most 10, each at most 2000 characters")
                if "text" not in block and not fields:
                    raise ValueError("section without text or fields")
            elif block["type"] not in ("context", "actions", "divider"):
                raise ValueError(f"unexpected block type {block['type']}")
        record_id = next(e["text"] for b in blocks if b["type"] == "context" for e in b["elements"])
        return [{"id": record_id.split("record `")[1].split("`")[0], "message": message}]

    def _check_teams(self, path: str, headers: dict[str, str], body: bytes) -> list[dict[str, Any]]:
        message = json.loads(body)
        if message.get("type") != "message" or len(message.get("attachments", [])) != 1:
            raise ValueError("expected a message with one attachment")
        attachment = message["attachments"][0]
        if attachment["contentType"] != "application/vnd.microsoft.card.adaptive":
            raise ValueError("the attachment is not an Adaptive Card")
        card = attachment["content"]
        jsonschema.Draft6Validator(SCHEMA).validate(card)
        facts = {fact["title"]: fact["value"] for block in card["body"] if block["type"] == "FactSet"
                 for fact in block["facts"]}
        footer = card["body"][-1]["text"]
        return [{"id": footer.split()[1], "card": card, "facts": facts}]

    def _check_logs(self, path: str, headers: dict[str, str], body: bytes) -> list[dict[str, Any]]:
        url = urlsplit(path)
        expected = f"/dataCollectionRules/{self.dcr}/streams/{self.stream}"
        if url.path != expected:
            raise ValueError(f"path {url.path}, expected {expected}")
        if parse_qs(url.query).get("api-version") != ["2023-01-01"]:
            raise ValueError(f"query {url.query}: api-version=2023-01-01 expected")
        if headers.get("authorization") != f"Bearer {self.token}":
            raise ValueError("no valid bearer token")
        if headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        else:
            raise ValueError("the body is not gzipped")
        rows = json.loads(body)
        if not isinstance(rows, list):
            raise ValueError("expected a JSON array of rows")
        for row in rows:
            unknown = set(row) - set(self.columns)
            if unknown:
                raise ValueError(f"columns not in the stream: {sorted(unknown)}")
            for column, value in row.items():
                if not COLUMN_TYPES[self.columns[column].lower()](value):
                    raise ValueError(f"column {column}: {value!r} is not a {self.columns[column]}")
        return [{"id": row["RecordId"], "row": row} for row in rows]
