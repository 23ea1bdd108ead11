"""The collector's HTTP endpoints: /metrics, /healthz (alive), /readyz (a good poll lately)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

_LANDING = b"""<!doctype html><html><head><title>forewarn</title></head><body>
<h1>forewarn</h1><p>Azure Scheduled Events exporter.</p>
<ul><li><a href="metrics">metrics</a></li><li><a href="healthz">healthz</a></li>
<li><a href="readyz">readyz</a></li></ul></body></html>
"""


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer
    protocol_version = "HTTP/1.1"
    server_version = "forewarn"
    # Headers and body go out as separate writes; without this, Nagle and delayed ACKs add ~40 ms.
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.client_address[0], *args)

    def _send(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/metrics":
            body, content_type = self.server.render(self.headers.get("Accept", ""))
            self._send(200, body, content_type)
        elif path == "/healthz":
            self._send(200, b"ok\n")
        elif path == "/readyz":
            ready, reason = self.server.readiness()
            self._send(200 if ready else 503, (reason + "\n").encode())
        elif path == "/":
            self._send(200, _LANDING, "text/html; charset=utf-8")
        else:
            self._send(404, b"not found\n")

    do_HEAD = do_GET


class MetricsServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default backlog is 5: a burst of scrapers connecting at once (many Prometheus
    # replicas, a restart of the monitoring stack) overflowed it and waited 1-3 s for TCP retries.
    request_queue_size = 128

    def __init__(self, host: str, port: int, render: Callable[[str], tuple[bytes, str]],
                 readiness: Callable[[], tuple[bool, str]]) -> None:
        self.render = render
        self.readiness = readiness
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), _Handler)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        shown = str(host) if host not in ("", "0.0.0.0") else "127.0.0.1"  # noqa: S104
        if ":" in shown:
            shown = f"[{shown}]"
        return f"http://{shown}:{port}"

    def start(self) -> None:
        # The poll interval only bounds how long shutdown() waits; a long one keeps an idle agent idle.
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 1.0},
                                        name="metrics-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


def readiness_check(last_success: Callable[[], float | None], window: float,
                    clock: Callable[[], float] = time.time) -> Callable[[], tuple[bool, str]]:
    def check() -> tuple[bool, str]:
        last = last_success()
        if last is None:
            return False, "no successful IMDS poll yet"
        age = clock() - last
        if age > window:
            return False, f"last successful IMDS poll {age:.0f} s ago (window {window:g} s)"
        return True, "ok"
    return check
