from __future__ import annotations

import contextlib
import json
from datetime import datetime, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from forewarn.imds.document import API_VERSIONS, DocumentError, parse_document, parse_not_before
from forewarn.simulator import Simulator, load_scenario

DOC_EXAMPLE = {
    "DocumentIncarnation": 2,
    "Events": [{
        "EventId": "C7061BAC-AFDC-4513-B24B-AA5F13A16123", "EventType": "Freeze",
        "ResourceType": "VirtualMachine", "Resources": ["WestNO_0", "WestNO_1"], "EventStatus": "Scheduled",
        "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT",
        "Description": "Virtual machine is being paused because of a memory-preserving Live Migration operation.",
        "EventSource": "Platform", "DurationInSeconds": 5,
    }],
}


def test_documented_example_parses_with_every_field() -> None:
    document = parse_document(json.dumps(DOC_EXAMPLE).encode())
    assert document.incarnation == 2
    (event,) = document.events
    assert event.event_type == "Freeze" and event.status == "Scheduled" and event.source == "Platform"
    assert event.resources == ("WestNO_0", "WestNO_1")
    assert event.not_before == datetime(2022, 4, 11, 22, 26, 58, tzinfo=timezone.utc)
    assert event.duration_seconds == 5
    assert event.affects("WestNO_1") and not event.affects("WestNO_2") and not event.affects(None)


@pytest.mark.parametrize("version", API_VERSIONS)
def test_every_api_version_parses_and_older_ones_lack_newer_fields(version: str) -> None:
    sim = Simulator(load_scenario("platform-reboot"), clock=lambda: 1_000.0)
    sim.started_wall = 1_000.0 - 5  # 5 s into the scenario: the reboot is Scheduled
    document = parse_document(sim.document(version))
    (event,) = document.events
    assert event.event_type == "Reboot" and event.status == "Scheduled" and event.not_before is not None
    assert (event.description is not None) == (version >= "2019-04-01")
    assert (event.source is not None) == (version >= "2019-08-01")
    assert (event.duration_seconds is not None) == (version >= "2020-07-01")


def test_empty_events_means_nothing_scheduled() -> None:
    document = parse_document(b'{"DocumentIncarnation": 1, "Events": []}')
    assert document.events == () and document.incarnation == 1


def test_empty_not_before_means_none() -> None:
    raw = json.loads(json.dumps(DOC_EXAMPLE))
    raw["Events"][0].update(EventStatus="Started", NotBefore="")
    (event,) = parse_document(raw).events
    assert event.not_before is None and event.seconds_to_not_before(0) is None


@pytest.mark.parametrize("text", ["2022-04-11T22:26:58Z", "2022-04-11T22:26:58+00:00", "2022-04-12T00:26:58+02:00",
                                  "Mon, 11 Apr 2022 22:26:58 GMT", "Mon, 11 Apr 2022 22:26:58 +0000"])
def test_not_before_accepts_rfc1123_and_iso8601(text: str) -> None:
    assert parse_not_before(text) == datetime(2022, 4, 11, 22, 26, 58, tzinfo=timezone.utc)


def test_unknown_fields_types_and_statuses_are_kept() -> None:
    raw = json.loads(json.dumps(DOC_EXAMPLE))
    raw["Events"][0].update(EventType="Hibernate", EventStatus="Paused", FutureField={"x": 1})
    raw["Extra"] = True
    document = parse_document(raw)
    (event,) = document.events
    assert event.event_type == "Hibernate" and event.status == "Paused"
    assert event.raw["FutureField"] == {"x": 1}
    assert document.raw["Extra"] is True


def test_unreadable_not_before_keeps_the_event_with_a_warning() -> None:
    raw = json.loads(json.dumps(DOC_EXAMPLE))
    raw["Events"][0]["NotBefore"] = "next tuesday"
    document = parse_document(raw)
    assert document.events[0].not_before is None
    assert "next tuesday" in document.warnings[0]


@pytest.mark.parametrize(("payload", "message"), [
    (b"<html>gateway error</html>", "not JSON"),
    (b'{"DocumentIncarnation": 1, "Events": [', "not JSON"),
    (b"[]", "must be a JSON object"),
    (b'{"Events": []}', "DocumentIncarnation is missing"),
    (b'{"DocumentIncarnation": "x", "Events": []}', "whole number"),
    (b'{"DocumentIncarnation": 1}', "Events must be a list"),
    (b'{"DocumentIncarnation": 1, "Events": [1]}', "Events[0] must be an object"),
    (b'{"DocumentIncarnation": 1, "Events": [{"EventType": "Reboot", "EventStatus": "Scheduled"}]}', "EventId"),
    (b'{"DocumentIncarnation": 1, "Events": [{"EventId": "a", "EventType": "Reboot", "EventStatus": "Scheduled"},'
     b' {"EventId": "a", "EventType": "Reboot", "EventStatus": "Scheduled"}]}', "appears twice"),
])
def test_wrong_shapes_are_errors_that_say_what_is_wrong(payload: bytes, message: str) -> None:
    with pytest.raises(DocumentError, match=message.replace("[", r"\[")):
        parse_document(payload)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@given(st.one_of(json_values, st.fixed_dictionaries({"DocumentIncarnation": json_values, "Events": json_values})))
def test_any_json_either_parses_or_raises_document_error(value: object) -> None:
    with contextlib.suppress(DocumentError):
        parse_document(json.dumps(value))


@given(st.binary(max_size=64))
def test_any_bytes_either_parse_or_raise_document_error(payload: bytes) -> None:
    with contextlib.suppress(DocumentError):
        parse_document(payload)


def _event(**fields: object) -> dict[str, object]:
    return {"EventId": "A", "EventType": "Reboot", "EventStatus": "Scheduled", "Resources": ["vm1"],
            "NotBefore": "Mon, 19 Sep 2039 18:29:47 GMT", **fields}


@pytest.mark.parametrize(("field", "value", "read_as"), [
    ("NotBefore", "Fri, 31 Dec 9999 23:59:59 -1200", ("not_before", None)),
    ("DurationInSeconds", 10**400, ("duration_seconds", None)),
    ("DurationInSeconds", -7, ("duration_seconds", None)),
    ("DurationInSeconds", 1.5, ("duration_seconds", None)),
    ("Description", {"nested": "object"}, ("description", None)),
    ("Resources", "vm1", ("resources", ())),
    ("EventSource", 7, ("source", None)),
])
def test_one_bad_field_is_a_warning_and_keeps_every_event(field: str, value: object,
                                                          read_as: tuple[str, object]) -> None:
    document = parse_document(json.dumps({"DocumentIncarnation": 3,
                                          "Events": [_event(**{field: value}), _event(EventId="B")]}).encode())
    bad, good = document.events
    assert getattr(bad, read_as[0]) == read_as[1]
    assert good.event_id == "B" and good.not_before is not None and good.resources == ("vm1",)
    assert any(field in warning for warning in document.warnings)


def test_lone_surrogates_become_replacement_characters_everywhere() -> None:
    body = (b'{"DocumentIncarnation": 1, "Events": [{"EventId": "\\ud800x", "EventType": "Reboot", '
            b'"EventStatus": "Scheduled", "Description": "a\\udfffb", "Resources": ["\\ud800"], "X\\ud800": 1}]}')
    document = parse_document(body)
    (event,) = document.events
    assert event.event_id == "\ufffdx" and event.description == "a\ufffdb" and event.resources == ("\ufffd",)
    json.dumps(dict(event.raw), ensure_ascii=False).encode("utf-8")  # every string encodes
    assert len(document.warnings) == 4


@pytest.mark.parametrize(("payload", "message"), [
    (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "objects and arrays"),
    (b"[" * 5_000 + b"]" * 5_000, "nested"),
    (b'{"DocumentIncarnation": 1, "Events": [], "x": ' + b"[" * 20 + b"]" * 20 + b"}", "nested"),
    (b"[" + b"{}," * 20_000 + b"{}]", "objects and arrays"),
    (b'{"DocumentIncarnation": 1' + b"0" * 400 + b', "Events": []}', "DocumentIncarnation"),
    (b'{"DocumentIncarnation": 9007199254740993, "Events": []}', "DocumentIncarnation"),
    (b'{"DocumentIncarnation": -1, "Events": []}', "DocumentIncarnation"),
    (b'{"DocumentIncarnation": NaN, "Events": []}', "NaN"),
    (b'{"DocumentIncarnation": 1, "Events": [], "x": Infinity}', "Infinity"),
    (b'\xff\xfe{\x00}\x00', "not UTF-8"),
    (b'{"DocumentIncarnation": 1, "Events": [' + b",".join([b'{"EventId": "%d", "EventType": "Reboot", '
                                                             b'"EventStatus": "Scheduled"}' % i for i in range(1001)])
     + b"]}", "more than the 1000"),
])
def test_hostile_replies_are_refused_with_a_reason(payload: bytes, message: str) -> None:
    with pytest.raises(DocumentError, match=message):
        parse_document(payload)


def test_numbers_out_of_range_in_unknown_fields_are_read_as_null() -> None:
    document = parse_document(b'{"DocumentIncarnation": 1, "Events": [], "Big": 1' + b"0" * 30 + b', "Far": 1e999}')
    assert document.raw["Big"] is None and document.raw["Far"] is None
    assert len(document.warnings) == 2


def test_fields_read_as_unknown_are_left_out_of_the_event_as_records_carry_it() -> None:
    body = json.dumps({"DocumentIncarnation": 1, "Events": [_event(
        ResourceType=None, Description=7, DurationInSeconds="900", Resources=["vm1", 3], Extra={"kept": 1})]})
    (event,) = parse_document(body).events
    assert "ResourceType" not in event.raw and "Description" not in event.raw
    assert event.raw["DurationInSeconds"] == 900 and event.raw["Resources"] == ["vm1"]
    assert event.raw["Extra"] == {"kept": 1}


@pytest.mark.parametrize("text", ["Mon, 01 Jan 0001 00:00:00 +1400", "Thu, 31 Dec 0099 00:00:00 GMT"])
def test_years_below_100_are_not_read_as_two_digit_years(text: str) -> None:
    with pytest.raises(ValueError, match="outside the range"):
        parse_not_before(text)


def test_a_reply_full_of_bad_values_gives_a_few_warnings_not_thousands() -> None:
    events = [_event(EventId=f"E{i}", DurationInSeconds="soon", Description=[1]) for i in range(300)]
    document = parse_document(json.dumps({"DocumentIncarnation": 1, "Events": events}).encode())
    assert len(document.events) == 300
    assert len(document.warnings) == 21 and document.warnings[-1] == "... and 580 more problems in this reply"


def test_very_long_strings_are_clipped_with_a_warning() -> None:
    document = parse_document(json.dumps({"DocumentIncarnation": 1,
                                          "Events": [_event(Description="x" * 1_000_000)]}).encode())
    assert len(document.events[0].description or "") == 32 * 1024
    assert any("clipped" in warning for warning in document.warnings)


@given(st.datetimes(min_value=datetime(100, 1, 1), max_value=datetime(9999, 12, 31, 23, 59, 59)))
def test_not_before_in_imds_form_reads_and_writes_as_the_email_package_does(moment: datetime) -> None:
    # NotBefore as IMDS writes it is parsed, and written, without the email package (not loaded at idle);
    # both must agree with it for every date it can hold.
    from email.utils import format_datetime, parsedate_to_datetime

    from forewarn.imds.document import format_not_before

    moment = moment.replace(microsecond=0, tzinfo=timezone.utc)
    text = format_datetime(moment, usegmt=True)
    assert format_not_before(moment) == text
    assert parse_not_before(text) == parsedate_to_datetime(text) == moment


@pytest.mark.parametrize("text", ["Mon, 01 Jan 0001 00:00:00 GMT", "Mon, 31 Feb 2026 10:00:00 GMT",
                                  "Mon, 01 Jan 2026 24:00:00 GMT"])
def test_not_before_in_imds_form_that_names_no_real_moment_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="NotBefore"):
        parse_not_before(text)
