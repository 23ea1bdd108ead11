"""The outbox: where records wait for their sinks, behind one object that owns its storage and fail-over.

The poller appends records (together with the document they came from, in one transaction); each
delivery worker takes its sink's records in order, acknowledges what the sink accepted, and waits for
more. Neither ever sees the SQLite `Store` behind. That store is a file under --state-dir while the disk
takes writes. When a write fails (disk full, read-only mount, permissions), the outbox moves into an
in-memory database with sequence numbers and cursors intact, so delivery goes on; a thread of its own
tries the state dir again every 30 s and, once it works, carries the waiting records and the saved
document back to disk.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from forewarn.backlog import Backlog
from forewarn.imds.document import Document
from forewarn.logs import StateLog
from forewarn.outbox.store import DB_FILE, DEFAULT_MAX_RECORDS, OutboxFull, Overflow, Store, StoreError
from forewarn.records import JsonRecords, Record

__all__ = ["RETRY_SECONDS", "Backlog", "Batch", "Outbox", "OutboxFull", "OutboxObserver", "Overflow", "StoreError"]

log = logging.getLogger(__name__)

#: While the state dir is unusable, how often to try it again.
RETRY_SECONDS = 30.0


@dataclass(frozen=True)
class Batch:
    """What `take` read for one sink: its records, oldest first, and the sequence number that acknowledges
    them all (0 when there are none)."""

    records: JsonRecords
    last: int

    def __len__(self) -> int:
        return len(self.records)


class OutboxObserver:
    """What the outbox tells the rest of the agent about its storage (the agent turns it into metrics).

    Calls come from whichever thread appended or retried; this base class ignores them all."""

    def write_failed(self) -> None:
        """A write to the state dir failed; the records went to memory instead."""

    def records_dropped(self, count: int) -> None:
        """The outbox was full: its `count` oldest records were dropped to make room."""

    def writable_changed(self, writable: bool) -> None:
        """The outbox moved into memory (False) or back onto the state dir (True)."""

    def stored_changed(self, stored: int, capacity: int) -> None:
        """The outbox holds `stored` of at most `capacity` records now (for every sink together): at start,
        and after each append or acknowledgement."""

    def commit_refused(self) -> None:
        """An append with overflow "refuse" did not fit and wrote nothing (OutboxFull)."""


class Outbox:
    """Records waiting for the named sinks, delivered at least once and in order to each.

    Without a state dir the outbox lives in memory from the start, and that counts as writable: there is
    no disk to fail. `retry_seconds` is how often an unusable state dir is tried again.
    """

    def __init__(self, state_dir: Path | None, sinks: Sequence[str], max_records: int = DEFAULT_MAX_RECORDS,
                 observer: OutboxObserver | None = None, retry_seconds: float = RETRY_SECONDS,
                 overflow: Overflow = "drop") -> None:
        self.state_dir = state_dir
        self.max_records = max_records
        #: What an append does when its records do not fit (Store.commit): "drop" the oldest (the per-VM
        #: agent), or "refuse" (fleet mode: its sources keep their news and bring it again).
        self.overflow: Overflow = overflow
        self._sinks = list(sinks)
        self._observer = observer or OutboxObserver()
        self._retry_seconds = retry_seconds
        # Appends and moves between stores take turns; reads by the workers do not wait for either (a
        # worker that reads a store just closed by a move gets StoreError and tries again).
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._wakes = {sink: threading.Event() for sink in self._sinks}
        self._state_log = StateLog(log, "state dir")
        self._retrier: threading.Thread | None = None
        self._writable = True
        #: The store in memory began empty: the disk's could not be read when it took over, so the disk still holds
        #: records it lacks, and on recovery its own are added after them (Store.merge) rather than put in their place.
        self._apart = False
        self._store = self._open()
        if not self._writable:
            self._start_retrying()
        #: Records held, as the last append or ack left them; `wait_for_room` waits on it.
        self._room = threading.Condition()
        self._stored = self._store.stored()
        self._observer.stored_changed(self._stored, self.max_records)

    def _open(self) -> Store:
        if self.state_dir is None:
            return Store(None, self._sinks, self.max_records)
        try:
            return self._open_disk(self.state_dir)
        except (OSError, StoreError) as exc:
            self._state_log.failing("open", f"{self.state_dir} is unusable ({exc}); holding state and records "
                                    f"in memory until it is, retrying every {self._retry_seconds:g} s")
        self._writable = False
        return Store(None, self._sinks, self.max_records)

    def _open_disk(self, state_dir: Path) -> Store:
        state_dir.mkdir(parents=True, exist_ok=True)
        return Store(state_dir / DB_FILE, self._sinks, self.max_records)

    # --- the interface ------------------------------------------------------------------------
    @property
    def writable(self) -> bool:
        """False while the state dir cannot be written and the records are held in memory."""
        return self._writable

    def load_document(self) -> Document | None:
        """The document last appended with its records (None on a first start); raises StoreError."""
        return self._store.load_document()

    def load_state(self, key: str) -> str | None:
        """The state last appended under `key` with its records (None when none was); raises StoreError."""
        return self._store.load_state(key)

    def load_states(self, prefix: str) -> dict[str, str]:
        """Every state saved under a key starting with `prefix`; raises StoreError."""
        return self._store.states(prefix)

    def append(self, records: Sequence[Record], document: Document | None = None,
               state: Mapping[str, str | None] | None = None, overflow: Overflow | None = None) -> int:
        """Add records, and `document` (or `state`, text by key; None removes a key) as the saved state when
        given, in one transaction; then wake the workers. Returns how many of the oldest records were dropped to stay
        within `max_records`.

        `overflow` (default: the outbox's own) says what happens when the records do not fit: "drop" the
        oldest, "refuse" (raise OutboxFull and write nothing), or "exceed" the bound (records of actions
        already taken, which are few and must not be refused). Only the loop that owns the state passes it
        (the poll loop its document, fleet mode its tracker): the saved state moves forward only together
        with the records of its changes. A write the state dir refuses is made in memory instead.
        """
        overflow = overflow or self.overflow
        with self._lock:
            if self._closed.is_set():
                raise StoreError("the outbox is closed")
            try:
                try:
                    dropped, stored = self._store.commit(document, records, state, overflow)
                except StoreError as exc:
                    self._observer.write_failed()
                    self._move_to_memory(str(exc))
                    dropped, stored = self._store.commit(document, records, state, overflow)
            except OutboxFull:
                self._observer.commit_refused()
                raise
            if dropped:
                self._observer.records_dropped(dropped)
                log.error("outbox full (%d records): dropped the %d oldest", self.max_records, dropped)
            self._set_stored(stored)
        self.wake()
        return dropped

    def refuse_if_full(self) -> None:
        """Raise OutboxFull (and count it as a refused commit) when this outbox refuses and is full: for a caller
        that would rather not prepare records that an append would refuse anyway. It reads the store itself (two
        index lookups), as `wait_for_room` does: an append and an ack on two threads may leave the count they set
        too high, and a refusal on it would wait for room that is there already."""
        if self.overflow != "refuse":
            return
        try:
            stored = self._store.stored()
        except StoreError:
            return   # closed, or moving between stores: the append itself decides
        if stored >= self.max_records:
            self._observer.commit_refused()
            raise OutboxFull(stored, 1, self.max_records)

    @property
    def stored(self) -> int:
        """The records held for every sink together, as the last append or acknowledgement left them."""
        return self._stored

    def wait_for_room(self, records: int, timeout: float) -> bool:
        """Wait up to `timeout` seconds until the outbox holds at most `records`; False on timeout. Each
        acknowledgement wakes it, and it reads the store itself (two index lookups) rather than trust a count
        that an append and an ack on two threads may have set in the wrong order."""
        deadline = time.monotonic() + timeout
        with self._room:
            while True:
                try:
                    if self._store.stored() <= records:
                        return True
                except StoreError:
                    pass  # closed, or moving between stores: look again
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._room.wait(min(left, 1.0))

    def _set_stored(self, stored: int) -> None:
        with self._room:
            self._stored = stored
            self._room.notify_all()
        self._observer.stored_changed(stored, self.max_records)

    def take(self, sink: str, limit: int, after: int = 0) -> Batch:
        """Up to `limit` records `sink` has not acknowledged, oldest first (one read of the store); only
        those past sequence number `after` (a batch still being sent) when it is given."""
        rows = self._store.fetch(sink, limit, after)
        return Batch(JsonRecords([text for _, text in rows]), rows[-1][0] if rows else 0)

    def ack(self, sink: str, up_to: int) -> None:
        """`sink` has every record up to sequence number `up_to` (a `Batch`'s `last`); what no sink still
        needs is deleted, in one transaction."""
        self._set_stored(self._store.ack(sink, up_to))

    @property
    def sinks(self) -> tuple[str, ...]:
        return tuple(self._sinks)

    def backlog(self, sink: str) -> Backlog:
        """What waits for `sink`: how many records, and when the oldest was appended."""
        return self._store.backlog(sink)

    def wait(self, sink: str, timeout: float) -> bool:
        """Wait up to `timeout` seconds for records appended for `sink` (or `wake`); False on timeout."""
        event = self._wakes.setdefault(sink, threading.Event())
        woke = event.wait(timeout)
        event.clear()
        return woke

    def wake(self, sink: str | None = None) -> None:
        """End the `wait` of one sink's worker, or of every worker."""
        if sink is not None:
            self._wakes.setdefault(sink, threading.Event()).set()
            return
        for event in list(self._wakes.values()):
            event.set()

    def recover(self) -> bool:
        """Try the state dir now rather than at the next retry; True when the outbox is (back) on it."""
        with self._lock:
            return self._writable or self._move_to_disk()

    def close(self) -> None:
        """Stop retrying and close the store; a later `append` raises StoreError, and so do the reads of
        a worker still running (its records stay unacknowledged, for the next start)."""
        self._closed.set()
        with self._lock:
            self._store.close()

    # --- fail-over (the callers hold the lock) --------------------------------------------------
    def _move_to_memory(self, reason: str) -> None:
        """Carry the outbox into memory, so records keep flowing while the disk cannot take them."""
        self._state_log.failing("write", f"cannot write state ({reason}); holding records in memory until it "
                                f"can, retrying every {self._retry_seconds:g} s")
        old = self._store
        memory = Store(None, self._sinks, self.max_records)
        try:
            _carry(old, memory)
            if old.path is not None:
                self._apart = False
        except StoreError as exc:
            log.error("could not carry the outbox over to memory (%s); records waiting on disk are delivered "
                      "once it recovers", exc)
            self._apart = self.state_dir is not None
        self._store = memory
        self._set_stored(memory.stored())
        # Closing every connection releases any lock a failed write left behind, so the disk store can be
        # opened again as soon as there is room.
        old.close()
        if self._writable:
            self._writable = False
            self._observer.writable_changed(False)
        self._start_retrying()

    def _move_to_disk(self) -> bool:
        """Carry the outbox from memory back onto the state dir, if it takes writes again."""
        if self.state_dir is None or self._closed.is_set():
            return False
        memory = self._store
        disk = None
        try:
            disk = self._open_disk(self.state_dir)
            if self._apart:
                rows, _ = memory.dump()
                disk.merge(rows, memory.load_document(), memory.states())
            else:
                _carry(memory, disk)
        except (OSError, StoreError) as exc:
            log.debug("state dir still unusable: %s", exc)
            if disk is not None:
                disk.close()
            return False
        self._store = disk
        self._apart = False
        memory.close()
        self._set_stored(disk.stored())
        self._writable = True
        self._state_log.ok()
        self._observer.writable_changed(True)
        # Records appended to memory while a worker was reading are on disk now: let every worker look.
        self.wake()
        return True

    def _start_retrying(self) -> None:
        if self.state_dir is None or self._retrier is not None:
            return
        self._retrier = threading.Thread(target=self._retry, name="outbox-retry", daemon=True)
        self._retrier.start()

    def _retry(self) -> None:
        """Try the state dir every `retry_seconds` until the outbox is back on it (or closed)."""
        while not self._closed.wait(self._retry_seconds):
            with self._lock:
                # Ending under the lock: a failure after this starts a new thread, never finds this one.
                if self._writable or self._move_to_disk():
                    self._retrier = None
                    return


def _carry(source: Store, target: Store) -> None:
    """Give `target` the records, cursors and saved states of `source` (sequence numbers as they were)."""
    rows, cursors = source.dump()
    target.adopt(rows, cursors, source.load_document(), source.states())
