"""Webhook sink: each record as a CloudEvent over HTTP, in the structured or binary content mode of the
CloudEvents HTTP protocol binding (the forms Event Grid, Knative and the CloudEvents SDKs read).

- structured (the default): `Content-Type: application/cloudevents+json`, the whole event in the body;
- binary: the attributes as `ce-*` headers, the record's `data` as the `application/json` body.

The CloudEvents SDK builds both, so the wire format follows the specification rather than our reading of it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from forewarn.records import Record
from forewarn.sinks.notify import Filter, NotifySink

try:  # cloudevents 2.x keeps the 1.x API under cloudevents.v1
    from cloudevents.v1.conversion import to_binary, to_structured
    from cloudevents.v1.http import CloudEvent
except ImportError:  # pragma: no cover - cloudevents 1.x
    from cloudevents.conversion import to_binary, to_structured  # type: ignore[no-redef]
    from cloudevents.http import CloudEvent  # type: ignore[no-redef]

MODES = ("structured", "binary")


def to_cloudevent(record: Record) -> Any:
    attributes = {key: value for key, value in record.to_dict().items() if key != "data"}
    return CloudEvent(attributes, dict(record.data))


class WebhookSink(NotifySink):
    name = "webhook"

    def __init__(self, url: str, mode: str, filter: Filter, rate_limit: float, state_dir: str | None) -> None:
        super().__init__(url, filter, rate_limit, state_dir)
        self._convert: Callable[[Any], tuple[Mapping[str, str], bytes]] = (
            to_binary if mode == "binary" else to_structured)

    def render(self, record: Record) -> tuple[bytes, Mapping[str, str]]:
        headers, body = self._convert(to_cloudevent(record))
        return body, headers
