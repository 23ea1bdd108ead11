"""Notification sinks (webhook, slack, teams, template) against stand-ins of the real services on loopback.

End to end, `forewarn run` drains a preloaded outbox to a stand-in through an outage, a 429 with
Retry-After and a SIGKILL; every record arrives, none twice for the same record id.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from forewarn.imds.document import parse_document
from forewarn.imds.instance import VmInfo
from forewarn.outbox.outbox import Outbox
from forewarn.records import Record, approval_record, to_record
from forewarn.sinks import build_sinks
from forewarn.tracker import diff_documents

from conftest import CollectorProcess, SimulatorHandle, sample, wait_until
from peers.notify import NotifyPeer

VM = VmInfo(name="vm-0", vm_id="4d1824cf-fdc0-5660-b82f-b2a54105ac90", location="westeurope")
SINK_ENV = {"webhook": "FOREWARN_WEBHOOK_URL", "slack": "FOREWARN_SLACK_WEBHOOK_URL",
            "teams": "FOREWARN_TEAMS_WEBHOOK_URL"}
PEER_KIND = {"webhook": "cloudevents", "slack": "slack", "teams": "teams"}


def make_records(count: int, resources: list[str] | None = None, description: str = "Host maintenance.",
                 event_type: str = "Reboot") -> list[Record]:
    records = []
    for i in range(count):
        document = parse_document({"DocumentIncarnation": i + 1, "Events": [{
            "EventId": f"00000000-0000-0000-0000-{i:012d}", "EventType": event_type,
            "ResourceType": "VirtualMachine", "Resources": resources or ["vm-0", "vm-1"],
            "EventStatus": "Scheduled", "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT", "Description": description,
            "EventSource": "Platform", "DurationInSeconds": -1}]})
        (change,) = diff_documents(None, document)
        records.append(to_record(change, VM, datetime.now(timezone.utc)))
    return records


@pytest.fixture
def peers() -> Iterator[Callable[[str], NotifyPeer]]:
    started: list[NotifyPeer] = []

    def start(kind: str) -> NotifyPeer:
        peer = NotifyPeer(kind)
        started.append(peer)
        return peer

    yield start
    for peer in started:
        peer.stop()


def settings_for(sink: str, url: str, state_dir: Path, **extra: Any) -> Any:
    from forewarn.cli import build_parser  # the real option table, resolved as `forewarn run` does
    from forewarn.config import resolve

    args = build_parser().parse_args(["run", "--sink", sink, "--state-dir", str(state_dir)])
    env = {SINK_ENV.get(sink, "FOREWARN_TEMPLATE_URL"): url,
           **{f"FOREWARN_{key.upper()}": str(value) for key, value in extra.items()}}
    return resolve(args, environ=env)


# --- messages as the services require them ---------------------------------------------------------------
@pytest.mark.parametrize("mode", ["structured", "binary"])
def test_webhook_posts_cloudevents_the_sdk_parses(mode: str, tmp_path: Path,
                                                  peers: Callable[[str], NotifyPeer]) -> None:
    peer = peers("cloudevents")
    (sink,) = build_sinks(["webhook"], settings_for("webhook", peer.url, tmp_path, webhook_mode=mode))
    records = [*make_records(2), approval_record(
        parse_document({"DocumentIncarnation": 3, "Events": [{"EventId": "E-9", "EventType": "Freeze",
                                                               "ResourceType": "VirtualMachine",
                                                               "Resources": ["vm-0"], "EventStatus": "Scheduled",
                                                               "NotBefore": ""}]}).events[0],
        VM, "freeze-ok", False, 3, datetime.now(timezone.utc))]
    sink.send(records)
    sink.close()
    assert peer.received.errors == []
    got = peer.received.accepted
    assert [item["mode"] for item in got] == [mode] * 3
    for item, record in zip(got, records, strict=True):
        expected = record.to_dict()
        assert item["data"] == expected.pop("data")
        assert {key: item["attributes"][key] for key in expected} == expected


def test_slack_message_within_block_kit_limits_for_a_huge_event(tmp_path: Path,
                                                                 peers: Callable[[str], NotifyPeer]) -> None:
    peer = peers("slack")
    settings = settings_for("slack", peer.url, tmp_path, notify_link="https://grafana.example/d/forewarn")
    (sink,) = build_sinks(["slack"], settings)
    record, = make_records(1, resources=["vm-0", *(f"vm-{i:04d}" for i in range(800))], description="x" * 9000)
    sink.send([record])
    sink.close()
    assert peer.received.errors == []
    (message,) = [item["message"] for item in peer.received.accepted]
    header, facts = message["blocks"][0], message["blocks"][1]
    assert header["text"]["text"] == "Reboot scheduled on vm-0"
    text = {field["text"].split("\n")[0]: field["text"].split("\n", 1)[1] for field in facts["fields"]}
    assert text["*When*"].startswith("2022-04-11 22:26 UTC (") and "ago)" in text["*When*"]
    assert text["*Resources*"].startswith("vm-0, vm-0000") and text["*Resources*"].endswith("more")
    assert message["blocks"][-1]["elements"][0]["url"] == "https://grafana.example/d/forewarn"


def test_teams_card_is_valid_against_the_adaptive_card_schema(tmp_path: Path,
                                                               peers: Callable[[str], NotifyPeer]) -> None:
    peer = peers("teams")
    (sink,) = build_sinks(["teams"], settings_for("teams", peer.url, tmp_path, notify_link="https://x.example/"))
    records = make_records(2, event_type="Freeze")
    sink.send(records)
    sink.close()
    assert peer.received.errors == []
    assert peer.received.ids() == [record.id for record in records]
    facts = peer.received.accepted[0]["facts"]
    assert facts["Event"] == "Freeze" and facts["VM"] == "vm-0" and facts["Status"] == "Scheduled"


def test_teams_stand_in_refuses_an_invalid_card(peers: Callable[[str], NotifyPeer]) -> None:
    """The schema check can fail: a FactSet without facts is refused."""
    import requests

    peer = peers("teams")
    card = {"type": "AdaptiveCard", "version": "1.4", "body": [{"type": "FactSet"}]}
    response = requests.post(peer.url, json={"type": "message", "attachments": [
        {"contentType": "application/vnd.microsoft.card.adaptive", "content": card}]}, timeout=5)
    assert response.status_code == 400 and "{'type': 'FactSet'} is not valid" in peer.received.errors[0]


# --- behaviour -------------------------------------------------------------------------------------------
def test_filters_pick_types_changes_and_this_vm(tmp_path: Path, peers: Callable[[str], NotifyPeer]) -> None:
    peer = peers("cloudevents")
    reboot, = make_records(1)
    freeze, = make_records(1, event_type="Freeze")
    elsewhere, = make_records(1, resources=["vm-7"], event_type="Freeze")
    (sink,) = build_sinks(["webhook"], settings_for("webhook", peer.url, tmp_path,
                                                    webhook_filter="types=Freeze changes=added,removed this-vm"))
    sink.send([reboot, freeze, elsewhere])
    sink.close()
    assert peer.received.ids() == [freeze.id]


def test_a_record_id_is_posted_once_even_after_a_restart(tmp_path: Path, peers: Callable[[str], NotifyPeer]) -> None:
    peer = peers("slack")
    records = make_records(3)
    for _ in range(2):  # two runs with the same state dir, the outbox handing over the same records
        (sink,) = build_sinks(["slack"], settings_for("slack", peer.url, tmp_path, slack_rate_limit=0))
        sink.send(records)
        sink.close()
    assert peer.received.ids() == [record.id for record in records]


def test_template_renders_in_a_sandbox_and_is_checked_at_start(tmp_path: Path,
                                                                peers: Callable[[str], NotifyPeer]) -> None:
    peer = peers("cloudevents")
    template = tmp_path / "body.j2"
    template.write_text('{"specversion": "1.0", "id": {{ record.id | tojson }}, "source": "x", "type": "t", '
                        '"data": {"text": {{ (headline ~ " " ~ when) | tojson }}, "vm": {{ vm.name | tojson }}}}')
    (sink,) = build_sinks(["template"], settings_for("template", peer.url, tmp_path,
                                                     template_file=str(template)))
    record, = make_records(1)
    sink.send([record])
    sink.close()
    (item,) = peer.received.accepted
    assert item["id"] == record.id and item["data"]["vm"] == "vm-0"
    assert item["data"]["text"].startswith("Reboot scheduled on vm-0 2022-04-11 22:26 UTC")


@pytest.mark.parametrize(("text", "message"), [
    ('{"a": {{ "".__class__.__mro__ | tojson }}}', "SecurityError"),  # the sandbox refuses it
    ('{"a": {{ record.nope }}}', "has no attribute 'nope'"),                    # StrictUndefined
    ('{"a": {{ headline }}}', "not valid JSON"),                                # unquoted string
    ('{"a": {% if %}}', "line 1"),                                              # syntax
])
def test_bad_templates_stop_the_start_with_one_line(text: str, message: str, tmp_path: Path) -> None:
    template = tmp_path / "body.j2"
    template.write_text(text)
    result = subprocess.run([sys.executable, "-m", "forewarn", "run", "--sink", "template", "--template-file",
                             str(template), "--state-dir", str(tmp_path / "state")],
                            env={"FOREWARN_TEMPLATE_URL": "http://127.0.0.1:9/x", "PATH": ""},
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and str(template) in result.stderr
    assert "Traceback" not in result.stderr and message in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(("args", "env", "message"), [
    (["--sink", "slack"], {}, "FOREWARN_SLACK_WEBHOOK_URL or --slack-webhook-url-file"),
    (["--sink", "teams", "--teams-webhook-url", "https://h.example/SECRET-KEY-PATH"], {},
     "--teams-webhook-url on the command line"),
    (["--sink", "webhook"], {"FOREWARN_WEBHOOK_URL": "ftp://h/SECRET-KEY-PATH"}, "expected an http:// or https://"),
    (["--sink", "slack", "--slack-filter", "changes=started"], {"FOREWARN_SLACK_WEBHOOK_URL": "https://h/k"},
     "--slack-filter: term 1: change 'started' is not known"),
])
def test_configuration_mistakes_exit_2_without_echoing_the_url(args: list[str], env: dict[str, str], message: str,
                                                               tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "forewarn", "run", "--state-dir", str(tmp_path), *args],
                            env={"PATH": "", **env}, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "SECRET-KEY-PATH" not in result.stderr + result.stdout and "Traceback" not in result.stderr


def test_url_from_a_file_is_used_and_never_logged(tmp_path: Path, peers: Callable[[str], NotifyPeer],
                                                  simulator: Callable[..., SimulatorHandle],
                                                  collector: Callable[..., CollectorProcess]) -> None:
    peer = peers("slack")
    peer.received.down = True  # failures are logged: with the endpoint named, never the URL
    secret = tmp_path / "slack.url"
    secret.write_text(peer.url + "\n")
    sim = simulator("hardware-failure", speed=100)
    proc = collector(sim.url, "--sink", "slack", "--slack-webhook-url-file", str(secret), "--log-level", "debug")
    wait_until(lambda: (sample(proc.metrics(), "azure_scheduled_events_record_failures_total", sink="slack")
                        or 0) >= 1, timeout=20, message="a failed post")
    peer.received.down = False
    wait_until(lambda: len(peer.received.ids()) == len(proc.records()) >= 2, timeout=20)
    proc.stop()
    assert "http://127.0.0.1" in proc.log() and "SECRET" not in proc.log()


# --- end to end: outage, 429 + Retry-After, SIGKILL --------------------------------------------------------
def preload(state_dir: Path, sink: str, records: list[Record]) -> None:
    file_sink = f"file:{state_dir.parent / f'{state_dir.name}-records.jsonl'}"
    outbox = Outbox(state_dir, [sink, file_sink])
    outbox.append(records)
    outbox.close()


@pytest.mark.slow
@pytest.mark.parametrize("sink", ["webhook", "slack", "teams"])
def test_outage_throttling_and_sigkill_lose_nothing_and_repeat_nothing(
        sink: str, tmp_path: Path, peers: Callable[[str], NotifyPeer], simulator: Callable[..., SimulatorHandle],
        collector: Callable[..., CollectorProcess]) -> None:
    peer = peers(PEER_KIND[sink])
    records = make_records(40)
    expected = [record.id for record in records]
    preload(tmp_path / "state", sink, records)
    sim = simulator("quiet")
    env = {SINK_ENV[sink]: peer.url}
    rate = ["--webhook-rate-limit" if sink == "webhook" else f"--{sink}-rate-limit", "20"]

    # An outage first: nothing accepted, failures counted, records kept.
    peer.received.down = True
    proc = collector(sim.url, "--sink", sink, *rate, env=env)
    wait_until(lambda: len(peer.received.attempts) >= 2, timeout=20, message="retries during the outage")
    assert peer.received.ids() == []
    # Then a 429 asking for 2 s: the next attempt waits that long, not the 0.25-0.5 s of the backoff.
    peer.received.throttle, peer.received.retry_after = 1, 2
    peer.received.down = False
    wait_until(lambda: len(peer.received.ids()) >= 10, timeout=30, message="10 records delivered")
    after_429 = [at for at in peer.received.attempts if at > peer.received.throttled[0]]
    assert after_429[0] - peer.received.throttled[0] >= 1.9
    # SIGKILL while a message is in flight, then a new process on the same state dir. The stand-in is made
    # slow and drops a request whose client has gone, so the message in flight must come again from the new
    # process. (A kill between the service taking a message and the agent hearing so would repeat that one
    # message: at-least-once, see docs/notifications.md; killing early in a slow request avoids that window.)
    got = peer.received
    got.delay = 0.5
    wait_until(lambda: got.in_flight == 1 and time.monotonic() - got.attempts[-1] < 0.1, timeout=20,
               interval=0.005, message="a message just sent")
    proc.kill()
    got.delay = 0.0
    assert len(got.ids()) < len(expected), "the kill came after the drain ended"
    proc = collector(sim.url, "--sink", sink, *rate, env=env, name="state")
    wait_until(lambda: len(peer.received.ids()) >= len(expected), timeout=30, message="every record")
    wait_until(lambda: sample(proc.metrics(), "azure_scheduled_events_outbox_records", sink=sink) == 0,
               timeout=10, message="an empty backlog")
    assert peer.received.errors == []
    assert peer.received.ids() == expected, "every record, in order, each id once"
    assert got.abandoned == 1, "the message in flight at the kill was dropped, then sent again"


@pytest.mark.slow
def test_simulated_maintenance_reaches_slack_once_per_change(peers: Callable[[str], NotifyPeer],
                                                            simulator: Callable[..., SimulatorHandle],
                                                            collector: Callable[..., CollectorProcess]) -> None:
    peer = peers("slack")
    sim = simulator("cancelled-maintenance", speed=60)
    proc = collector(sim.url, "--sink", "slack", env={"FOREWARN_SLACK_WEBHOOK_URL": peer.url})
    records = wait_until(lambda: len(proc.records()) == 2 and proc.records(), timeout=20)
    wait_until(lambda: len(peer.received.ids()) == 2, timeout=10)
    assert peer.received.ids() == [record["id"] for record in records]
    titles = [item["message"]["blocks"][0]["text"]["text"] for item in peer.received.accepted]
    assert titles == ["Reboot scheduled on vm-0", "Reboot over (cancelled) on vm-0"]
    assert json.dumps(peer.received.accepted).count("SECRET") == 0


def test_the_deploy_file_declares_the_columns_the_logs_sink_sends() -> None:
    from forewarn.sinks.logsingestion import COLUMNS, to_row

    template = json.loads((Path(__file__).parent.parent / "deploy/azure-monitor/forewarn-logs.json").read_text())
    by_type = {r["type"]: r for r in template["resources"]}
    rule = by_type["Microsoft.Insights/dataCollectionRules"]["properties"]
    (stream,) = rule["streamDeclarations"].values()
    table = by_type["Microsoft.OperationalInsights/workspaces/tables"]["properties"]["schema"]["columns"]
    assert [c["name"] for c in stream["columns"]] == list(COLUMNS) == [c["name"] for c in table]
    assert rule["dataFlows"][0]["streams"] == ["[variables('streamName')]"]
    assert template["variables"]["streamName"] in rule["streamDeclarations"]
    for record in make_records(2):
        assert set(to_row(record)) <= set(COLUMNS)


@pytest.mark.slow
@pytest.mark.parametrize("per_second", [5.0])
def test_the_rate_limit_spaces_the_messages_of_a_sink(
        per_second: float, tmp_path: Path, peers: Callable[[str], NotifyPeer],
        simulator: Callable[..., SimulatorHandle], collector: Callable[..., CollectorProcess]) -> None:
    peer = peers("cloudevents")
    records = make_records(12)
    preload(tmp_path / "state", "webhook", records)
    collector(simulator("quiet").url, "--sink", "webhook", "--webhook-rate-limit", str(per_second),
              env={"FOREWARN_WEBHOOK_URL": peer.url})
    wait_until(lambda: len(peer.received.ids()) == len(records), timeout=20, message="every record")
    times = peer.received.attempts
    assert len(times) == len(records)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) >= 1 / per_second - 0.02, gaps  # never faster than the limit
    assert times[-1] - times[0] >= (len(records) - 1) / per_second - 0.05


def test_an_endless_answer_is_not_read_past_the_cap() -> None:
    import socket
    import threading

    from forewarn.sinks.notify import MAX_ANSWER_BYTES, Poster

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    sent = [0]

    def answer() -> None:
        conn, _ = server.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\n\r\n")
        try:
            while sent[0] < 50 * 1024 * 1024:  # far more than the cap, if anyone read it
                conn.sendall(b" " * 65536)
                sent[0] += 65536
        except OSError:
            pass
        conn.close()

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    poster = Poster(f"http://127.0.0.1:{server.getsockname()[1]}/hook", timeout=5)
    poster.post(b"{}", {"Content-Type": "application/json"})
    thread.join(10)
    server.close()
    assert sent[0] < 50 * 1024 * 1024, "the connection was dropped instead of read to the end"
    assert MAX_ANSWER_BYTES <= 64 * 1024
