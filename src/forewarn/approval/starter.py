"""What carries out an approval: the one call the approver makes to let events start.

The approver decides *which* events may start and *when*; a Starter makes it happen. On an Azure VM that
is IMDS's StartRequests POST (`ImdsStarter`). Another node action (draining a Kubernetes node first, say)
or a test stands in by implementing `start`, without the approver knowing the difference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from forewarn.imds.client import ImdsClient, ImdsError


class StartError(Exception):
    """The events were not started. The message is safe to log (it names no secret); the approver counts
    the failure and asks again after a backoff while the events stay Scheduled."""


class Starter(Protocol):
    def start(self, event_ids: Sequence[str]) -> None:
        """Start every event in `event_ids` (one batch). Returns once accepted; raises StartError if not.
        Asking again for an event already started must be harmless: the approver re-asks when an
        approved event stays Scheduled."""


class ImdsStarter:
    """Starts events with IMDS's StartRequests POST, one request for the whole batch."""

    def __init__(self, client: ImdsClient) -> None:
        self._client = client

    def start(self, event_ids: Sequence[str]) -> None:
        try:
            self._client.start_events(list(event_ids))
        except ImdsError as exc:
            raise StartError(str(exc)) from exc
