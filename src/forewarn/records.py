"""Document changes and approvals as CloudEvents 1.0 records: what every sink receives.

The record id is a UUID derived from (VM, event, change, incarnation), never random, so a record sent
twice (after a restart or a retry) carries the same id and consumers can drop the repeat.
"""

from __future__ import annotations

import hashlib
import json
import json.scanner
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, overload

from forewarn.imds.document import Event
from forewarn.imds.instance import VmInfo
from forewarn.tracker import Change, ChangeKind

#: Prefix of every record `type`; the change is appended (`...scheduled_event.added`).
TYPE_PREFIX = "io.github.forewarn.scheduled_event"
#: The change of the records the approver writes (the others are the tracker's ChangeKinds).
APPROVED = "approved"
#: The change of the records of Kubernetes node actions (one per action, and one per undo).
NODE_ACTION = "node_action"
#: The change of the records that follow a drain as it goes: started, blocked, deleted (a pod, at the
#: deadline), done, failed (`data.phase`).
DRAIN = "drain"
CONTENT_TYPE = "application/json"
SPEC_VERSION = "1.0"

#: json.loads without its wrapper, which looks for whitespace around the value with two regular expressions:
#: 20% of parsing a record read back from the outbox. Anything but one bare JSON value goes to json.loads.
_scan_json = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]


def _loads(text: str) -> Any:
    try:
        value, end = _scan_json(text, 0)
    except StopIteration:
        return json.loads(text)  # raises its JSONDecodeError
    return value if end == len(text) else json.loads(text)


_ID_NAMESPACE = uuid.UUID("5a4d5bd4-3f0e-4c55-9a3c-0f0e7a7f2f8e")
#: SHA-1 of the namespace, copied for each id: uuid.uuid5's own steps, without its UUID object (a first fleet
#: snapshot of 100,000 VMs makes 100,000 ids; uuid.uuid5 took a sixth of its commit). Held to uuid.uuid5 by
#: tests/test_fleet_records.py.
_ID_HASH = hashlib.sha1(_ID_NAMESPACE.bytes, usedforsecurity=False)


@dataclass(frozen=True)
class Record:
    """One CloudEvents structured-mode record. `data` is JSON-ready.

    A record read back from the outbox keeps the JSON text it was stored as (`from_json`), so sending it
    on as JSON costs no second serialisation; build a changed record with the constructor, never with
    `dataclasses.replace`, which would carry the old text along."""

    id: str
    source: str
    type: str
    subject: str
    time: str
    data: Mapping[str, Any] = field(hash=False)
    stored_json: str | None = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "specversion": SPEC_VERSION,
            "id": self.id,
            "source": self.source,
            "type": self.type,
            "subject": self.subject,
            "time": self.time,
            "datacontenttype": CONTENT_TYPE,
            "data": dict(self.data),
        }

    def to_json(self) -> str:
        if self.stored_json is not None:
            return self.stored_json
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=False)

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> Record:
        return cls(
            id=value["id"],
            source=value["source"],
            type=value["type"],
            subject=value["subject"],
            time=value["time"],
            data=value["data"],
        )

    @classmethod
    def from_json(cls, text: str) -> Record:
        """The record `to_json` wrote as `text`, keeping the text for the next `to_json`."""
        value = _loads(text)
        return cls(id=value["id"], source=value["source"], type=value["type"], subject=value["subject"],
                   time=value["time"], data=value["data"], stored_json=text)


class JsonRecords(Sequence[Record]):
    """Records held as the JSON text they were stored as, each parsed only when it is first read: a sink
    that writes JSON lines (`json_lines`) never pays for parsing, the others parse each record once."""

    def __init__(self, texts: Sequence[str]) -> None:
        self.texts = list(texts)
        self._parsed: list[Record | None] = [None] * len(self.texts)

    def __len__(self) -> int:
        return len(self.texts)

    @overload
    def __getitem__(self, index: int) -> Record: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Record]: ...

    def __getitem__(self, index: int | slice) -> Record | Sequence[Record]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        record = self._parsed[index]
        if record is None:
            record = self._parsed[index] = Record.from_json(self.texts[index])
        return record


#: The keys of `Record.to_dict()`, in its order.
CLOUDEVENT_KEYS = ("specversion", "id", "source", "type", "subject", "time", "datacontenttype", "data")


def cloudevents(records: Sequence[Record]) -> list[dict[str, Any]]:
    """Each record's `to_dict()`. Records held as text are parsed straight into it, with no Record in between
    (a third of parsing a record): the stored text is `to_json()` of that dict. A text that is not (other keys,
    another order) goes through a Record, which makes it so."""
    if not isinstance(records, JsonRecords):
        return [record.to_dict() for record in records]
    out = []
    for text in records.texts:
        value = _loads(text)
        if (type(value) is not dict or tuple(value) != CLOUDEVENT_KEYS or value["specversion"] != SPEC_VERSION
                or value["datacontenttype"] != CONTENT_TYPE or type(value["data"]) is not dict):
            value = Record.from_dict(value).to_dict()
        out.append(value)
    return out


def json_lines(records: Sequence[Record]) -> str:
    """The records as JSON lines (each followed by a newline), without parsing records held as text."""
    texts = records.texts if isinstance(records, JsonRecords) else [record.to_json() for record in records]
    return "\n".join(texts) + "\n" if texts else ""


def record_id(vm_name: str, event_id: str, kind: str, incarnation: int) -> str:
    """str(uuid.uuid5(namespace, "{vm_name}\\n{event_id}\\n{kind}\\n{incarnation}")): RFC 4122's version 5 from
    the name's SHA-1, the version and variant bits set."""
    digest = _ID_HASH.copy()
    digest.update(f"{vm_name}\n{event_id}\n{kind}\n{incarnation}".encode())
    raw = bytearray(digest.digest()[:16])
    raw[6] = raw[6] & 0x0F | 0x50
    raw[8] = raw[8] & 0x3F | 0x80
    text = raw.hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def record_source(vm: VmInfo) -> str:
    return vm.resource_id or f"forewarn://{vm.name or 'unknown'}"


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def to_record(change: Change, vm: VmInfo, observed_at: datetime) -> Record:
    """The record for a document change, as seen by `vm` at `observed_at`."""
    data = event_data(str(change.kind), change.event, change.incarnation, vm)
    if change.kind in (ChangeKind.UPDATED, ChangeKind.REMOVED) and change.previous is not None:
        data["previous_status"] = change.previous.status
    if change.kind is ChangeKind.REMOVED and change.outcome is not None:
        data["outcome"] = str(change.outcome)
    return _record(str(change.kind), change.event, change.incarnation, vm, observed_at, data)


def approval_record(event: Event, vm: VmInfo, rule: str, dry_run: bool, incarnation: int,
                    at: datetime) -> Record:
    """The `approved` record: `vm` approved `event` (or would have, under `dry_run`) by the policy rule
    named `rule`, while the document of `incarnation` was current."""
    data = event_data(APPROVED, event, incarnation, vm)
    data["policy_rule"] = rule
    data["dry_run"] = dry_run
    return _record(APPROVED, event, incarnation, vm, at, data)


def node_action_record(event: Event, vm: VmInfo, node: str, rule: str | None, action: str, result: str,
                       detail: str, incarnation: int, at: datetime) -> Record:
    """A `node_action` record: `action` on the Kubernetes node `node` for `event` ended with `result`
    (ok, failed, dry_run); `detail` says what was done or why it failed. The id repeats for the same action
    and result of the same event in the same document, so a restart that does it again is recognised."""
    data = event_data(NODE_ACTION, event, incarnation, vm)
    data["node"] = node
    data["action"] = action
    data["result"] = result
    data["detail"] = detail
    data["dry_run"] = result == "dry_run"
    if rule is not None:
        data["policy_rule"] = rule
    return Record(
        id=record_id(vm.name, event.event_id, f"{NODE_ACTION}:{action}:{result}", incarnation),
        source=record_source(vm),
        type=f"{TYPE_PREFIX}.{NODE_ACTION}",
        subject=event.event_id,
        time=rfc3339(at),
        data=data,
    )


def drain_record(event: Event, vm: VmInfo, node: str, rule: str | None, phase: str, detail: str,
                 facts: Mapping[str, Any], key: str, incarnation: int, at: datetime) -> Record:
    """A `drain` record: the drain of the Kubernetes node `node` for `event` reached `phase` (started, blocked,
    deleted, done, failed); `detail` says it in one line and `facts` carry the details (pods, the budgets
    blocking them, counts, seconds). The id repeats for the same phase and `key` of the same event in the same
    document, so a restart that reports the same step again is recognised."""
    data = event_data(DRAIN, event, incarnation, vm)
    data["node"] = node
    data["phase"] = phase
    data["detail"] = detail
    data["dry_run"] = False
    if rule is not None:
        data["policy_rule"] = rule
    data.update({name: value for name, value in facts.items() if name not in data})
    return Record(
        id=record_id(vm.name, event.event_id, f"{DRAIN}:{phase}:{key}", incarnation),
        source=record_source(vm),
        type=f"{TYPE_PREFIX}.{DRAIN}",
        subject=event.event_id,
        time=rfc3339(at),
        data=data,
    )


def event_data(change: str, event: Event, incarnation: int, vm: VmInfo) -> dict[str, Any]:
    """The `data` fields every record has, in the order records have always had them."""
    return {
        "change": change,
        "incarnation": incarnation,
        "event": dict(event.raw),
        "affects_this_vm": event.affects(vm.name),
        "vm": vm.known(),
        "not_before": rfc3339(event.not_before) if event.not_before else None,
    }


def _record(change: str, event: Event, incarnation: int, vm: VmInfo, at: datetime, data: dict[str, Any]) -> Record:
    return Record(
        id=record_id(vm.name, event.event_id, change, incarnation),
        source=record_source(vm),
        type=f"{TYPE_PREFIX}.{change}",
        subject=event.event_id,
        time=rfc3339(at),
        data=data,
    )
