"""Teams sink: an Adaptive Card posted to a Teams Workflows webhook ("Post to a channel when a webhook
request is received"; the Office 365 connectors are retired).

The body is the message envelope the Workflows trigger expects, one attachment holding the card: a
large bold title, a FactSet (event type, status, VM, when, change, resources), the description, and an
Action.OpenUrl to --notify-link. Card version 1.4, which Teams renders on every client.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from forewarn.records import Record
from forewarn.sinks.notify import Filter, NotifySink, clip, event_of, headline, listed, node_facts, when

CARD_CONTENT_TYPE = "application/vnd.microsoft.card.adaptive"


def adaptive_card(record: Record, now: float, link: str | None) -> dict[str, Any]:
    event = event_of(record)
    data = record.data
    facts = [("Event", event.get("EventType") or "?"), ("Status", event.get("EventStatus") or "?"),
             ("VM", data.get("vm", {}).get("name") or "?"), ("When", when(record, now)),
             ("Change", str(data.get("change", "?"))), ("Resources", listed(event.get("Resources", []), 1000)),
             ("Event id", record.subject)]
    if data.get("policy_rule"):
        facts.append(("Policy rule", str(data["policy_rule"])))
    # A node action or a drain step: what happened to the node leads, the event's own facts follow.
    facts = [*node_facts(record), *facts]
    body: list[dict[str, Any]] = [
        {"type": "TextBlock", "text": clip(headline(record), 200), "size": "large", "weight": "bolder",
         "wrap": True},
        {"type": "FactSet", "facts": [{"title": name, "value": str(value)} for name, value in facts]},
    ]
    description = str(data.get("detail") or event.get("Description") or "")
    if description:
        body.append({"type": "TextBlock", "text": clip(description, 3000), "wrap": True})
    body.append({"type": "TextBlock", "text": f"record {record.id} · forewarn", "size": "small",
                 "isSubtle": True, "wrap": True})
    card: dict[str, Any] = {"$schema": "http://adaptivecards.io/schemas/adaptive-card.json",
                            "type": "AdaptiveCard", "version": "1.4", "body": body}
    if link:
        card["actions"] = [{"type": "Action.OpenUrl", "title": "Open dashboard", "url": link}]
    return {"type": "message", "attachments": [{"contentType": CARD_CONTENT_TYPE, "contentUrl": None,
                                                "content": card}]}


class TeamsSink(NotifySink):
    name = "teams"

    def __init__(self, url: str, filter: Filter, rate_limit: float, state_dir: str | None,
                 link: str | None = None) -> None:
        super().__init__(url, filter, rate_limit, state_dir)
        self.link = link

    def render(self, record: Record) -> tuple[bytes, Mapping[str, str]]:
        body = json.dumps(adaptive_card(record, self.clock(), self.link)).encode()
        return body, {"Content-Type": "application/json"}
