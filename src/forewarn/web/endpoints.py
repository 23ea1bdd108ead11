"""The agent's HTTP endpoints: /metrics, /healthz (alive), /readyz (a good poll lately) and a landing page.

Each is one handler registered with the HttpServer (web/server.py), which owns the limits and the threads;
a new endpoint is one more `server.route(...)`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from forewarn.web.server import HttpServer, Request, Response

_LANDING = b"""<!doctype html><html><head><title>forewarn</title></head><body>
<h1>forewarn</h1><p>Azure Scheduled Events exporter.</p>
<ul><li><a href="metrics">metrics</a></li><li><a href="healthz">healthz</a></li>
<li><a href="readyz">readyz</a></li></ul></body></html>
"""


def add_metrics_endpoints(server: HttpServer, render: Callable[[str], tuple[bytes, str]],
                          readiness: Callable[[], tuple[bool, str]]) -> None:
    """Register the endpoints: `render(accept)` gives the exposition body and its content type (by the
    Accept header), `readiness()` whether the agent is ready and why (see readiness_check)."""

    def metrics(request: Request) -> Response:
        body, content_type = render(request.headers.get("Accept", ""))
        return Response(200, body, content_type)

    def ready(request: Request) -> Response:
        is_ready, reason = readiness()
        return Response(200 if is_ready else 503, (reason + "\n").encode())

    server.route("/metrics", metrics)
    server.route("/healthz", lambda request: Response(200, b"ok\n"))
    server.route("/readyz", ready)
    server.route("/", lambda request: Response(200, _LANDING, "text/html; charset=utf-8"))


def readiness_check(last_success: Callable[[], float | None], window: float,
                    clock: Callable[[], float] = time.time) -> Callable[[], tuple[bool, str]]:
    """Ready while the last successful IMDS poll is at most `window` seconds old."""

    def check() -> tuple[bool, str]:
        last = last_success()
        if last is None:
            return False, "no successful IMDS poll yet"
        age = clock() - last
        if age > window:
            return False, f"last successful IMDS poll {age:.0f} s ago (window {window:g} s)"
        return True, "ok"
    return check
