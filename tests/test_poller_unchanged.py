"""A poll whose reply is byte for byte the last good reply skips decoding, parsing and the diff (the client
hands back the same Document, and the poller takes that as "nothing changed"). Only the cost may differ:
the same replies polled the long way, where every reply is parsed afresh, must leave every output the same
after every poll: the view (health, last success, document, status times), the /metrics exposition (request
counters and histogram counts included; only measured durations are left out), what listeners are told, the
records and the saved state, across errors, bad replies, changes, warnings and a restart."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import forewarn.imds.client as client_module
from forewarn.agent import request_observer
from forewarn.imds.client import ImdsClient, RateLimiter
from forewarn.imds.document import Document, parse_document
from forewarn.imds.instance import VmInfo
from forewarn.metrics import Metrics
from forewarn.outbox.outbox import Outbox
from forewarn.poller import OutboxMetrics, Poller
from forewarn.tracker import Change

from peers.hostile_imds import Behaviour, HostileImds, Reply, document, event

QUIET = Reply(body=document(1))
ONE = Reply(body=document(2, event("E1")))
# NotBefore unreadable: a warning for every poll of this document, and the event is kept.
WARNED = Reply(body=document(3, event("E1"), event("E2", not_before="not a date")))
STARTED = Reply(body=document(4, event("E2", status="Started", not_before="")))
FAILING = Reply(status=500, body="busy")
INVALID = Reply(body="{not json")

RESTART = None
#: Repeats of a good reply, a repeat after an error and after a bad reply, after a different reply,
#: repeats of a document with warnings, and a restart in the middle of repeats.
SCRIPT: list[Behaviour | None] = [
    QUIET, QUIET, QUIET, FAILING, QUIET, INVALID, INVALID, QUIET, ONE, ONE, QUIET, QUIET, ONE,
    WARNED, WARNED, FAILING, WARNED, RESTART, WARNED, WARNED, STARTED, STARTED, INVALID, STARTED,
]


class Listener:
    def __init__(self) -> None:
        self.calls: list[tuple[int, list[tuple[str, str]], str | None]] = []

    def on_changes(self, document: Document, changes: Sequence[Change], vm: VmInfo) -> None:
        self.calls.append((document.incarnation, [(str(c.kind), c.event.event_id) for c in changes], vm.name))


class ParseEveryReply(ImdsClient):
    """The long way: no reply is recognised as a repeat, so every poll decodes, parses and diffs."""

    def _parse_events(self, body: bytes) -> Document:
        return parse_document(body)


class Clock:
    def __init__(self) -> None:
        self.now = 1_900_000_000.0

    def __call__(self) -> float:
        return self.now


def exposition(metrics: Metrics) -> list[str]:
    """The /metrics text without what measures time spent (the request durations' buckets and sum, and the
    process's own CPU, memory and descriptors); the durations' count stays, so a request that was not observed
    shows."""
    text = metrics.render()[0].decode()
    return [line for line in text.splitlines()
            if not line.startswith(("azure_scheduled_events_imds_request_duration_seconds_bucket",
                                    "azure_scheduled_events_imds_request_duration_seconds_sum", "process_"))]


def run(script: Sequence[Behaviour | None], state_dir: Path, parse_every_reply: bool) -> list[Any]:
    """Poll through the script; what was observable after each poll, then the records and the saved state."""
    peer = HostileImds()
    clock = Clock()
    seen: list[Any] = []
    kind = ParseEveryReply if parse_every_reply else ImdsClient

    def start() -> tuple[Poller, Metrics, Outbox, Listener]:
        metrics = Metrics(clock=clock)
        outbox = Outbox(state_dir, ["file"], 10_000, OutboxMetrics(metrics))
        client = kind(peer.url, limiter=RateLimiter(limit=1000), observe=request_observer(metrics))
        poller = Poller(client, metrics, outbox, poll_interval=1.0, clock=clock)
        listener = Listener()
        poller.listeners.append(listener)
        return poller, metrics, outbox, listener

    poller, metrics, outbox, listener = start()
    try:
        for step in script:
            if step is None:  # a restart: a new process on the same state dir
                poller.client.close()
                outbox.close()
                poller, metrics, outbox, listener = start()
                continue
            peer.behaviour = step
            clock.now += 1.0
            poller.poll_once()
            view = metrics.views.view
            seen.append({"view": (view.imds_up, view.last_success, view.document, dict(view.status_since), view.vm,
                                  view.store_writable),
                         "metrics": exposition(metrics), "listener": copy.deepcopy(listener.calls)})
        records = [record.to_dict() for record in outbox.take("file", 1000).records]
        seen.append({"records": records, "saved": outbox.load_document()})
    finally:
        poller.client.close()
        outbox.close()
        peer.stop()
    return seen


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bytes]]:
    """Every reply body the client parsed."""
    bodies: list[bytes] = []

    def counting(payload: Any) -> Document:
        bodies.append(payload)
        return parse_document(payload)

    monkeypatch.setattr(client_module, "parse_document", counting)
    yield bodies


def test_an_unchanged_reply_is_not_parsed_again_yet_every_output_is_the_same(tmp_path: Path,
                                                                            parses: list[bytes]) -> None:
    reference = run(SCRIPT, tmp_path / "reference", parse_every_reply=True)
    assert parses == []  # the reference parsed outside the client's reuse
    skipping = run(SCRIPT, tmp_path / "skipping", parse_every_reply=False)

    # The skip happened: of the 18 good replies, only the 7 that differ from the last good one were parsed
    # (the first of each process and each change), and each bad reply every time it came.
    good = [step for step in SCRIPT if step is not None and step not in (FAILING, INVALID)]
    assert len(good) == 18
    assert len(parses) == 7 + SCRIPT.count(INVALID)

    for number, (expected, actual) in enumerate(itertools.zip_longest(reference, skipping)):
        assert actual == expected, f"poll {number + 1} differs"


def test_the_script_exercises_what_the_comparison_relies_on(tmp_path: Path) -> None:
    """The comparison above is only worth something if the outputs move: check a few of them outright."""
    seen = run(SCRIPT, tmp_path / "state", parse_every_reply=False)
    polls, final = seen[:-1], seen[-1]

    def value(poll: dict[str, Any], name: str) -> float:
        line = next(line for line in poll["metrics"] if line.startswith(name + " ") or line.startswith(name + "{"))
        return float(line.rsplit(" ", 1)[1])

    # Polls 2-3 repeat poll 1: each still a success, one second later, counted and told to the listener.
    assert [poll["view"][1] - polls[0]["view"][1] for poll in polls[:3]] == [0.0, 1.0, 2.0]
    assert [len(poll["listener"]) for poll in polls[:3]] == [1, 2, 3]
    counted = 'azure_scheduled_events_imds_requests_total{code="200",method="GET"}'
    assert [value(poll, counted) for poll in polls[:3]] == [2.0, 3.0, 4.0]  # the first poll also read compute
    assert [value(poll, "azure_scheduled_events_imds_request_duration_seconds_count{method=\"GET\"}")
            for poll in polls[:3]] == [2.0, 3.0, 4.0]
    # A repeat after an error is up again; a bad reply repeated is counted as invalid each time.
    assert [poll["view"][0] for poll in polls[2:5]] == [True, False, True]
    assert [value(poll, "azure_scheduled_events_document_errors_total") for poll in polls[4:8]] == [0, 1, 2, 2]
    # The warned document counts its warning at every poll, repeats included.
    warnings = [value(poll, "azure_scheduled_events_document_warnings_total") for poll in polls[12:16]]
    assert warnings == [0.0, 1.0, 2.0, 2.0]
    # Records: E1 added, removed (back to quiet), added again; E2 added; E1 removed, E2 updated (after the
    # restart); nothing twice.
    changes = [(record["data"]["change"], record["subject"]) for record in final["records"]]
    assert changes == [("added", "E1"), ("removed", "E1"), ("added", "E1"), ("added", "E2"),
                       ("removed", "E1"), ("updated", "E2")]
    assert final["saved"].incarnation == 4
