"""Approvals end to end: `forewarn run --policy` against the simulator, which acts on StartRequests."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import CollectorProcess, SimulatorHandle, sample, wait_for_polls, wait_until

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).parent.parent / "examples" / "policies"
TWO_VMS = {"vm_name": "vm-0", "vms": ["vm-0", "vm-1"]}


def status(sim: SimulatorHandle) -> list[str]:
    return [event["EventStatus"] for event in sim.sim.current()[1]]


def write_policy(tmp_path: Path, text: str, name: str = "policy.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def approved_records(proc: CollectorProcess) -> list[dict[str, Any]]:
    return [r for r in proc.records() if r["data"]["change"] == "approved"]


def test_approved_event_starts_early(simulator: Callable[..., SimulatorHandle],
                                     collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator("user-reboot")  # NotBefore 15 minutes after it appears
    proc = collector(sim.url, "--policy", str(EXAMPLES / "docs-sample.yaml"))
    wait_until(lambda: status(sim) == ["Started"], timeout=15, message="the reboot started early")
    assert len(sim.sim.approval_posts) == 1
    (record,) = wait_until(lambda: approved_records(proc), timeout=5)
    assert record["data"]["policy_rule"] == "user-initiated" and record["data"]["dry_run"] is False
    assert sample(proc.metrics(), "azure_scheduled_events_approvals_total", event_type="Reboot",
                  result="approved") == 1
    wait_until(lambda: any(r["data"]["change"] == "updated" for r in proc.records()), timeout=5)
    wait_for_polls(proc)
    assert len(sim.sim.approval_posts) == 1, "no second approval once it started"


def test_held_event_waits_for_not_before(simulator: Callable[..., SimulatorHandle],
                                         collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator("platform-reboot")
    proc = collector(sim.url, "--policy", str(EXAMPLES / "docs-sample.yaml"))
    wait_until(lambda: "rule everything-else holds it" in proc.log(), timeout=10, message="the hold decision")
    wait_for_polls(proc)
    assert sim.sim.approval_posts == [] and status(sim) == ["Scheduled"]
    assert approved_records(proc) == []


def test_dry_run_decides_and_records_but_sends_nothing(simulator: Callable[..., SimulatorHandle],
                                                       collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator("user-reboot")
    proc = collector(sim.url, "--policy", str(EXAMPLES / "docs-sample.yaml"), "--dry-run")
    (record,) = wait_until(lambda: approved_records(proc), timeout=10)
    assert record["data"]["dry_run"] is True and record["data"]["policy_rule"] == "user-initiated"
    wait_for_polls(proc)
    assert sim.sim.approval_posts == [] and status(sim) == ["Scheduled"]
    assert len(approved_records(proc)) == 1, "a dry-run approval is recorded once"
    assert sample(proc.metrics(), "azure_scheduled_events_approvals_total", event_type="Reboot",
                  result="dry_run") == 1


def test_no_policy_never_approves(simulator: Callable[..., SimulatorHandle],
                                  collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator("user-reboot")
    proc = collector(sim.url)
    wait_until(lambda: proc.records(), timeout=10)
    wait_for_polls(proc)
    assert sim.sim.approval_posts == []


HOOK_SCRIPT = """
import json, os, sys
event = json.load(sys.stdin)
with open(sys.argv[1], "a") as out:
    out.write(json.dumps({"hook": os.environ["FOREWARN_HOOK"], "id": os.environ["FOREWARN_EVENT_ID"],
                          "type": event["event"]["EventType"], "rule": event["rule"]}) + "\\n")
print("hook output for", os.environ["FOREWARN_EVENT_ID"])
sys.exit(int(sys.argv[2]))
"""


def hook_policy(tmp_path: Path, exit_code: int, on_failure: str = "hold") -> tuple[str, Path]:
    script = tmp_path / "hook.py"
    script.write_text(HOOK_SCRIPT)
    log = tmp_path / f"hooks-{exit_code}.jsonl"
    command = json.dumps([sys.executable, str(script), str(log)])
    text = f"""
hooks:
  recover:
    - name: rejoin
      command: {json.dumps([sys.executable, str(script), str(log), "0"])}
rules:
  - name: drain-then-approve
    match: {{event_type: [Reboot], affects_this_vm: true}}
    action: approve
    prepare:
      - name: drain
        command: {command[:-1]}, "{exit_code}"]
        timeout: 10
    on_hook_failure: {on_failure}
"""
    return write_policy(tmp_path, text, f"hooks-{exit_code}.yaml"), log


def test_prepare_hook_runs_before_approval_and_recover_after_completion(
        tmp_path: Path, simulator: Callable[..., SimulatorHandle], collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator({"events": [{"at": 0.5, "type": "Reboot", "notice": 900, "run_for": 2}]})
    policy, hook_log = hook_policy(tmp_path, 0)
    proc = collector(sim.url, "--policy", policy)
    wait_until(lambda: sim.sim.approval_posts, timeout=15, message="approval after the hook")
    runs = [json.loads(line) for line in hook_log.read_text().splitlines()]
    assert runs[0] == {"hook": "prepare", "id": runs[0]["id"], "type": "Reboot", "rule": "drain-then-approve"}
    wait_until(lambda: len(hook_log.read_text().splitlines()) == 2, timeout=15, message="recover hook")
    assert json.loads(hook_log.read_text().splitlines()[1])["hook"] == "recover"
    wait_until(lambda: sample(proc.metrics(), "azure_scheduled_events_hook_runs_total", hook="recover",
                              result="success") == 1, timeout=5, message="recover run counted")
    assert sample(proc.metrics(), "azure_scheduled_events_hook_runs_total", hook="prepare", result="success") == 1
    assert "hook output for" in proc.log()


def test_failing_hook_blocks_approval(tmp_path: Path, simulator: Callable[..., SimulatorHandle],
                                      collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator("platform-reboot")
    policy, hook_log = hook_policy(tmp_path, 3)
    proc = collector(sim.url, "--policy", policy)
    wait_until(lambda: sample(proc.metrics(), "azure_scheduled_events_hook_runs_total", hook="prepare",
                              result="failure") == 1, timeout=15, message="the failed hook counted")
    wait_for_polls(proc)
    assert sim.sim.approval_posts == [] and status(sim) == ["Scheduled"]
    assert len(hook_log.read_text().splitlines()) == 1, "a failed hook is not re-run every poll"
    assert "exited with 3" in proc.log()


def test_failing_hook_may_be_set_to_approve_anyway(tmp_path: Path, simulator: Callable[..., SimulatorHandle],
                                                   collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator("platform-reboot")
    policy, _ = hook_policy(tmp_path, 3, on_failure="approve")
    collector(sim.url, "--policy", policy)
    wait_until(lambda: sim.sim.approval_posts, timeout=15)


def saw_started(proc: CollectorProcess) -> bool:
    return any(r["data"]["change"] == "updated" and r["data"]["event"]["EventStatus"] == "Started"
               for r in proc.records())


USER_EVENT = {**TWO_VMS, "events": [{"at": 1, "type": "Reboot", "source": "User", "notice": 900, "run_for": 60}]}


def leader_policy(tmp_path: Path, mode: str) -> str:
    return write_policy(tmp_path, f"leader: {{mode: {mode}, stagger: 3}}\n"
                        "rules: [{name: user, match: {source: [User]}, action: approve}]\n", f"{mode}.yaml")


@pytest.mark.parametrize("mode", ["first", "staggered"])
def test_two_vms_approve_exactly_once(mode: str, tmp_path: Path, simulator: Callable[..., SimulatorHandle],
                                      collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator(USER_EVENT)
    policy = leader_policy(tmp_path, mode)
    primary = collector(sim.url, "--policy", policy, "--vm-name", "vm-0", name="vm0")
    secondary = collector(sim.url, "--policy", policy, "--vm-name", "vm-1", name="vm1")
    wait_until(lambda: status(sim) == ["Started"], timeout=15)
    # Once each has seen the event Started, neither can approve it any more (only Scheduled events are).
    for proc in (primary, secondary):
        wait_until(lambda: saw_started(proc), timeout=10, message="Started seen")  # noqa: B023 (called at once)
        wait_for_polls(proc, 1)
    assert len(sim.sim.approval_posts) == 1
    assert len(approved_records(primary)) == 1 and approved_records(secondary) == []


def test_staggered_secondary_approves_when_the_primary_is_down(
        tmp_path: Path, simulator: Callable[..., SimulatorHandle], collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator(USER_EVENT)
    policy = leader_policy(tmp_path, "staggered")
    secondary = collector(sim.url, "--policy", policy, "--vm-name", "vm-1", name="vm1")
    added = wait_until(lambda: secondary.records(), timeout=10)[0]
    seen_at = time.time()
    wait_until(lambda: sim.sim.approval_posts, timeout=15, message="the secondary's approval")
    assert time.time() - seen_at >= 2.5, "the secondary waited for its turn"
    assert len(sim.sim.approval_posts) == 1
    # The record follows the POST through the outbox and the file sink.
    approved = wait_until(lambda: approved_records(secondary), timeout=10, message="the approved record")
    assert approved[0]["subject"] == added["subject"]


def test_first_mode_secondary_never_approves_alone(tmp_path: Path, simulator: Callable[..., SimulatorHandle],
                                                   collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator(USER_EVENT)
    secondary = collector(sim.url, "--policy", leader_policy(tmp_path, "first"), "--vm-name", "vm-1", name="vm1")
    wait_until(lambda: "leader mode first: vm-0 approves" in secondary.log(), timeout=10, message="the hold")
    wait_for_polls(secondary)
    assert sim.sim.approval_posts == []


def test_bad_policy_stops_start_up_with_its_position(tmp_path: Path) -> None:
    policy = write_policy(tmp_path, "rules:\n  - name: a\n    action: aprove\n")
    result = subprocess.run([sys.executable, "-m", "forewarn", "run", "--simulate", "quiet", "--policy", policy,
                             "--listen-address", "127.0.0.1:0"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert f"{policy}:3: rules[0].action" in result.stderr and "Traceback" not in result.stderr


def forewarn(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "forewarn", *args], capture_output=True, text=True, timeout=30)


def test_manual_approve_command(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator("platform-reboot", rate_limit=None)
    event_id = wait_until(lambda: sim.sim.current()[1], timeout=5)[0]["EventId"]
    unknown = forewarn("approve", "NOPE", "--imds-endpoint", sim.url)
    assert unknown.returncode == 1 and "not in the current document: NOPE" in unknown.stderr
    assert sim.sim.approval_posts == []
    done = forewarn("approve", event_id, "--imds-endpoint", sim.url, "--api-version", "2019-08-01")
    assert done.returncode == 0, done.stderr
    assert f"approved {event_id}" in done.stdout
    assert sim.sim.approval_posts[0]["event_ids"] == [event_id]
    wait_until(lambda: status(sim) == ["Started"], timeout=5)
    again = forewarn("approve", event_id, "--imds-endpoint", sim.url)
    assert again.returncode == 1 and "already started" in again.stderr


def test_policy_commands(tmp_path: Path) -> None:
    ok = forewarn("policy", "check", "--no-command-check", str(EXAMPLES / "drain-then-approve.yaml"))
    assert ok.returncode == 0 and "OK (3 rule(s)" in ok.stdout
    bad = forewarn("policy", "check", write_policy(tmp_path, "rules: [{name: a, action: maybe}]\n"))
    assert bad.returncode == 2 and "rules[0].action: 'maybe' is not valid; valid: approve, hold" in bad.stderr
    document = tmp_path / "doc.json"
    document.write_text(json.dumps({"DocumentIncarnation": 3, "Events": [
        {"EventId": "F1", "EventType": "Freeze", "ResourceType": "VirtualMachine", "Resources": ["vm-0"],
         "EventStatus": "Scheduled", "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT", "Description": "",
         "EventSource": "Platform", "DurationInSeconds": 5},
        {"EventId": "R1", "EventType": "Reboot", "ResourceType": "VirtualMachine", "Resources": ["vm-0"],
         "EventStatus": "Scheduled", "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT", "Description": "",
         "EventSource": "Platform", "DurationInSeconds": -1}]}))
    explained = forewarn("policy", "explain", str(EXAMPLES / "docs-sample.yaml"), "--document", str(document),
                         "--vm-name", "vm-0")
    assert explained.returncode == 0, explained.stderr
    text = explained.stdout
    assert "F1" in text and "matched  short-freeze" in text and "decision APPROVE" in text
    assert "R1" in text and "matched  everything-else" in text and "decision HOLD: rule everything-else" in text
    assert "skipped  user-initiated: source Platform not in ['User']" in text


def test_several_events_are_approved_in_one_post(simulator: Callable[..., SimulatorHandle],
                                                 collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator({"events": [{"at": 0.5, "type": "Reboot", "source": "User", "notice": 900, "id": "U1"},
                                {"at": 0.5, "type": "Redeploy", "source": "User", "notice": 900, "id": "U2"}]})
    proc = collector(sim.url, "--policy", str(EXAMPLES / "docs-sample.yaml"))
    wait_until(lambda: status(sim) == ["Started", "Started"], timeout=15)
    assert [sorted(post["event_ids"]) for post in sim.sim.approval_posts] == [["U1", "U2"]]
    assert sorted(r["subject"] for r in approved_records(proc)) == ["U1", "U2"]


def test_approval_cap_holds_what_exceeds_it(tmp_path: Path, simulator: Callable[..., SimulatorHandle],
                                            collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator({"events": [{"at": 0.5, "type": "Reboot", "source": "User", "notice": 900, "id": "U1"},
                                {"at": 0.5, "type": "Redeploy", "source": "User", "notice": 900, "id": "U2"}]})
    policy = write_policy(tmp_path, "max_approvals_per_hour: 1\n"
                          "rules: [{name: user, match: {source: [User]}, action: approve}]\n")
    proc = collector(sim.url, "--policy", policy)
    wait_until(lambda: "approval cap reached (1 per hour)" in proc.log(), timeout=15, message="the cap")
    wait_for_polls(proc)
    assert [len(post["event_ids"]) for post in sim.sim.approval_posts] == [1]


def test_failed_post_is_counted_and_retried(simulator: Callable[..., SimulatorHandle],
                                            collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator("user-reboot")
    sim.sim.faults.post_queue.append("500")
    proc = collector(sim.url, "--policy", str(EXAMPLES / "docs-sample.yaml"))
    wait_until(lambda: status(sim) == ["Started"], timeout=30, message="approved on a retry")
    assert len(sim.sim.approval_posts) == 1, "the first POST failed (500) before reaching the simulator's log"
    samples = proc.metrics()
    assert sample(samples, "azure_scheduled_events_approvals_total", event_type="Reboot", result="failed") == 1
    assert sample(samples, "azure_scheduled_events_approvals_total", event_type="Reboot", result="approved") == 1
    assert "will retry" in proc.log()


class _Webhook:
    """A local webhook endpoint that records what it is sent and answers with a chosen status."""

    def __init__(self, status: int = 200, delay: float = 0.0) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        hook = self
        self.bodies: list[dict[str, Any]] = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                hook.bodies.append(json.loads(self.rfile.read(length)))
                time.sleep(delay)  # the scenario: a slow webhook
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/drain?token=WEBHOOK-SECRET"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def webhook_policy(tmp_path: Path, url: str, timeout: float = 5) -> str:
    return write_policy(tmp_path, f"""
rules:
  - name: drain
    match: {{event_type: [Reboot], affects_this_vm: true}}
    action: approve
    prepare:
      - name: drain-webhook
        webhook: "{url}"
        timeout: {timeout}
""", "webhook.yaml")


def test_webhook_prepare_hook_gets_the_event_and_its_url_is_never_logged(
        tmp_path: Path, simulator: Callable[..., SimulatorHandle], collector: Callable[..., CollectorProcess]) -> None:
    hook = _Webhook()
    try:
        sim = simulator("platform-reboot")
        proc = collector(sim.url, "--policy", webhook_policy(tmp_path, hook.url))
        wait_until(lambda: sim.sim.approval_posts, timeout=15, message="approval after the webhook")
        (body,) = hook.bodies
        assert body["hook"] == "prepare" and body["rule"] == "drain" and body["event"]["EventType"] == "Reboot"
        assert "WEBHOOK-SECRET" not in proc.log() and "/hooks/drain" not in proc.log()
        assert sample(proc.metrics(), "azure_scheduled_events_hook_runs_total", hook="prepare",
                      result="success") == 1
    finally:
        hook.stop()


def test_webhook_error_status_and_hook_timeout_hold_the_approval(
        tmp_path: Path, simulator: Callable[..., SimulatorHandle], collector: Callable[..., CollectorProcess]) -> None:
    refusing, slow = _Webhook(status=503), _Webhook(delay=3)
    try:
        sim = simulator("platform-reboot")
        first = collector(sim.url, "--policy", webhook_policy(tmp_path, refusing.url), name="a")
        second = collector(sim.url, "--policy", webhook_policy(tmp_path, slow.url, timeout=1), name="b")
        wait_until(lambda: sample(first.metrics(), "azure_scheduled_events_hook_runs_total", hook="prepare",
                                  result="failure") == 1, timeout=10, message="the refused webhook counted")
        wait_until(lambda: sample(second.metrics(), "azure_scheduled_events_hook_runs_total", hook="prepare",
                                  result="timeout") == 1, timeout=10, message="the webhook timeout counted")
        wait_for_polls(first)
        wait_for_polls(second)
        assert sim.sim.approval_posts == []
        assert len(refusing.bodies) == len(slow.bodies) == 1, "a failed hook is not run again"
    finally:
        refusing.stop()
        slow.stop()


def test_command_hook_timeout_kills_it_and_holds(tmp_path: Path, simulator: Callable[..., SimulatorHandle],
                                                 collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator("platform-reboot")
    policy = write_policy(tmp_path, f"""
rules:
  - name: slow-drain
    match: {{event_type: [Reboot]}}
    action: approve
    prepare:
      - command: {json.dumps([sys.executable, "-c", "import time; time.sleep(30)"])}
        timeout: 1
""")
    proc = collector(sim.url, "--policy", policy)
    wait_until(lambda: sample(proc.metrics(), "azure_scheduled_events_hook_runs_total", hook="prepare",
                              result="timeout") == 1, timeout=15)
    assert sim.sim.approval_posts == [] and "killed" in proc.log()
    # polling went on while the hook ran
    assert sample(proc.metrics(), "azure_scheduled_events_imds_up") == 1
