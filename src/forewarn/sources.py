"""Sources: the loops that read a feed of Scheduled Events, in both modes, behind one interface.

A source reads one feed until its stop event is set and hands what it read to its mode's core, which turns it
into changes, records (through the outbox) and metrics:
- `forewarn run`: the IMDS poller (`poller.Poller`, name `imds`), one VM's document every poll, into the
  document tracker;
- `forewarn fleet`: Resource Graph snapshots and the Storage queue (`fleet/service.py`), into the fleet
  tracker through one committer (the Event Grid push route is a web route, not a loop).

`Term` runs a set of sources on threads of their own for as long as they should run: the whole life of the
process, or, in fleet mode, one term as the Lease holder.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Protocol

log = logging.getLogger(__name__)

#: How long a source may take to notice its stop before the caller carries on without it (it is a daemon).
STOP_WAIT = 2.0


class StopSignal(threading.Event):
    """A stop event that one loop can also sleep on cheaply, between polls for instance.

    `Event.wait` goes through a Condition: every call allocates a lock and runs a dozen lines of Python,
    which the IMDS poll, sleeping once a second for ever, paid at every poll (a tenth of an unchanged poll's
    CPU). `pause` waits on one lock kept locked for the purpose, which `set` releases. One thread at a time
    may pause; any number may `wait` as on any Event.
    """

    def __init__(self) -> None:
        super().__init__()
        self._gate = threading.Lock()
        self._gate.acquire()

    def set(self) -> None:
        super().set()
        if self._gate.locked():
            with contextlib.suppress(RuntimeError):  # released by a concurrent set
                self._gate.release()

    def clear(self) -> None:
        super().clear()
        self._gate.acquire(blocking=False)  # locked again, whether or not a set had released it

    def pause(self, seconds: float) -> bool:
        """Sleep for `seconds` or until the event is set, whichever comes first; True when it is set."""
        if seconds > 0 and not self.is_set():
            self._gate.acquire(timeout=seconds)  # acquired only when `set` released it: the event is set
        return self.is_set()


class Source(Protocol):
    """One feed, read in a loop. `run` returns when `stop` is set; a stop also ends any wait or request under
    way (each source's client has a deadline per request and watches the event)."""

    name: str

    def run(self, stop: threading.Event) -> None: ...


class Term:
    """Sources on threads of their own, from `start` to `stop`."""

    def __init__(self, sources: Sequence[Source]) -> None:
        self.sources = sources
        self._over: threading.Event | None = None
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        self._over = threading.Event()
        self._threads = [threading.Thread(target=source.run, args=(self._over,), name=f"source-{source.name}",
                                          daemon=True) for source in self.sources]
        for thread in self._threads:
            thread.start()
        log.info("reading %s", ", ".join(source.name for source in self.sources) or "no source of our own")

    def stop(self) -> None:
        """Set the sources' stop and wait for them, at most STOP_WAIT seconds in all."""
        if self._over is None:
            return
        self._over.set()
        deadline = time.monotonic() + STOP_WAIT
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._over = None
        self._threads = []
