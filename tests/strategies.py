"""Hypothesis strategies for Scheduled Events documents."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from forewarn.imds.document import EVENT_SOURCES, EVENT_STATUSES, EVENT_TYPES

event_ids = st.sampled_from([f"EV-{i}" for i in range(8)])


@st.composite
def raw_events(draw: st.DrawFn, event_id: str) -> dict[str, Any]:
    status = draw(st.sampled_from(EVENT_STATUSES))
    return {
        "EventId": event_id,
        "EventType": draw(st.sampled_from(EVENT_TYPES)),
        "ResourceType": "VirtualMachine",
        "Resources": draw(st.lists(st.sampled_from(["vm-0", "vm-1", "vm-2"]), max_size=3, unique=True)),
        "EventStatus": status,
        "NotBefore": "" if status == "Started" else "Mon, 11 Apr 2022 22:26:58 GMT",
        "Description": draw(st.sampled_from(["", "maintenance"])),
        "EventSource": draw(st.sampled_from(EVENT_SOURCES)),
        "DurationInSeconds": draw(st.sampled_from([-1, 0, 5, 900])),
    }


@st.composite
def raw_documents(draw: st.DrawFn, incarnation: int | None = None) -> dict[str, Any]:
    ids = draw(st.lists(event_ids, max_size=5, unique=True))
    return {
        "DocumentIncarnation": incarnation if incarnation is not None else draw(st.integers(0, 1000)),
        "Events": [draw(raw_events(event_id)) for event_id in ids],
    }


# --- hostile input -------------------------------------------------------------------------------------
# What a broken proxy or anyone on the link-local network could answer in place of IMDS. The parser must
# turn all of it into a Document or a DocumentError, and every Document must still render and serialize.

#: NotBefore values at the edges of what datetime holds: converting them to UTC leaves its range.
EDGE_DATES = (
    "Fri, 31 Dec 9999 23:59:59 -1200",
    "Mon, 01 Jan 0001 00:00:00 +1400",
    "Fri, 31 Dec 9999 23:59:59 GMT",
    "Mon, 01 Jan 0001 00:00:00 GMT",
    "Sat, 01 Jan 10000 00:00:00 GMT",
    "Mon, 11 Apr 99999999999999999999 22:26:58 GMT",
    "Mon, 11 Apr 2022 22:26:58 +9999",
    "Mon, 32 Jan 2022 00:00:00 GMT",
    "Mon, 11 Apr 2022 25:61:61 GMT",
    "9999-12-31T23:59:59-12:00",
    "0001-01-01T00:00:00+14:00",
    "9999-12-31T23:59:59.999999Z",
    "2022-04-11T22:26:58",
    "1970-01-01T00:00:00Z",
    "-1",
    "nan",
)

#: Single values that have broken (or could break) a parser, a label value, a record id or a float.
HOSTILE_SCALARS: tuple[Any, ...] = (
    10**400, -(10**400), 2**63, 2**63 - 1, -(2**63) - 1, 2**64, 2**53, 2**53 + 1, -1, 0, 1.5, -0.0, 1e308,
    -1e308, 5e-324, float("nan"), float("inf"), float("-inf"), True, False, None,
    "", " ", "\ud800", "\udfff", "a\ud800b", "\udc00\ud800", "\x00", "a\x00b", "\x01\x1f\x7f", "\u2028\u2029",
    "\ufeff", "\ufffe", "\uffff", "\U0010ffff", "\\", '"', "\n", "\r\n", 'le="+Inf"', "} 1\nfake_metric 2",
    "# EOF", "x" * 100_000, "é" * 5000, "-1", "900", "1e999", "NaN", "Infinity", "00000000000000000001",
    {}, [], {"a": {"b": "c"}}, ["x"], [None], [1, "x", {}], {"\ud800": "\ud800"},
    *EDGE_DATES,
)

#: Text made of every code point, lone surrogates (category Cs) included.
any_text = st.text(st.characters(exclude_categories=()), max_size=40)

json_values: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | any_text,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(any_text, children, max_size=4),
    max_leaves=20,
)

hostile_values: st.SearchStrategy[Any] = st.one_of(
    st.sampled_from(HOSTILE_SCALARS),
    st.integers(min_value=-(2**1000), max_value=2**1000),
    st.floats(),
    any_text,
    json_values,
)

EVENT_FIELDS = ("EventId", "EventType", "ResourceType", "Resources", "EventStatus", "NotBefore", "Description",
                "EventSource", "DurationInSeconds")


@st.composite
def hostile_documents(draw: st.DrawFn) -> Any:
    """A mostly valid document with one to three places replaced by hostile values."""
    document = draw(raw_documents())
    events: list[dict[str, Any]] = document["Events"]
    if not events:
        events.append(draw(raw_events("EV-0")))
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(("event", "event", "event", "resource", "key", "document", "duplicate",
                                      "extra")))
        event = draw(st.sampled_from(events))
        if where == "event":
            event[draw(st.sampled_from(EVENT_FIELDS))] = draw(hostile_values)
        elif where == "resource":
            resources = event.get("Resources")
            event["Resources"] = [*(resources[:2] if isinstance(resources, list) else []), draw(hostile_values)]
        elif where == "key":
            event[draw(any_text)] = draw(hostile_values)
        elif where == "document":
            document[draw(st.sampled_from(("DocumentIncarnation", "Events", "Other")))] = draw(hostile_values)
        elif where == "duplicate":
            events.append(dict(event))
        else:  # a second event that differs from the first only in a hostile id
            events.append({**event, "EventId": draw(st.sampled_from(("\ud800", "\udc00", "\ufffd", "\x00")))})
    return document


def deep_json_text(depth: int, kind: str = "[") -> str:
    """JSON nested `depth` levels deep, built as text: Hypothesis' own recursion stays shallow, and
    json.dumps of such a value would itself hit the recursion limit."""
    if kind == "[":
        return "[" * depth + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


def deep_json_value(depth: int) -> Any:
    """The same nesting as a Python value, built without recursion."""
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


@st.composite
def deep_inputs(draw: st.DrawFn) -> Any:
    """Deep nesting alone, as the whole document, or in place of one field of an otherwise valid one."""
    depth = draw(st.integers(1, 2000) | st.sampled_from((15, 16, 17, 999, 1000, 1001, 2000)))
    kind = draw(st.sampled_from("[{"))
    deep = deep_json_text(depth, kind)
    place = draw(st.sampled_from(("whole", "incarnation", "events", "description", "resources", "value")))
    if place == "whole":
        return deep
    if place == "value":
        return deep_json_value(depth)
    event = json.dumps(draw(raw_events("EV-0")))[:-1]
    if place == "incarnation":
        return '{"DocumentIncarnation": ' + deep + ', "Events": []}'
    if place == "events":
        return '{"DocumentIncarnation": 1, "Events": ' + deep + "}"
    field = "Description" if place == "description" else "Resources"
    return '{"DocumentIncarnation": 1, "Events": [' + event + f', "{field}": ' + deep + "}]}"


#: Raw JSON tokens put in place of one value: the constants Python's json reads but JSON has not,
#: numbers past float range, escapes that decode to lone surrogates, duplicate keys.
HOSTILE_TOKENS = (
    "NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1E400", "1e-999", "-0", "-0.0", "1.0", "4.5e15",
    "9" * 400, "-" + "9" * 400, "9007199254740993", '"\\ud800"', '"\\udc00\\ud800"', '"a\\u0000b"',
    '"\\u0000"', '"\\ufeff"', '{"a": 1, "a": 2}', "[" * 20 + "]" * 20, "true", "null",
)

_HOLE = "__forewarn_hole__"


@st.composite
def hostile_texts(draw: st.DrawFn) -> str:
    """A valid document's JSON text with one value replaced by a raw hostile token."""
    document = draw(raw_documents())
    if not document["Events"]:
        document["Events"].append(draw(raw_events("EV-0")))
    if draw(st.booleans()):
        document["DocumentIncarnation"] = _HOLE
    else:
        draw(st.sampled_from(document["Events"]))[draw(st.sampled_from(EVENT_FIELDS))] = _HOLE
    return json.dumps(document).replace(f'"{_HOLE}"', draw(st.sampled_from(HOSTILE_TOKENS)))


@st.composite
def hostile_bytes(draw: st.DrawFn) -> bytes:
    """Reply bodies that are not (only) UTF-8 JSON: random bytes, invalid UTF-8 inside a valid document,
    byte order marks, UTF-16 and UTF-32, Latin-1, surrogates encoded as UTF-8 (CESU-8)."""
    text = json.dumps(draw(raw_documents()) | {"Other": "é\u2028"}, ensure_ascii=False)
    body = text.encode()
    kind = draw(st.sampled_from(("random", "insert", "bom", "utf16", "utf32", "latin1", "cesu", "truncate")))
    if kind == "random":
        return draw(st.binary(max_size=200))
    if kind == "insert":
        at = draw(st.integers(0, len(body)))
        junk = draw(st.sampled_from((b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80", b"\x00",
                                     b"\xef\xbb\xbf")))
        return body[:at] + junk + body[at:]
    if kind == "bom":
        return b"\xef\xbb\xbf" + body
    if kind == "utf16":
        return text.encode(draw(st.sampled_from(("utf-16", "utf-16-le", "utf-16-be"))))
    if kind == "utf32":
        return text.encode("utf-32")
    if kind == "latin1":
        return text.encode("latin-1", "replace")
    if kind == "cesu":
        return text.replace("Other", "\ud800").encode("utf-8", "surrogatepass")
    return body[: draw(st.integers(0, len(body)))]


def wire_forms(value: Any) -> list[Any]:
    """`value` as parse_document may receive it: decoded, as JSON text (escaped and raw), as bytes."""
    forms: list[Any] = [value]
    try:
        escaped = json.dumps(value)
        raw = json.dumps(value, ensure_ascii=False)
    except (RecursionError, ValueError):
        return forms
    forms += [escaped, raw, escaped.encode(), raw.encode("utf-8", "surrogatepass")]
    return forms


#: Everything parse_document must survive, in every form it may arrive in.
hostile_inputs: st.SearchStrategy[Any] = st.one_of(
    hostile_documents().flatmap(lambda doc: st.sampled_from(wire_forms(doc))),
    json_values.flatmap(lambda value: st.sampled_from(wire_forms(value))),
    deep_inputs(),
    hostile_texts(),
    hostile_texts().map(str.encode),
    hostile_bytes(),
)
