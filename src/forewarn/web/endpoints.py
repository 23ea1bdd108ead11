"""The agent's HTTP endpoints: /metrics, /healthz (alive), /readyz (a good poll lately), /probe/lb (a load
balancer's drain probe) and a landing page.

Each is one handler registered with the HttpServer (web/server.py), which owns the limits, the threads,
TLS and authentication; a new endpoint is one more `server.route(...)`. Only /metrics and the landing
page need credentials when basic auth is configured: /healthz, /readyz and /probe/lb are public routes,
since kubelet, Azure Load Balancer and Application Gateway probes send none.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from forewarn.imds.document import Event
from forewarn.metrics.view import View
from forewarn.web.server import Handler, HttpServer, Request, Response

_LANDING = b"""<!doctype html><html><head><title>forewarn</title></head><body>
<h1>forewarn</h1><p>Azure Scheduled Events exporter.</p>
<ul><li><a href="metrics">metrics</a></li><li><a href="healthz">healthz</a></li>
<li><a href="readyz">readyz</a></li><li><a href="probe/lb">probe/lb</a></li></ul></body></html>
"""


def exposition(render: Callable[[str], tuple[bytes | tuple[bytes, ...], str]]) -> Handler:
    """/metrics from `render(accept)`: the exposition body (whole, or in parts) for an Accept header, and its
    content type."""

    def metrics(request: Request) -> Response:
        body, content_type = render(request.headers.get("Accept", ""))
        return Response(200, body, content_type)
    return metrics


def add_metrics_endpoints(server: HttpServer, metrics: Handler, readiness: Callable[[], tuple[bool, str]], *,
                          inline_metrics: bool = False) -> None:
    """Register the endpoints: `metrics` answers /metrics (see `exposition`; fleet mode's also compresses),
    `readiness()` says whether the agent is ready and why (see readiness_check). The probes and the landing
    page are answered by the server's acceptor (HttpServer.route's `inline`), and /metrics too with
    `inline_metrics`: the agent's rendering takes about 0.1 ms for 100 events, fleet mode's tens of ms."""

    def ready(request: Request) -> Response:
        is_ready, reason = readiness()
        return Response(200 if is_ready else 503, (reason + "\n").encode())

    server.route("/metrics", metrics, inline=inline_metrics)
    # Public, like /probe/lb: kubelet and load balancer probes send no credentials (a 401 would restart the
    # pod), and they tell no more than kube-apiserver's own /healthz and /readyz tell anonymous users.
    server.route("/healthz", lambda request: Response(200, b"ok\n"), public=True, inline=True)
    server.route("/readyz", ready, public=True, inline=True)
    server.route("/", lambda request: Response(200, _LANDING, "text/html; charset=utf-8"), inline=True)


def readiness_check(last_success: Callable[[], float | None], window: float,
                    clock: Callable[[], float] = time.time, what: str = "IMDS poll") -> Callable[[], tuple[bool, str]]:
    """Ready while the last success (`what`: an IMDS poll, or fleet mode's read of any source) is at most
    `window` seconds old."""

    def check() -> tuple[bool, str]:
        last = last_success()
        if last is None:
            return False, f"no successful {what} yet"
        age = clock() - last
        if age > window:
            return False, f"last successful {what} {age:.0f} s ago (window {window:g} s)"
        return True, "ok"
    return check


#: Event types that take the VM away, whatever their duration; a Freeze only pauses it.
DRAIN_TYPES = ("Reboot", "Redeploy", "Preempt", "Terminate")


@dataclass(frozen=True)
class DrainPolicy:
    """When /probe/lb asks to be taken out of rotation: from `lead_time` seconds before the NotBefore of an
    event of DRAIN_TYPES that affects this VM, and while such an event is Started; a Freeze counts only
    when its DurationInSeconds is above `freeze_threshold`."""

    lead_time: float = 300.0
    freeze_threshold: float = 30.0

    def impactful(self, event: Event) -> bool:
        if event.event_type in DRAIN_TYPES:
            return True
        return event.event_type == "Freeze" and (event.duration_seconds or 0) > self.freeze_threshold

    def decide(self, view: View, now: float) -> tuple[bool, dict[str, object]]:
        """(drain, the JSON answer's fields). Reads the view only: the probe costs no I/O."""
        vm = view.vm.name
        if view.document is None:
            return False, {"drain": False, "reason": "no Scheduled Events document yet"}
        if not vm:
            # Without a name no event can be told to be ours; draining every VM of the set would be worse.
            return False, {"drain": False, "reason": "this VM's name is not known yet"}
        soonest: tuple[float, Event] | None = None
        for event in view.document.events:
            if not event.affects(vm) or not self.impactful(event):
                continue
            if event.status != "Scheduled":  # Started (or a status IMDS may add): the impact is on
                return True, _drain(event, f"{event.event_type} {event.status}")
            left = event.seconds_to_not_before(now)
            if left is None:  # Scheduled without a NotBefore: it may start at any moment
                return True, _drain(event, f"{event.event_type} scheduled without NotBefore")
            if soonest is None or left < soonest[0]:
                soonest = (left, event)
        if soonest is not None and soonest[0] <= self.lead_time:
            left, event = soonest
            return True, _drain(event, f"{event.event_type} starts in {max(left, 0):.0f} s "
                                       f"(lead time {self.lead_time:g} s)")
        if soonest is not None:
            left, event = soonest
            return False, {"drain": False, "reason": f"next: {event.event_type} in {left:.0f} s, drain from "
                                                     f"{self.lead_time:g} s before", "event_id": event.event_id}
        return False, {"drain": False, "reason": "no impactful event for this VM"}


def _drain(event: Event, reason: str) -> dict[str, object]:
    return {"drain": True, "reason": reason, "event_id": event.event_id, "event_type": event.event_type,
            "status": event.status,
            "not_before": event.not_before.strftime("%Y-%m-%dT%H:%M:%SZ") if event.not_before else None}


def add_lb_probe(server: HttpServer, view: Callable[[], View], policy: DrainPolicy,
                 clock: Callable[[], float] = time.time, path: str = "/probe/lb") -> None:
    """Register the drain probe: 503 while this VM should be out of rotation, 200 otherwise, with a short
    JSON body saying why. Public: answered without the web configuration's basic auth."""

    def probe(request: Request) -> Response:
        drain, body = policy.decide(view(), clock())
        return Response(503 if drain else 200, (json.dumps(body) + "\n").encode(), "application/json",
                        {"Cache-Control": "no-store"})

    server.route(path, probe, public=True, inline=True)  # reads the view only
