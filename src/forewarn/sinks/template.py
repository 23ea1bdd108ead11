"""Template sink: any JSON endpoint, the body rendered from a user's Jinja2 template.

The template runs in Jinja2's SandboxedEnvironment (no attribute access to Python internals, no imports)
with StrictUndefined (a misspelt name is an error, not an empty string). It is checked at start: it must
compile, and rendering a sample record must give valid JSON; otherwise forewarn does not start and the
message names the file and the line. Variables: `record` (the CloudEvents record as a dict), `event` (the
Scheduled Event), `vm`, `change`, `headline` ("Reboot scheduled on vm-0"), `when` ("2022-04-11 22:26 UTC
(in 14 min)"), `link` (--notify-link). Use `| tojson` for strings inside JSON.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from jinja2 import StrictUndefined, TemplateError, TemplateSyntaxError
from jinja2.sandbox import SandboxedEnvironment

from forewarn.records import Record
from forewarn.sinks import SinkConfigError, SinkError
from forewarn.sinks.notify import Filter, NotifySink, event_of, headline, when

#: Largest rendered body: a template looping over a large reply must not post megabytes.
MAX_BODY = 256 * 1024

SAMPLE = Record(id="00000000-0000-5000-8000-000000000000", source="forewarn://vm-0",
                type="io.github.forewarn.scheduled_event.added", subject="00000000-0000-0000-0000-000000000000",
                time="2022-04-11T22:10:00.000Z", data={
                    "change": "added", "incarnation": 1, "affects_this_vm": True, "not_before":
                    "2022-04-11T22:26:58.000Z", "vm": {"name": "vm-0"}, "event": {
                        "EventId": "00000000-0000-0000-0000-000000000000", "EventType": "Reboot",
                        "ResourceType": "VirtualMachine", "Resources": ["vm-0"], "EventStatus": "Scheduled",
                        "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT", "Description": "sample",
                        "EventSource": "Platform", "DurationInSeconds": -1}})


class TemplateSink(NotifySink):
    name = "template"

    def __init__(self, url: str, template_path: str, template_text: str, filter: Filter, rate_limit: float,
                 state_dir: str | None, link: str | None = None) -> None:
        self.link = link
        self._path = template_path
        environment = SandboxedEnvironment(undefined=StrictUndefined, autoescape=False)
        try:
            self._template = environment.from_string(template_text)
        except TemplateSyntaxError as exc:
            raise SinkConfigError(f"--template-file {template_path}: line {exc.lineno}: {exc.message}") from None
        try:
            self._render(SAMPLE, 0.0)
        except SinkError as exc:
            raise SinkConfigError(f"--template-file {template_path}: {exc} (rendering a sample record)") from None
        super().__init__(url, filter, rate_limit, state_dir)

    def _render(self, record: Record, now: float) -> bytes:
        context: dict[str, Any] = {"record": record.to_dict(), "event": dict(event_of(record)),
                                   "vm": dict(record.data.get("vm", {})), "change": record.data.get("change"),
                                   "headline": headline(record), "when": when(record, now), "link": self.link}
        try:
            text = self._template.render(context)
        except TemplateError as exc:
            raise SinkError(f"template error: {type(exc).__name__}: {exc}") from None
        if len(text) > MAX_BODY:
            raise SinkError(f"the rendered body is over {MAX_BODY} bytes")
        try:
            json.loads(text)
        except ValueError as exc:
            raise SinkError(f"the rendered body is not valid JSON ({exc})") from None
        return text.encode()

    def render(self, record: Record) -> tuple[bytes, Mapping[str, str]]:
        return self._render(record, self.clock()), {"Content-Type": "application/json"}
