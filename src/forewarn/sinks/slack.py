"""Slack sink: an incoming-webhook message in Block Kit, readable at a glance.

A header (what, where: "Reboot scheduled on vm-0"), then the facts as section fields (event type, status,
VM, when in UTC and relative to now, change, resources), the description, the event id and record id in a
context line, and a button to the link set with --notify-link (a dashboard, a runbook). `text` is the
fallback shown in notifications. Slack's limits are kept: a header's plain text at most 150 characters,
a section's text at most 3000, a field at most 2000 and at most 10 fields, at most 50 blocks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from forewarn.records import Record
from forewarn.sinks.notify import Filter, NotifySink, clip, event_of, headline, listed, node_facts, when


def slack_message(record: Record, now: float, link: str | None) -> dict[str, Any]:
    event = event_of(record)
    data = record.data
    title = headline(record)
    facts = [("Event", event.get("EventType") or "?"), ("Status", event.get("EventStatus") or "?"),
             ("VM", data.get("vm", {}).get("name") or "?"), ("When", when(record, now)),
             ("Change", str(data.get("change", "?"))), ("Resources", listed(event.get("Resources", []), 1900))]
    if data.get("policy_rule"):
        facts.append(("Policy rule", str(data["policy_rule"])))
    # A node action or a drain step: what happened to the node leads, the event's own facts follow.
    facts = [*node_facts(record), *facts]
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": clip(title, 150), "emoji": False}},
        {"type": "section", "fields": [{"type": "mrkdwn", "text": clip(f"*{name}*\n{value}", 2000)}
                                       for name, value in facts[:10]]},
    ]
    description = str(data.get("detail") or event.get("Description") or "")
    if description:
        blocks.append({"type": "section", "text": {"type": "plain_text", "text": clip(description, 3000)}})
    blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": clip(
        f"event `{record.subject}` · record `{record.id}` · forewarn", 2000)}]})
    if link:
        blocks.append({"type": "actions", "elements": [{"type": "button", "url": link, "text": {
            "type": "plain_text", "text": "Open dashboard"}}]})
    return {"text": clip(f"{title} — {when(record, now)}", 3000), "blocks": blocks}


class SlackSink(NotifySink):
    name = "slack"

    def __init__(self, url: str, filter: Filter, rate_limit: float, state_dir: str | None,
                 link: str | None = None) -> None:
        super().__init__(url, filter, rate_limit, state_dir)
        self.link = link

    def render(self, record: Record) -> tuple[bytes, Mapping[str, str]]:
        body = json.dumps(slack_message(record, self.clock(), self.link)).encode()
        return body, {"Content-Type": "application/json"}
