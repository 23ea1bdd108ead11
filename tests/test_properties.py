"""Data from IMDS cannot break /metrics or records (issue 12).

IMDS answers over plain HTTP on a link-local address, so anything may come back. The contract tested here:
`parse_document` returns a Document or raises DocumentError for any input, and every Document it returns
renders into an exposition that real Prometheus parsers accept (finite values, UTF-8 labels) and into
records that serialize as UTF-8 JSON valid against the shipped schema, with deterministic ids.
"""

from __future__ import annotations

import json
import math
import subprocess
import threading
from collections.abc import Iterable
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import requests
import yaml
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from forewarn.imds.document import Document, DocumentError, parse_document
from forewarn.imds.instance import VmInfo
from forewarn.metrics import Metrics
from forewarn.records import Record, approval_record, to_record
from forewarn.tracker import Tracker

from conftest import free_port, require_promtool, require_tool, wait_until
from strategies import (
    EVENT_FIELDS,
    HOSTILE_SCALARS,
    deep_json_text,
    deep_json_value,
    hostile_documents,
    hostile_inputs,
    hostile_texts,
    raw_documents,
)

SCHEMA = json.loads(resources.files("forewarn").joinpath("schemas/record.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA, format_checker=jsonschema.FormatChecker())
VM = VmInfo(name="vm-0", vm_id="id-0", resource_id="/subscriptions/s/resourceGroups/rg/providers/"
            "Microsoft.Compute/virtualMachines/vm-0", location="westeurope")
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"

# Enough examples to reach the odd corners, few enough that the file runs in well under a minute.
PROPERTY = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much, HealthCheck.large_base_example])


def parsed(payload: Any) -> Document | None:
    """The Document, or None for a DocumentError; any other exception fails the test that called it."""
    try:
        document = parse_document(payload)
    except DocumentError:
        return None
    assert isinstance(document, Document)
    return document


# --- metrics ------------------------------------------------------------------------------------------

def expositions(document: Document) -> tuple[bytes, bytes]:
    """The text-format and OpenMetrics expositions with `document` as the current one."""
    now = NOW.timestamp()
    metrics = Metrics(clock=lambda: now)
    metrics.views.vm_known(VM)
    metrics.views.document_seen(document, now, {event.event_id: now for event in document.events})
    text, text_type = metrics.render("")
    openmetrics, om_type = metrics.render(OPENMETRICS)
    assert text_type.startswith("text/plain") and om_type.startswith("application/openmetrics-text")
    return text, openmetrics


def check_samples(families: Iterable[Any], document: Document) -> int:
    """Every value finite, every label a str that encodes to UTF-8, one info series per event; returns the
    number of samples."""
    count = 0
    info: list[dict[str, str]] = []
    for family in families:
        for sample in family.samples:
            count += 1
            assert math.isfinite(sample.value), sample
            for name, value in sample.labels.items():
                assert isinstance(value, str), (name, value)
                value.encode("utf-8")  # raises on a lone surrogate
            if sample.name == "azure_scheduled_event_info":
                info.append(sample.labels)
            if sample.name == "azure_scheduled_events_document_incarnation":
                assert sample.value == document.incarnation  # exactly: the parser keeps it below 2**53
    assert sorted(labels["event_id"] for labels in info) == sorted(event.event_id for event in document.events)
    return count


def check_metrics(document: Document) -> tuple[bytes, bytes]:
    text, openmetrics = expositions(document)
    count = check_samples(parse_text(text.decode("utf-8")), document)
    # "# EOF" may also appear inside a label value (an EventId of "# EOF"), but only once as a line
    assert openmetrics.endswith(b"\n# EOF\n") and openmetrics.split(b"\n").count(b"# EOF") == 1
    families = parse_openmetrics(openmetrics.decode("utf-8"))  # type: ignore[no-untyped-call]
    assert check_samples(families, document) == count
    return text, openmetrics


# --- records ------------------------------------------------------------------------------------------

def _incarnations_besides(incarnation: int) -> tuple[int, int]:
    first, second = [n for n in (0, 1, 2) if n != incarnation][:2]
    return first, second


def records_of(document: Document, observed_at: datetime = NOW) -> list[Record]:
    """A record of every kind for the events of `document`: added, updated (status flipped), removed, and
    approved (the approver's, written by records.approval_record)."""
    tracker = Tracker()
    changes = tracker.apply(document)
    flipped_at, removed_at = _incarnations_besides(document.incarnation)
    raw_events = [{**raw, "EventStatus": "Started" if raw.get("EventStatus") != "Started" else "Scheduled"}
                  for raw in document.raw["Events"]]
    flipped = parse_document({**document.raw, "DocumentIncarnation": flipped_at, "Events": raw_events})
    changes += tracker.apply(flipped)
    changes += tracker.apply(parse_document({"DocumentIncarnation": removed_at, "Events": []}))
    return [to_record(change, VM, observed_at) for change in changes] + [
        approval_record(event, VM, "all", False, document.incarnation, observed_at) for event in document.events]


def check_records(document: Document) -> list[str]:
    """Every record serializes to UTF-8 JSON that validates against the schema; returns the ids."""
    ids = []
    later = records_of(document, datetime(2030, 1, 1, tzinfo=timezone.utc))
    for record, again in zip(records_of(document), later, strict=True):
        text = record.to_json()
        text.encode("utf-8")
        loaded = json.loads(text)
        # The record as a consumer decodes it holds no lone surrogate either (to_json escapes them).
        json.dumps(loaded, ensure_ascii=False).encode("utf-8")
        errors = sorted(VALIDATOR.iter_errors(loaded), key=lambda e: list(e.absolute_path))
        assert not errors, [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in errors]
        assert again.id == record.id
        ids.append(record.id)
    assert len(set(ids)) == len(ids)
    return ids


def check_everything(payload: Any) -> Document | None:
    document = parsed(payload)
    if document is not None:
        check_metrics(document)
        check_records(document)
    return document


# --- properties ---------------------------------------------------------------------------------------

@PROPERTY
@given(hostile_inputs)
def test_parse_document_returns_a_document_or_raises_document_error(payload: Any) -> None:
    parsed(payload)


accepted_inputs = st.one_of(hostile_documents(), hostile_texts(), raw_documents())


@PROPERTY
@given(accepted_inputs)
def test_every_accepted_document_renders_an_exposition_prometheus_clients_parse(payload: Any) -> None:
    document = parsed(payload)
    if document is None:
        reject()
    check_metrics(document)


@PROPERTY
@given(accepted_inputs)
def test_every_accepted_document_turns_into_valid_records_with_deterministic_ids(payload: Any) -> None:
    document = parsed(payload)
    if document is None:
        reject()
    ids = check_records(document)
    again = parse_document(payload)
    assert [record.id for record in records_of(again)] == ids


def collect_documents(count: int) -> list[Document]:
    """`count` accepted hostile documents, drawn by Hypothesis, for tools that are run once on all of them."""
    found: list[Document] = []

    @settings(PROPERTY, max_examples=count * 3, database=None)
    @given(st.one_of(hostile_documents(), hostile_texts()))
    def draw(payload: Any) -> None:
        document = parsed(payload)
        if document is not None and len(found) < count:
            found.append(document)

    draw()
    return found


def kitchen_sinks() -> list[Document]:
    """Every hostile scalar in every event field, one event each, packed into a few large documents: each
    value the parser accepts ends up in an exposition and a record together with all the others."""
    events: dict[str, dict[str, Any]] = {}
    base = {"EventType": "Reboot", "ResourceType": "VirtualMachine", "Resources": ["vm-0"],
            "EventStatus": "Scheduled", "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT", "Description": "",
            "EventSource": "Platform", "DurationInSeconds": -1}
    for field in EVENT_FIELDS:
        for i, value in enumerate(HOSTILE_SCALARS):
            event = {**base, "EventId": f"{field}-{i}", field: value}
            document = parsed({"DocumentIncarnation": 1, "Events": [event]})
            if document is not None:
                # keyed by the id as parsed, so ids that clean to the same text are kept once
                events.setdefault(document.events[0].event_id, dict(document.raw["Events"][0]))
    values = list(events.values())
    sinks = [parse_document({"DocumentIncarnation": n, "Events": values[n::4]}) for n in range(4)]
    assert sum(len(sink.events) for sink in sinks) == len(values) > 200
    return sinks


def test_kitchen_sink_documents_render_expositions_prometheus_clients_parse() -> None:
    for document in kitchen_sinks():
        check_metrics(document)


def test_kitchen_sink_documents_turn_into_valid_records() -> None:
    for document in kitchen_sinks():
        check_records(document)


def test_promtool_accepts_the_exposition_of_every_generated_document(tmp_path: Path) -> None:
    promtool = require_promtool()
    failures = []
    for n, document in enumerate(kitchen_sinks() + collect_documents(60)):
        text, _ = expositions(document)
        result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=30)
        if result.returncode != 0 or result.stdout.strip() or result.stderr.strip():
            path = tmp_path / f"exposition-{n}.txt"
            path.write_bytes(text)
            failures.append((path.name, (result.stdout + result.stderr).decode(errors="replace")[:500]))
    assert not failures, failures


# --- a real Prometheus --------------------------------------------------------------------------------

class Expositions:
    """A loopback /metrics that serves one exposition until told to move on."""

    def __init__(self) -> None:
        self.body = b""
        self.content_type = "text/plain"
        holder = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body, content_type = holder.body, holder.content_type
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _marked(body: bytes, index: int, openmetrics: bool) -> bytes:
    """The exposition with a gauge naming it, so a query shows which one Prometheus ingested."""
    marker = f"# TYPE forewarn_test_exposition gauge\nforewarn_test_exposition {index}\n".encode()
    return body[: -len(b"# EOF\n")] + marker + b"# EOF\n" if openmetrics else body + marker


@pytest.mark.slow
def test_a_real_prometheus_scrapes_hostile_documents_without_errors(tmp_path: Path) -> None:
    served = Expositions()
    prom_port = free_port()
    config = {"global": {"scrape_interval": "300ms", "scrape_timeout": "300ms"},
              "scrape_configs": [{"job_name": "hostile",
                                  "static_configs": [{"targets": [f"127.0.0.1:{served.port}"]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    prometheus = subprocess.Popen(
        [require_tool("prometheus", "Debian package prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{prom_port}/api/v1"

    def query(expr: str) -> list[dict[str, Any]]:
        try:
            body = requests.get(f"{api}/query", params={"query": expr}, timeout=5).json()
        except requests.RequestException:
            return []
        assert body["status"] == "success", (expr, body)
        return list(body["data"]["result"])

    def value(expr: str) -> float | None:
        result = query(expr)
        return float(result[0]["value"][1]) if result else None

    try:
        documents = kitchen_sinks() + collect_documents(16)
        for index, document in enumerate(documents, start=1):
            openmetrics = index % 2 == 0
            body = expositions(document)[1 if openmetrics else 0]
            families = (parse_openmetrics if openmetrics else parse_text)(body.decode())
            samples = sum(len(family.samples) for family in families) + 1
            served.body = _marked(body, index, openmetrics)
            served.content_type = OPENMETRICS if openmetrics else "text/plain; version=0.0.4; charset=utf-8"
            what = f"exposition {index} ({'OpenMetrics' if openmetrics else 'text'}, {len(document.events)} events)"
            wait_until(lambda: value("forewarn_test_exposition") == index,  # noqa: B023 (called at once)
                       timeout=20, interval=0.2, message=f"{what} ingested")
            targets = requests.get(f"{api}/targets", timeout=5).json()["data"]["activeTargets"]
            assert [(t["health"], t["lastError"]) for t in targets] == [("up", "")], what
            assert value("up") == 1, what
            assert value("scrape_samples_scraped") == samples, what
            assert value("count(azure_scheduled_event_info) or vector(0)") == len(document.events), what
    finally:
        prometheus.terminate()
        prometheus.wait(20)
        served.close()


# --- the reported crashes -----------------------------------------------------------------------------

def _fine(event_id: str = "OK") -> dict[str, Any]:
    return {"EventId": event_id, "EventType": "Reboot", "ResourceType": "VirtualMachine", "Resources": ["vm-0"],
            "EventStatus": "Scheduled", "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT", "Description": "",
            "EventSource": "Platform", "DurationInSeconds": -1}


def _with_bad_event(**fields: Any) -> dict[str, Any]:
    return {"DocumentIncarnation": 7, "Events": [{**_fine("BAD"), **fields}, _fine()]}


def _forms(value: Any) -> list[Any]:
    text = json.dumps(value)
    return [value, text, text.encode(), json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")]


@pytest.mark.parametrize("payload", [
    deep_json_text(100_000), deep_json_text(100_000).encode(), deep_json_text(100_000, "{"),
    deep_json_value(100_000), deep_json_text(2000),
    '{"DocumentIncarnation": 1, "Events": [{"EventId": "a", "EventType": "Reboot", "EventStatus": "Started",'
    ' "Description": ' + deep_json_text(100_000) + "}]}",
], ids=["list-text", "list-bytes", "object-text", "python-value", "2000-deep", "deep-description"])
def test_deep_nesting_is_a_document_error_not_a_recursion_error(payload: Any) -> None:
    with pytest.raises(DocumentError):
        parse_document(payload)


@pytest.mark.parametrize("not_before", ["Fri, 31 Dec 9999 23:59:59 -1200", "Mon, 01 Jan 0001 00:00:00 +1400",
                                        "Mon, 11 Apr 99999999999999999999 22:26:58 GMT"])
@pytest.mark.parametrize("form", range(4))
def test_a_not_before_out_of_range_keeps_the_event_with_not_before_unknown(not_before: str, form: int) -> None:
    document = check_everything(_forms(_with_bad_event(NotBefore=not_before))[form])
    assert document is not None
    bad, fine = document.events
    assert (bad.event_id, bad.not_before) == ("BAD", None)
    assert fine.event_id == "OK" and fine.not_before == datetime(2022, 4, 11, 22, 26, 58, tzinfo=timezone.utc)
    assert any("NotBefore" in warning for warning in document.warnings)


@pytest.mark.parametrize("form", range(4))
def test_a_lone_surrogate_event_id_never_reaches_a_record_id_or_label(form: int) -> None:
    document = check_everything(_forms(_with_bad_event(EventId="\ud800"))[form])
    if document is not None:
        assert [event.event_id.encode() for event in document.events] == ["\ufffd".encode(), b"OK"]


@pytest.mark.parametrize("form", range(4))
def test_a_lone_surrogate_description_is_kept_as_valid_text(form: int) -> None:
    document = check_everything(_forms(_with_bad_event(Description="host \ud800 update"))[form])
    if form == 3:  # the surrogate encoded as raw bytes is not UTF-8: refusing the reply is as good
        assert document is None
        return
    assert document is not None
    assert [event.description for event in document.events] == ["host \ufffd update", ""]


@pytest.mark.parametrize("form", range(4))
def test_a_huge_incarnation_does_not_stop_metrics(form: int) -> None:
    document = check_everything(_forms({"DocumentIncarnation": 10**400, "Events": [_fine()]})[form])
    assert document is None or document.incarnation <= 2**53


@pytest.mark.parametrize("duration", [10**400, -(10**400), 2**63, 1e308, -2, "900000000000000"],
                         ids=["1e400", "-1e400", "2**63", "1e308", "-2", "string-9e14"])
@pytest.mark.parametrize("form", range(4))
def test_a_huge_duration_keeps_the_event_with_duration_unknown(duration: Any, form: int) -> None:
    document = check_everything(_forms(_with_bad_event(DurationInSeconds=duration))[form])
    assert document is not None
    assert [(event.event_id, event.duration_seconds) for event in document.events] == [("BAD", None), ("OK", -1)]


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "9" * 400],
                         ids=["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "400-nines"])
@pytest.mark.parametrize("field", ["DocumentIncarnation", "DurationInSeconds", "NotBefore", "Description"])
def test_json_constants_and_numbers_past_float_range(token: str, field: str) -> None:
    events = [_fine("BAD"), _fine()]
    document: dict[str, Any] = {"DocumentIncarnation": 3, "Events": events}
    target = document if field == "DocumentIncarnation" else events[0]
    target[field] = "__hole__"
    text = json.dumps(document).replace('"__hole__"', token)
    for payload in (text, text.encode()):
        result = check_everything(payload)
        if result is not None:
            assert [event.event_id for event in result.events] == ["BAD", "OK"]


def test_float_constants_in_an_already_decoded_value() -> None:
    for number in (math.nan, math.inf, -math.inf):
        assert check_everything({"DocumentIncarnation": number, "Events": []}) is None
        document = check_everything(_with_bad_event(DurationInSeconds=number))
        assert document is not None and document.events[0].duration_seconds is None

