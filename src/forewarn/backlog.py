"""`Backlog`, what waits for one sink: the value the outbox measures and the metrics show.

It lives beside both rather than in either, so that neither package imports the other: the outbox
(`forewarn.outbox`) reports backlogs through an observer, and the metrics (`forewarn.metrics`,
`forewarn.fleet.metrics`) implement that observer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backlog:
    """What waits for one sink: how many records and when the oldest was written."""

    records: int
    oldest_created: float | None
