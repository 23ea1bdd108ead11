"""The handover between active replicas (forewarn.fleet.handover, FleetCommitter): what the previous holder
announced is not announced again, only what surely reached the sinks is handed over, and a hostile annotation
is ignored."""

from __future__ import annotations

import base64
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from forewarn.fleet import handover
from forewarn.fleet.metrics import FleetMetrics
from forewarn.fleet.service import FleetCommitter
from forewarn.outbox.outbox import Outbox
from test_fleet_state import news


def committer(tmp_path: Path, name: str) -> FleetCommitter:
    return FleetCommitter(Outbox(tmp_path / name, ["file"]), FleetMetrics(["resourcegraph"]), clock=lambda: 100.0)


def records(outbox: Outbox) -> list[str]:
    return [f"{record.type.rsplit('.', 1)[-1]}:{record.subject}" for record in outbox.take("file", 1000).records]


def test_a_successor_announces_only_what_its_predecessor_did_not(tmp_path: Path) -> None:
    first = committer(tmp_path, "a")
    first.snapshot([news("Scheduled", "E-1"), news("Scheduled", "E-2")], started_at=99.0, complete=True)
    assert first.handover() is None          # two records wait for the sink: nothing handed over yet
    taken = first.outbox.take("file", 1000)
    first.outbox.ack("file", taken.last)
    note = first.handover()
    assert note is not None and handover.decode(note) == {handover.digest(news("Scheduled", "E-1")),
                                                          handover.digest(news("Scheduled", "E-2"))}

    second = committer(tmp_path, "b")        # its own, empty state: a fresh pod
    second.inherit(note)
    moved = news("Started", "E-2")
    second.snapshot([news("Scheduled", "E-1"), moved, news("Scheduled", "E-3")], started_at=99.0, complete=True)
    assert records(second.outbox) == ["added:E-2", "added:E-3"]   # E-1 as announced; E-2 changed; E-3 new
    assert second.metrics.handed_over.value == 1
    assert {event.event.event_id for event in second.tracker.open_events} == {"E-1", "E-2", "E-3"}
    # the complete snapshot ended the inheritance; the tracker knows E-1 now, so later news is ordinary
    second.snapshot([news("Started", "E-1"), moved, news("Scheduled", "E-3")], started_at=99.0, complete=True)
    assert records(second.outbox)[-1] == "updated:E-1"


def test_the_handover_carries_what_was_inherited_until_it_is_settled(tmp_path: Path) -> None:
    """A successor that dies before its first complete snapshot passes its predecessor's note on."""
    inherited = {handover.digest(news("Scheduled", "E-9"))}
    second = committer(tmp_path, "b")
    second.inherit(handover.encode(inherited))
    second.news([news("Scheduled", "E-1")])
    taken = second.outbox.take("file", 1000)
    second.outbox.ack("file", taken.last)
    assert handover.decode(second.handover()) == inherited | {handover.digest(news("Scheduled", "E-1"))}


@pytest.mark.parametrize("text", [
    "not base64!", "AAAA", base64.b64encode(b"x" * 9).decode(), "é" * 12,
    base64.b64encode(b"\0" * 8 * (handover.MAX_DIGESTS + 1)).decode(),
])
def test_a_hostile_annotation_is_ignored_with_a_warning(text: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="forewarn.fleet.handover"):
        assert handover.decode(text) == frozenset()
    assert "ignoring it: what it lists may be announced or approved again" in caplog.text


def test_the_note_is_capped_to_fit_the_api_servers_annotation_limit(caplog: pytest.LogCaptureFixture) -> None:
    digests = {index.to_bytes(8, "big") for index in range(handover.MAX_DIGESTS + 50)}
    with caplog.at_level(logging.WARNING, logger="forewarn.fleet.handover"):
        text = handover.encode(digests)
    assert len(handover.decode(text)) == handover.MAX_DIGESTS
    assert len(handover.ANNOTATION) + len(text) <= 256 * 1024
    assert "may be announced again" in caplog.text


def test_the_digest_follows_the_documented_fields_and_ignores_the_feed() -> None:
    event = news("Scheduled", "E-1")
    assert handover.digest(event) == handover.digest(replace(event, origin="resourcegraph", delivery_id="x"))
    assert handover.digest(event) != handover.digest(news("Started", "E-1"))
