from __future__ import annotations

import base64
import contextlib
import json
from datetime import datetime, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet_samples import (
    EVENT_ID,
    RG,
    SUB,
    as_base64,
    cloud_event,
    event_arm_id,
    event_grid_event,
    other_event,
    projected_row,
    properties,
    resource_graph_row,
    target_id,
)
from forewarn.fleet.armid import same_resource
from forewarn.fleet.feed import (
    DEFAULT_MAX_MESSAGE_BYTES,
    EVENT_GRID,
    RESOURCE_GRAPH,
    FeedError,
    FeedResult,
    FleetEvent,
    parse_event_grid,
    parse_event_time,
    parse_queue_message,
    parse_resource_graph_row,
    vm_ids,
)
from forewarn.imds.document import parse_document

from strategies import hostile_values, json_values

NOT_BEFORE = datetime(2025, 10, 14, 9, 30, tzinfo=timezone.utc)


def only(result: FeedResult) -> FleetEvent:
    assert result.skipped == 0
    (event,) = result.events
    return event


# --- Event Grid and CloudEvents, plain and base64, single and batch --------------------------------------

@pytest.mark.parametrize("encode", [json.dumps, lambda v: json.dumps(v).encode(), as_base64,
                                    lambda v: as_base64(v).encode(), lambda v: v],
                         ids=["text", "bytes", "base64", "base64-bytes", "decoded"])
def test_an_event_grid_schema_message_gives_the_event_on_its_target(encode: Any) -> None:
    event = only(parse_queue_message(encode(event_grid_event(delivery_id="eg-7"))))
    assert event.origin == EVENT_GRID
    assert event.resource_id == target_id("vm", "vm-a")
    assert event.subscription_id == SUB and event.resource_group == RG and event.location == "westeurope"
    assert event.delivery_id == "eg-7"
    assert event.event_time == datetime(2025, 10, 14, 9, 14, 3, 246801, tzinfo=timezone.utc)
    assert event.event_id == EVENT_ID and event.status == "Scheduled"
    assert event.event.event_type == "Reboot" and event.event.not_before == NOT_BEFORE
    assert event.event.duration_seconds == 600 and event.event.source == "Platform"
    assert event.arm_id == event_arm_id(target_id("vm", "vm-a"))
    assert event.warnings == ()


@pytest.mark.parametrize("encode", [json.dumps, as_base64], ids=["text", "base64"])
def test_a_cloudevents_schema_message_gives_the_same_event(encode: Any) -> None:
    event = only(parse_queue_message(encode(cloud_event(delivery_id="ce-9", time="2025-10-14T11:14:03+02:00"))))
    assert event.origin == EVENT_GRID and event.delivery_id == "ce-9"
    assert event.event_time == datetime(2025, 10, 14, 9, 14, 3, tzinfo=timezone.utc)
    assert event.resource_id == target_id() and event.event.event_type == "Reboot"


def test_the_event_reads_like_the_same_event_from_imds() -> None:
    props = properties()
    central = only(parse_queue_message(json.dumps(event_grid_event(props)))).event
    local = parse_document({"DocumentIncarnation": 1, "Events": [props]}).events[0]
    assert central == local


@pytest.mark.parametrize("encode", [json.dumps, as_base64], ids=["text", "base64"])
def test_a_batch_gives_every_event_in_order(encode: Any) -> None:
    batch = [event_grid_event(properties(event_id=f"E-{i}"), delivery_id=f"d-{i}") for i in range(3)]
    batch.append(cloud_event(properties(event_id="E-3"), delivery_id="d-3"))
    result = parse_queue_message(encode(batch))
    assert [e.event_id for e in result.events] == ["E-0", "E-1", "E-2", "E-3"]
    assert [e.delivery_id for e in result.events] == ["d-0", "d-1", "d-2", "d-3"]
    assert result.skipped == 0 and result.warnings == ()


def test_an_empty_batch_is_no_events() -> None:
    assert parse_queue_message("[]") == FeedResult(events=())


def test_base64_split_over_lines_and_a_byte_order_mark_are_read() -> None:
    encoded = as_base64(event_grid_event())
    assert only(parse_queue_message("\n".join(encoded[i:i + 76] for i in range(0, len(encoded), 76))))
    assert only(parse_queue_message(b"\xef\xbb\xbf" + json.dumps(event_grid_event()).encode()))
    assert only(parse_queue_message("\ufeff" + json.dumps(event_grid_event())))


def test_a_pushed_body_is_read_by_parse_event_grid() -> None:
    event = only(parse_event_grid(json.dumps([cloud_event()]).encode()))
    assert event.resource_id == target_id()


# --- what the central feeds add to IMDS ----------------------------------------------------------------

def test_a_scale_set_event_acts_on_each_vm_named_in_resources() -> None:
    vmss = target_id("vmss", "pool")
    event = only(parse_queue_message(json.dumps(event_grid_event(properties(resources=["pool_0", "pool_3"]), vmss))))
    assert event.resource_id == vmss
    assert vm_ids(event) == (target_id("vm", "pool_0"), target_id("vm", "pool_3"))
    assert event.arm_id == event_arm_id(vmss)


def test_an_availability_set_event_acts_on_each_vm_named_in_resources() -> None:
    avset = target_id("avset", "front")
    event = parse_resource_graph_row(resource_graph_row(properties(resources=["web-1", "web-2"]), avset))
    assert event.resource_id == avset
    assert vm_ids(event) == (target_id("vm", "web-1"), target_id("vm", "web-2"))


def test_a_vm_event_acts_on_that_vm_whatever_resources_says() -> None:
    event = only(parse_queue_message(json.dumps(event_grid_event(properties(resources=["vm-a", "other"])))))
    assert vm_ids(event) == (target_id("vm", "vm-a"),)


def test_resource_names_that_cannot_be_vm_names_are_left_out_with_a_warning() -> None:
    result = parse_queue_message(json.dumps(event_grid_event(properties(resources=["ok-1", "a/b", ""]),
                                                             target_id("vmss", "pool"))))
    event = only(result)
    assert vm_ids(event) == (target_id("vm", "ok-1"),)
    assert any("cannot be VM names" in w for w in event.warnings)
    assert result.warnings == event.warnings


def test_started_with_empty_not_before_reads_as_none_without_a_warning() -> None:
    result = parse_queue_message(json.dumps(event_grid_event(properties(status="Started", not_before=""))))
    event = only(result)
    assert event.status == "Started" and event.event.not_before is None
    assert result.warnings == () and event.warnings == ()


@pytest.mark.parametrize("status", ["Completed", "Canceled"])
def test_completed_and_canceled_exist_only_centrally_and_are_read(status: str) -> None:
    event = parse_resource_graph_row(resource_graph_row(properties(status=status)))
    assert event.status == status and event.event.not_before is None and event.warnings == ()
    event = only(parse_queue_message(as_base64(event_grid_event(properties(status=status)))))
    assert event.status == status


def test_duplicate_deliveries_keep_the_same_delivery_id() -> None:
    copy = event_grid_event(delivery_id="eg-dup")
    result = parse_queue_message(json.dumps([copy, copy]))
    first, second = result.events
    assert first.delivery_id == second.delivery_id == "eg-dup"
    assert first == second
    assert only(parse_queue_message(as_base64(copy))) == first


def test_unknown_fields_are_kept_in_the_raw_event() -> None:
    props = properties(TargetResourceId=target_id(), FutureField={"x": 1})
    event = only(parse_queue_message(json.dumps(event_grid_event(props)))).event
    assert event.raw["FutureField"] == {"x": 1} and event.raw["TargetResourceId"] == target_id()
    assert event.raw["EventId"] == EVENT_ID


def test_unknown_event_type_and_status_pass_through() -> None:
    event = only(parse_queue_message(json.dumps(event_grid_event(properties(event_type="Hibernate",
                                                                            status="Paused"))))).event
    assert event.event_type == "Hibernate" and event.status == "Paused"


@pytest.mark.parametrize("event_type", ["microsoft.maintenance/scheduledevents/write",
                                        "microsoft.maintenance/scheduledevents/Write", "something.new", None])
def test_the_event_type_string_does_not_decide(event_type: str | None) -> None:
    message = event_grid_event()
    message["eventType"] = event_type
    assert only(parse_queue_message(json.dumps(message))).event_id == EVENT_ID


def test_the_subject_names_the_event_when_resource_info_has_no_id() -> None:
    message = event_grid_event()
    del message["data"]["resourceInfo"]["id"]
    assert only(parse_queue_message(json.dumps(message))).resource_id == target_id()


def test_an_id_in_other_case_names_the_same_target() -> None:
    message = event_grid_event()
    message["data"]["resourceInfo"]["id"] = message["data"]["resourceInfo"]["id"].lower()
    event = only(parse_queue_message(json.dumps(message)))
    assert same_resource(event.resource_id, target_id()) and event.resource_group == RG.lower()


def test_an_event_id_that_differs_from_the_arm_id_is_a_warning() -> None:
    message = event_grid_event()
    message["data"]["resourceInfo"]["id"] = event_arm_id(target_id(), "OTHER")
    event = only(parse_queue_message(json.dumps(message)))
    assert event.event_id == EVENT_ID and any("differs" in w for w in event.warnings)


def test_an_unreadable_event_time_is_a_warning_and_the_event_is_kept() -> None:
    for bad in ("yesterday", 17, "2025-13-40T00:00:00Z"):
        message = event_grid_event()
        message["eventTime"] = bad
        result = parse_queue_message(json.dumps(message))
        assert only(result).event_time is None and len(result.warnings) == 1


def test_descriptive_fields_of_the_wrong_type_are_warnings_as_in_imds() -> None:
    props = properties(not_before="soon", DurationInSeconds="long", Description=5)
    event = only(parse_queue_message(json.dumps(event_grid_event(props))))
    assert event.event.not_before is None and event.event.duration_seconds is None
    assert event.event.description is None and len(event.warnings) == 3


# --- skipped -------------------------------------------------------------------------------------------

def test_events_of_other_kinds_in_a_batch_are_skipped_and_counted() -> None:
    validation = {"id": "v-1", "eventType": "Microsoft.EventGrid.SubscriptionValidationEvent",
                  "subject": "", "eventTime": "2025-10-14T09:00:00Z", "data": {"validationCode": "x"}}
    no_data = {"specversion": "1.0", "id": "c-1", "source": "/x", "type": "other"}
    result = parse_queue_message(as_base64([other_event(), event_grid_event(), validation, no_data]))
    assert [e.event_id for e in result.events] == [EVENT_ID]
    assert result.skipped == 3 and len(result.warnings) == 3


def test_a_single_event_of_another_kind_is_skipped() -> None:
    result = parse_queue_message(json.dumps(other_event()))
    assert result.events == () and result.skipped == 1


# --- Resource Graph ------------------------------------------------------------------------------------

@pytest.mark.parametrize("encode", [lambda v: v, json.dumps, lambda v: json.dumps(v).encode()],
                         ids=["decoded", "text", "bytes"])
def test_a_resource_graph_row_gives_the_event(encode: Any) -> None:
    vmss = target_id("vmss", "pool")
    event = parse_resource_graph_row(encode(resource_graph_row(properties(resources=["pool_1"]), vmss)))
    assert event.origin == RESOURCE_GRAPH and event.resource_id == vmss
    assert event.subscription_id == SUB and event.resource_group == RG
    assert event.delivery_id is None and event.event_time is None and event.location == "westeurope"
    assert event.event.not_before == NOT_BEFORE and vm_ids(event) == (target_id("vm", "pool_1"),)


def test_a_projected_row_gives_the_same_event_as_the_whole_row() -> None:
    props = properties(status="Started")
    projected = parse_resource_graph_row(projected_row(props))
    whole = parse_resource_graph_row(resource_graph_row(props))
    assert projected.event.event_id == whole.event.event_id and projected.status == "Started"
    assert projected.event.resources == whole.event.resources
    assert projected.event.duration_seconds == 600 and projected.event.not_before is None
    assert projected.resource_id == whole.resource_id and projected.warnings == ()


def test_a_row_projected_without_aliases_is_read() -> None:
    row = {"id": event_arm_id(target_id()), **{f"properties_{k}": v for k, v in properties().items()}}
    assert parse_resource_graph_row(row).event.event_type == "Reboot"


# --- refused -------------------------------------------------------------------------------------------

def _with(message: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    node = message
    *parents, last = path.split(".")
    for name in parents:
        node = node[name]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return message


@pytest.mark.parametrize(("message", "says"), [
    ("not json at all", "neither JSON nor base64"),
    ("{not json", "not JSON"),
    ("", "empty"),
    ("   \n", "empty"),
    ("@@@@", "neither JSON nor base64"),
    ("abc", "neither JSON nor base64"),
    (base64.b64encode(b"\xff\xfe\x00garbage").decode(), "not UTF-8"),
    (base64.b64encode(b"hello world").decode(), "not a JSON object or array"),
    (base64.b64encode(b'{"a": ').decode(), "not JSON"),
    (b'{"id": "\xff"}', "not UTF-8"),
    ('"just a string"', "neither JSON nor base64"),
    ("42", "neither JSON nor base64"),
    (json.dumps([1]), r"\$\[0\] must be an event object"),
    (json.dumps({"eventType": "x"}), r"\$.id is missing"),
    (json.dumps({"id": 5}), "not a string"),
    (json.dumps(_with(event_grid_event(), "data.resourceInfo.properties.EventId", KeyError)), "EventId is missing"),
    (json.dumps(_with(event_grid_event(), "data.resourceInfo.properties.EventId", 7)), "EventId is not a string"),
    (json.dumps(_with(event_grid_event(), "data.resourceInfo.properties.EventType", KeyError)), "EventType"),
    (json.dumps(_with(event_grid_event(), "data.resourceInfo.properties.EventStatus", None)), "EventStatus"),
    (json.dumps(_with(event_grid_event(), "data.resourceInfo.properties", [])), "properties is not a string"),
    (json.dumps(_with(event_grid_event(), "data.resourceInfo.properties.EventId", "a/b")), "cannot be part"),
    (json.dumps(_with(event_grid_event(), "data.resourceInfo.id",
                      "/subscriptions/s/providers/Microsoft.Maintenance/scheduledevents/E")), "not a scheduled event"),
    (json.dumps(_with(event_grid_event(), "data.resourceInfo.id",
                      "/subscriptions/s/providers/X.Y/t/n/providers/Microsoft.Maintenance/scheduledevents/E")),
     "names no resource group"),
    ('{"id": "x", "data": NaN}', "not a JSON number"),
    ('{"id": "x", "data": Infinity}', "not a JSON number"),
    ("[" * 40 + "]" * 40, "nested"),
    ("[" + "{}," * 20_000 + "{}]", "objects and arrays"),
])
def test_a_malformed_message_raises_feed_error_saying_what_and_where(message: str | bytes, says: str) -> None:
    with pytest.raises(FeedError, match=says):
        parse_queue_message(message)


def test_an_oversize_message_is_refused_before_it_is_read() -> None:
    big = json.dumps(event_grid_event(properties(Description="x" * DEFAULT_MAX_MESSAGE_BYTES)))
    with pytest.raises(FeedError, match="larger than"):
        parse_queue_message(big)
    with pytest.raises(FeedError, match="larger than"):
        parse_queue_message(big.encode())
    with pytest.raises(FeedError, match="larger than"):
        parse_queue_message(json.dumps(event_grid_event()), max_bytes=100)
    with pytest.raises(FeedError, match="larger than"):
        parse_resource_graph_row(json.dumps(resource_graph_row()), max_bytes=100)


def test_a_refused_message_does_not_echo_long_or_secret_values() -> None:
    secret = "SharedAccessKey=" + "k" * 5000
    message = _with(event_grid_event(), "data.resourceInfo.id",
                    f"/subscriptions/{secret}/resourceGroups/rg/providers/Microsoft.Maintenance/scheduledevents/E")
    with pytest.raises(FeedError) as caught:
        parse_queue_message(json.dumps(message))
    assert "k" * 100 not in str(caught.value) and len(str(caught.value)) < 300


@pytest.mark.parametrize(("row", "says"), [
    ([1, 2], "objectArray"),
    ({"properties": properties()}, "row.id is missing"),
    ({"id": 5, "properties": properties()}, "row.id is not a string"),
    ({"id": target_id(), "properties": properties()}, "not a scheduled event"),
    ({"id": "vm-a", "properties": properties()}, "must start with /subscriptions/"),
    ({"id": event_arm_id(target_id()), "properties": "x"}, "properties must be an object"),
    ({"id": event_arm_id(target_id())}, "neither properties nor projected"),
    (_with(resource_graph_row(), "properties.EventId", KeyError), r"row.properties.EventId is missing"),
    ('{"id": NaN}', "not a JSON number"),
    (b"\xc3\x28", "not UTF-8"),
])
def test_a_malformed_row_raises_feed_error(row: Any, says: str) -> None:
    with pytest.raises(FeedError, match=says):
        parse_resource_graph_row(row)


def test_a_batch_with_one_unreadable_scheduled_event_is_refused_whole() -> None:
    broken = _with(event_grid_event(delivery_id="b"), "data.resourceInfo.properties.EventId", KeyError)
    with pytest.raises(FeedError, match=r"\$\[1\]"):
        parse_queue_message(json.dumps([event_grid_event(), broken]))


def test_hostile_values_in_a_row_are_replaced_with_warnings() -> None:
    row = resource_graph_row(properties(DurationInSeconds=10**400, Description="\ud800"))
    event = parse_resource_graph_row(row)
    assert event.event.duration_seconds is None and event.event.description == "\ufffd"
    assert len(event.warnings) >= 2


# --- times ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "moment"), [
    ("2025-10-14T09:14:03.2468013Z", datetime(2025, 10, 14, 9, 14, 3, 246801, tzinfo=timezone.utc)),
    ("2025-10-14T09:14:03Z", datetime(2025, 10, 14, 9, 14, 3, tzinfo=timezone.utc)),
    ("2025-10-14T09:14:03.5-01:30", datetime(2025, 10, 14, 10, 44, 3, 500000, tzinfo=timezone.utc)),
    ("2025-10-14T09:14:03", datetime(2025, 10, 14, 9, 14, 3, tzinfo=timezone.utc)),
])
def test_event_times_are_read_in_utc(text: str, moment: datetime) -> None:
    assert parse_event_time(text) == moment


@pytest.mark.parametrize("text", ["", "2025-10-14", "9999-12-31T23:59:59-12:00", "2025-02-30T00:00:00Z", "now"])
def test_event_times_that_are_not_a_moment_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_event_time(text)


# --- properties ----------------------------------------------------------------------------------------

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PATHS = ("id", "subject", "eventTime", "time", "specversion", "data", "data.resourceInfo",
         "data.resourceInfo.id", "data.resourceInfo.location", "data.resourceInfo.properties",
         *(f"data.resourceInfo.properties.{name}" for name in properties()))


@st.composite
def hostile_messages(draw: st.DrawFn) -> Any:
    """A mostly valid message with one to three places replaced by hostile values."""
    events = [draw(st.sampled_from([event_grid_event, cloud_event]))() for _ in range(draw(st.integers(1, 3)))]
    for _ in range(draw(st.integers(1, 3))):
        event = draw(st.sampled_from(events))
        path = draw(st.sampled_from(PATHS))
        # An earlier change may have removed or replaced a parent of this path.
        with contextlib.suppress(KeyError, TypeError):
            _with(event, path, draw(st.one_of(hostile_values, st.just(KeyError))))
    return events if len(events) > 1 else events[0]


def _assert_usable(result: FeedResult) -> None:
    for event in result.events:
        assert event.resource_id and event.subscription_id and event.resource_group and event.event_id
        vm_ids(event)
        assert event.arm_id


@PROPERTY
@given(st.one_of(hostile_messages(), json_values, hostile_values))
def test_parse_queue_message_raises_only_feed_error(message: Any) -> None:
    for form in (message, json.dumps(message), as_base64(message)) if _dumpable(message) else (message,):
        with contextlib.suppress(FeedError):
            _assert_usable(parse_queue_message(form))


@PROPERTY
@given(st.one_of(st.binary(max_size=200), st.text(max_size=200)))
def test_parse_queue_message_raises_only_feed_error_on_any_bytes_or_text(body: bytes | str) -> None:
    with contextlib.suppress(FeedError):
        _assert_usable(parse_queue_message(body))


@PROPERTY
@given(st.one_of(hostile_messages(), json_values, hostile_values), st.booleans())
def test_parse_resource_graph_row_raises_only_feed_error(message: Any, projected: bool) -> None:
    row: Any = message
    if isinstance(message, dict) and "data" in message:
        info = message["data"].get("resourceInfo") if isinstance(message["data"], dict) else None
        if isinstance(info, dict):
            row = {"id": info.get("id"), "location": info.get("location"), "properties": info.get("properties")}
            if projected and isinstance(row["properties"], dict):
                row = {"id": row["id"], **{f"properties_{k}": v for k, v in row.pop("properties").items()}}
    try:
        event = parse_resource_graph_row(row)
    except FeedError:
        return
    _assert_usable(FeedResult(events=(event,)))


def _dumpable(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=True).encode("utf-8")
    except (ValueError, TypeError):
        return False
    return True
