"""The load balancer's drain probe, /probe/lb: 503 from the lead time before an impactful event's NotBefore
and while it is Started, 200 otherwise, without credentials even when basic auth guards the rest."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import requests
import yaml

from forewarn.imds.document import parse_document
from forewarn.imds.instance import VmInfo
from forewarn.metrics.view import View
from forewarn.web.endpoints import DrainPolicy, add_lb_probe
from forewarn.web.server import HttpServer

from conftest import free_port, wait_until

NOW = 1_800_000_000.0
VM = "web-0"


def event(event_type: str = "Reboot", status: str = "Scheduled", in_seconds: float | None = 600,
          resources: tuple[str, ...] = (VM,), duration: int = -1, event_id: str = "E1") -> dict[str, Any]:
    not_before = "" if in_seconds is None else format_datetime(
        datetime.fromtimestamp(NOW + in_seconds, tz=timezone.utc), usegmt=True)
    return {"EventId": event_id, "EventType": event_type, "ResourceType": "VirtualMachine",
            "Resources": list(resources), "EventStatus": status, "NotBefore": not_before,
            "Description": "", "EventSource": "Platform", "DurationInSeconds": duration}


def view(*events: dict[str, Any], vm: str = VM) -> View:
    return View(document=parse_document({"DocumentIncarnation": 1, "Events": list(events)}), vm=VmInfo(name=vm))


@pytest.mark.parametrize(("events", "vm", "drain"), [
    ((), VM, False),
    ((event(in_seconds=301),), VM, False),                        # outside the lead time
    ((event(in_seconds=300),), VM, True),                         # at the lead time
    ((event(in_seconds=-5),), VM, True),                          # NotBefore passed, not Started yet
    ((event(status="Started", in_seconds=None),), VM, True),
    ((event(resources=("web-1",), in_seconds=10),), VM, False),   # another VM's reboot
    ((event(in_seconds=10),), "", False),                         # which events are ours is not known
    ((event("Freeze", in_seconds=10, duration=5),), VM, False),   # a short pause
    ((event("Freeze", in_seconds=10, duration=-1),), VM, False),  # a pause of unknown length
    ((event("Freeze", in_seconds=10, duration=31),), VM, True),   # longer than the threshold
    ((event("Preempt", in_seconds=25),), VM, True),
    ((event("Terminate", in_seconds=900), event("Redeploy", in_seconds=120, event_id="E2")), VM, True),
])
def test_the_decision_for_each_kind_of_event(events: tuple[dict[str, Any], ...], vm: str, drain: bool) -> None:
    decided, body = DrainPolicy(lead_time=300, freeze_threshold=30).decide(view(*events, vm=vm), NOW)
    assert decided is drain, body
    assert body["drain"] is drain and body["reason"]


def test_no_document_yet_keeps_the_vm_in_rotation() -> None:
    assert DrainPolicy().decide(View(), NOW) == (False, {"drain": False, "reason": "no Scheduled Events document yet"})


def test_the_probe_answers_503_with_the_event_and_200_otherwise_over_http() -> None:
    clock = [NOW]
    current = [view(event(in_seconds=400))]
    server = HttpServer("127.0.0.1", 0)
    add_lb_probe(server, lambda: current[0], DrainPolicy(lead_time=300), clock=lambda: clock[0])
    server.start()
    try:
        url = f"{server.url}/probe/lb"
        first = requests.get(url, timeout=5)
        assert first.status_code == 200
        assert first.json()["drain"] is False and "Reboot in 400 s" in first.json()["reason"]
        clock[0] = NOW + 100  # 300 s before NotBefore
        drained = requests.get(url, timeout=5)
        assert drained.status_code == 503
        assert drained.headers["Content-Type"] == "application/json"
        assert drained.json() == {"drain": True, "reason": "Reboot starts in 300 s (lead time 300 s)",
                                  "event_id": "E1", "event_type": "Reboot", "status": "Scheduled",
                                  "not_before": datetime.fromtimestamp(NOW + 400, tz=timezone.utc)
                                  .strftime("%Y-%m-%dT%H:%M:%SZ")}
        current[0] = view()  # the event is over: back in rotation
        assert requests.get(url, timeout=5).status_code == 200
    finally:
        server.stop()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[str, float]]:
    """`forewarn run` on the platform-reboot scenario at 200x (NotBefore 4.5 s after start, Started for 3 s),
    a 2 s lead time, and basic auth on every other endpoint."""
    config = tmp_path / "web.yml"
    config.write_text(yaml.safe_dump({"basic_auth_users": {"prometheus": bcrypt.hashpw(b"pw", bcrypt.gensalt(4))
                                                           .decode()}}))
    port = free_port()
    started = time.time()
    process = subprocess.Popen(
        [sys.executable, "-m", "forewarn", "run", "--simulate", "platform-reboot", "--speed", "200",
         "--poll-interval", "0.2", "--listen-address", f"127.0.0.1:{port}", "--probe.lb-lead-time", "2",
         "--web.config.file", str(config), "--state-dir", str(tmp_path / "state"),
         "--sink", "file:" + str(tmp_path / "records.jsonl")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}", started
    finally:
        process.terminate()
        process.wait(20)


@pytest.mark.slow
def test_the_probe_flips_at_the_lead_time_in_a_simulated_reboot_and_back_when_it_is_over(
        agent: tuple[str, float]) -> None:
    base, _ = agent

    def probe(status: int | None = None, text: str = "") -> tuple[int, dict[str, Any]] | None:
        """The probe's answer when it has this status and text in its reason; None otherwise (a requests
        Response is falsy for a 503, so answers are tuples here)."""
        try:
            response = requests.get(f"{base}/probe/lb", timeout=2)
        except requests.ConnectionError:
            return None
        body = response.json()
        if (status is None or response.status_code == status) and text in body["reason"]:
            return response.status_code, body
        return None

    waiting = wait_until(lambda: probe(text="next: Reboot"), timeout=15, message="the reboot seen, still in rotation")
    assert waiting[0] == 200
    # Basic auth guards the rest; the probe needs no credentials.
    assert requests.get(f"{base}/metrics", timeout=2).status_code == 401
    assert requests.get(f"{base}/metrics", auth=("prometheus", "pw"), timeout=2).status_code == 200

    _, body = wait_until(lambda: probe(503), timeout=15, interval=0.02, message="the probe drains")
    flipped = time.time()
    assert body["event_type"] == "Reboot" and body["status"] == "Scheduled", body
    not_before = datetime.strptime(body["not_before"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
    # 2 s before NotBefore, give or take the probe's polling and the scheduling of two processes.
    assert not_before - 2 - 0.1 <= flipped <= not_before - 2 + 0.5, (flipped, not_before)

    wait_until(lambda: probe(503, "Reboot Started"), timeout=15, message="the reboot Started, still drained")
    _, over = wait_until(lambda: probe(200), timeout=15, message="back in rotation after the reboot")
    assert over["reason"] == "no impactful event for this VM"
