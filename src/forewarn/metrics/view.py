"""The view: what the metrics show about the present, as data.

The poller, the delivery workers and the agent report what they learn through the typed operations of
`ViewHolder`; each operation replaces the immutable `View` as a whole, so a scrape reads one consistent
state without waiting for a poll. Rendering it is `forewarn.metrics.exposition`'s business: nothing here
knows about Prometheus.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from forewarn.backlog import Backlog
from forewarn.imds.document import Document
from forewarn.imds.instance import VmInfo


@dataclass(frozen=True)
class View:
    """Everything the scrape-time families read.

    `document` and `status_since` (event id -> Unix time the event entered its current status) change
    only together with the document; exposition caches their rendering by identity, so an operation
    that does not change them keeps the very same objects."""

    document: Document | None = None
    vm: VmInfo = field(default_factory=VmInfo)
    imds_up: bool = False
    last_success: float | None = None
    backlogs: Mapping[str, Backlog] = field(default_factory=dict)
    store_writable: bool = True
    status_since: Mapping[str, float] = field(default_factory=dict)

    def succeeded_at(self, now: float) -> View:
        """This view with `last_success` at `now`, everything else the same objects."""
        view = object.__new__(View)
        fields = view.__dict__
        fields.update(self.__dict__)
        fields["last_success"] = now  # frozen: set in the new object's own dict, as dataclasses do
        return view


class ViewHolder:
    """The current View; every operation swaps it atomically and is safe from several threads."""

    def __init__(self, view: View | None = None) -> None:
        self._view = view or View()
        self._lock = threading.Lock()

    @property
    def view(self) -> View:
        return self._view

    def document_seen(self, document: Document | None, now: float,
                      status_since: Mapping[str, float] | None = None) -> None:
        """A poll succeeded at `now` and `document` is the current one; `status_since` is given when an
        event's status changed (leaving it out keeps the previous mapping, and so the cached rendering)."""
        with self._lock:
            view = self._view
            if status_since is None and view.document is document and view.imds_up:
                # Nearly every poll: only the time moves (a copy of the fields, a tenth of `replace`'s cost).
                self._view = view.succeeded_at(now)
                return
            self._view = replace(view, document=document, imds_up=True, last_success=now,
                                 status_since=view.status_since if status_since is None else status_since)

    def document_resumed(self, document: Document | None, status_since: Mapping[str, float]) -> None:
        """The document saved by an earlier run, shown at start: known, yet not a successful poll."""
        with self._lock:
            self._view = replace(self._view, document=document, status_since=status_since)

    def imds_failed(self) -> None:
        """A poll failed; the last known document stays."""
        with self._lock:
            self._view = replace(self._view, imds_up=False)

    def vm_known(self, vm: VmInfo) -> None:
        """This VM's identity, as instance metadata (or --vm-name) tells it."""
        with self._lock:
            self._view = replace(self._view, vm=vm)

    def store_writable(self, writable: bool) -> None:
        """Whether the state dir takes writes (False while records are held in memory)."""
        with self._lock:
            self._view = replace(self._view, store_writable=writable)

    def backlog(self, sink: str, backlog: Backlog) -> None:
        """What waits for one sink."""
        with self._lock:
            self._view = replace(self._view, backlogs={**self._view.backlogs, sink: backlog})
