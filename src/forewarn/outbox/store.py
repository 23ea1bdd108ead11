"""The on-disk memory of the collector: the last document seen and the outbox of records to deliver.

Both live in one SQLite database (WAL mode) under `--state-dir`, and one transaction writes a
document's records together with the document itself. So after any stop, SIGKILL included, either both
are on disk or neither is: with neither, the next start diffs against the older document and produces
the same records again, with the same ids (at least once, nothing lost, nothing re-reported as added).

Each sink has a cursor: the highest record sequence number it acknowledged. A record is deleted once
every configured sink is past it, so a slow sink never holds back another's delivery.

Records are only ever deleted from the low end (acknowledged ones, and the oldest when the outbox is full) and
numbered one after another, so the outbox holds exactly MAX(seq) - MIN(seq) + 1 records: two lookups in the
primary key's index instead of a count that reads every row (tests/test_outbox_count.py holds the two equal
through appends, acknowledgements, drops, refusals and moves between stores in any order).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal

from forewarn.backlog import Backlog
from forewarn.imds.document import Document, DocumentError, parse_document
from forewarn.records import JsonRecords, Record

DB_FILE = "forewarn.sqlite"
DEFAULT_MAX_RECORDS = 100_000
#: Pages in the write-ahead log that make a commit copy it into the database (see `Store._conn`).
WAL_CHECKPOINT_PAGES = 8192
#: How long `close` waits for reads and writes under way in other threads before it gives up closing.
CLOSE_WAIT_SECONDS = 2.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    body TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS cursors (sink TEXT PRIMARY KEY, acked INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS state (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

#: The lowest and highest sequence number (None, None when empty). Two subqueries: SQLite looks a lone MIN()
#: or MAX() up in the primary key's index, but reads every row for the two together (tests/test_outbox_count.py).
ENDS_SQL = "SELECT (SELECT MIN(seq) FROM records), (SELECT MAX(seq) FROM records)"

_memory_ids = itertools.count()


#: What a commit does when its records do not fit within `max_records`: drop the oldest records to make room
#: (the per-VM agent), refuse the whole commit with OutboxFull (fleet mode's sources, which keep their news and
#: bring it again), or go over the bound (a few records of actions already taken, which must not be refused).
Overflow = Literal["drop", "refuse", "exceed"]


class StoreError(Exception):
    """The store could not be read or written; the message says why (disk full, read-only, ...)."""


class OutboxFull(Exception):
    """A commit with overflow "refuse" did not fit: nothing was written. Not a StoreError: the store works,
    and the records fit once the sinks have taken some."""

    def __init__(self, stored: int, adding: int, max_records: int) -> None:
        super().__init__(f"the outbox holds {stored} of at most {max_records} records and cannot take {adding} "
                         "more until the sinks have taken some")
        self.stored = stored
        self.adding = adding
        self.max_records = max_records


class Store:
    """State and outbox in one SQLite file (or in memory, when `path` is None)."""

    def __init__(self, path: Path | None, sinks: Iterable[str], max_records: int = DEFAULT_MAX_RECORDS):
        self.path = path
        self.max_records = max_records
        if path is None:
            self._uri = f"file:forewarn-{next(_memory_ids)}?mode=memory&cache=shared"
        else:
            self._uri = f"file:{path}"
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._write_lock = threading.Lock()
        # Closing a connection while another thread runs a statement on it crashes the interpreter (or
        # hangs it): every use is counted, and `close` waits for the count to reach zero.
        self._users = threading.Condition()
        self._active = 0
        self._closed = False
        try:
            conn = self._conn()
            # An in-memory database lives as long as one connection to it: keep this one open.
            self._anchor = conn
            if path is not None:
                conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open {path or 'the in-memory store'}: {exc}") from exc
        self._register_sinks(list(sinks))

    @contextlib.contextmanager
    def _use(self) -> Iterator[sqlite3.Connection]:
        """This thread's connection, counted as in use until the block ends; StoreError once closed."""
        with self._users:
            if self._closed:
                raise StoreError("the store is closed")
            self._active += 1
        try:
            yield self._conn()
        finally:
            with self._users:
                self._active -= 1
                if self._active == 0:
                    self._users.notify_all()

    @contextlib.contextmanager
    def _transaction(self, durable: bool = True) -> Iterator[sqlite3.Connection]:
        """One write transaction; raises StoreError (nothing written) on any SQLite failure.

        `durable` False commits without waiting for the disk (WAL with synchronous=NORMAL): the commit
        survives the process being killed, but a power cut may undo it."""
        with self._use() as conn, self._write_lock:
            try:
                if not durable:
                    conn.execute("PRAGMA synchronous=NORMAL")
                try:
                    conn.execute("BEGIN IMMEDIATE")
                    try:
                        yield conn
                        conn.execute("COMMIT")
                    except BaseException:
                        # On SQLITE_FULL and some I/O errors SQLite has already rolled back by itself.
                        self._rollback(conn)
                        raise
                finally:
                    if not durable:
                        conn.execute("PRAGMA synchronous=FULL")
            except sqlite3.Error as exc:
                raise StoreError(str(exc)) from exc

    def _rollback(self, conn: sqlite3.Connection) -> None:
        """End a failed transaction; a connection that cannot even roll back is closed, so that it
        cannot keep the database's write lock and block the next writer."""
        try:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
        except sqlite3.Error:
            if conn is not self._anchor:
                self._local.conn = None
                conn.close()

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self._uri, uri=True, timeout=10, isolation_level=None,
                                   check_same_thread=False)
            # FULL: a record the collector counted as spooled survives power loss, not only a crash.
            conn.execute("PRAGMA synchronous=FULL")
            # At most 256 KiB of pages per connection (SQLite's default is 2 MiB): there is one per thread that
            # touches the store, and the OS caches the file anyway. -3 to -6 MiB in fleet mode (bench/fleet.py).
            conn.execute("PRAGMA cache_size=-256")
            # Deleted rows are zeroed where their page is written anyway, not in pages that become free: Debian's
            # SQLite (the image's) zeroes those too (SECURE_DELETE), which wrote every delivered page once more
            # and made the acknowledgement of a batch a third dearer. Records hold no secrets.
            conn.execute("PRAGMA secure_delete=FAST")
            # The write-ahead log is copied into the database (and the database synced) once it passes this many
            # pages, 32 MiB, not SQLite's 1,000 (4 MiB): a first fleet snapshot of 100,000 VMs writes over 100 MiB
            # in 200 commits, and checkpointing every 7th of them made the commit 13% slower (bench/fleet.py
            # --vms). Each commit still syncs the log itself (synchronous=FULL): what is committed stays
            # committed. The log file keeps its largest size until the store is closed.
            conn.execute(f"PRAGMA wal_autocheckpoint={WAL_CHECKPOINT_PAGES}")
            self._local.conn = conn
            self._connections.append(conn)
        return conn

    def _register_sinks(self, sinks: list[str]) -> None:
        with self._transaction() as conn:
            # A sink seen for the first time starts at the oldest record still waiting; a sink no
            # longer configured stops holding records back.
            start = conn.execute("SELECT COALESCE(MIN(seq) - 1, 0) FROM records").fetchone()[0]
            for sink in sinks:
                conn.execute("INSERT OR IGNORE INTO cursors (sink, acked) VALUES (?, ?)", (sink, start))
            marks = ",".join("?" * len(sinks))
            conn.execute(f"DELETE FROM cursors WHERE sink NOT IN ({marks})", sinks)  # noqa: S608
            self._prune(conn)

    def load_document(self) -> Document | None:
        """The last document committed, or None on a first start (or an unreadable entry)."""
        try:
            with self._use() as conn:
                row = conn.execute("SELECT value FROM state WHERE key = 'document'").fetchone()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read state: {exc}") from exc
        if row is None:
            return None
        try:
            return parse_document(row[0])
        except DocumentError:
            return None

    def load_state(self, key: str) -> str | None:
        """The saved state under `key` (another mode's counterpart of the document: fleet mode saves its
        tracker here), or None when nothing was saved under it."""
        try:
            with self._use() as conn:
                row = conn.execute("SELECT value FROM state WHERE key = ?", (key,)).fetchone()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read state: {exc}") from exc
        return None if row is None else str(row[0])

    def states(self, prefix: str = "") -> dict[str, str]:
        """Every saved state but the document whose key starts with `prefix` (all of them by default, to
        carry them over to another store)."""
        try:
            with self._use() as conn:
                rows = conn.execute("SELECT key, value FROM state WHERE key != 'document' AND substr(key, 1, ?) = ?",
                                    (len(prefix), prefix)).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read state: {exc}") from exc
        return {str(key): str(value) for key, value in rows}

    def commit(self, document: Document | None, records: Sequence[Record],
               state: Mapping[str, str | None] | None = None, overflow: Overflow = "drop") -> tuple[int, int]:
        """Write `records` to the outbox, `document` as the state and each of `state` under its key (None
        deletes the key), in one transaction.

        Returns how many old records were dropped to keep the outbox within `max_records` (overflow "drop"),
        and how many records the outbox holds after the commit. Raises OutboxFull (overflow "refuse": the
        records do not fit, and the outbox is not empty) or StoreError (the disk is full or the file is not
        writable), and then writes nothing. An empty outbox takes a commit larger than `max_records` whole
        (refusing it would refuse it for ever), and a commit of state alone always fits.
        """
        now = time.time()
        with self._transaction() as conn:
            if overflow == "refuse":
                stored = self._stored(conn)
                if records and stored and stored + len(records) > self.max_records:
                    raise OutboxFull(stored, len(records), self.max_records)
            texts = records.texts if isinstance(records, JsonRecords) else [record.to_json() for record in records]
            conn.executemany("INSERT INTO records (body, created) VALUES (?, ?)", [(text, now) for text in texts])
            self._save_document(conn, document)
            self._save_states(conn, state)
            dropped = self._enforce_bound(conn) if overflow == "drop" else 0
            return dropped, self._stored(conn)

    @staticmethod
    def _save_states(conn: sqlite3.Connection, state: Mapping[str, str | None] | None) -> None:
        """Every key's row written or deleted, one statement for each kind (fleet mode saves a row per event: a
        statement per row was a third of committing a first snapshot of 20,000 events). The deletions go first:
        no key is both deleted and written, as `state` holds each key once."""
        state = state or {}
        if "document" in state:
            raise ValueError("the key 'document' is the IMDS document's")
        conn.executemany("DELETE FROM state WHERE key = ?", [(key,) for key, value in state.items() if value is None])
        conn.executemany("INSERT OR REPLACE INTO state (key, value) VALUES (?, ?)",
                         [(key, value) for key, value in state.items() if value is not None])

    @staticmethod
    def _save_document(conn: sqlite3.Connection, document: Document | None) -> None:
        if document is not None:
            conn.execute("INSERT OR REPLACE INTO state (key, value) VALUES ('document', ?)",
                         (json.dumps(dict(document.raw), separators=(",", ":")),))

    @staticmethod
    def _stored(conn: sqlite3.Connection) -> int:
        """How many records the outbox holds: its sequence numbers have no gaps (see the module's docstring),
        and MIN and MAX of the primary key are each one lookup in its index, where COUNT(*) reads every row."""
        low, high = conn.execute(ENDS_SQL).fetchone()
        return 0 if low is None else int(high) - int(low) + 1

    def _enforce_bound(self, conn: sqlite3.Connection) -> int:
        """Drop the oldest records beyond `max_records`; returns how many."""
        low, high = conn.execute(ENDS_SQL).fetchone()
        excess = 0 if low is None else int(high) - int(low) + 1 - self.max_records
        if excess <= 0:
            return 0
        conn.execute("DELETE FROM records WHERE seq < ?", (low + excess,))
        return int(excess)

    def stored(self) -> int:
        """How many records the outbox holds (for every sink together)."""
        try:
            with self._use() as conn:
                return self._stored(conn)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read the outbox: {exc}") from exc

    def _prune(self, conn: sqlite3.Connection) -> None:
        conn.execute("DELETE FROM records WHERE seq <= (SELECT MIN(acked) FROM cursors)")

    def fetch(self, sink: str, limit: int, after: int = 0) -> list[tuple[int, str]]:
        """Up to `limit` records the sink has not acknowledged, past `after`, oldest first: sequence number
        and JSON text (parsing is left to whoever reads the record: a sink that writes JSON needs none)."""
        try:
            with self._use() as conn:
                rows = conn.execute(
                    "SELECT seq, body FROM records WHERE seq > MAX(?, (SELECT acked FROM cursors WHERE sink = ?)) "
                    "ORDER BY seq LIMIT ?",
                    (after, sink, limit),
                ).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read the outbox: {exc}") from exc
        return [(int(seq), str(body)) for seq, body in rows]

    def ack(self, sink: str, seq: int) -> int:
        """The sink has every record up to `seq`; drop what no sink still needs.

        Not waited for on disk: an acknowledgement that a power cut undoes only sends its records again,
        with the same ids (the delivery promise is at least once), while an fsync per batch cost as much
        as writing a batch of 2,000 records to a file. Returns how many records the outbox holds after it."""
        with self._transaction(durable=False) as conn:
            conn.execute("UPDATE cursors SET acked = MAX(acked, ?) WHERE sink = ?", (seq, sink))
            self._prune(conn)
            return self._stored(conn)

    def backlog(self, sink: str) -> Backlog:
        try:
            with self._use() as conn:
                row = conn.execute(
                    "SELECT COUNT(*), MIN(created) FROM records WHERE seq > (SELECT acked FROM cursors WHERE sink = ?)",
                    (sink,),
                ).fetchone()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read the outbox: {exc}") from exc
        return Backlog(records=int(row[0]), oldest_created=row[1])

    def dump(self) -> tuple[list[tuple[int, str, float]], dict[str, int]]:
        """Every waiting record and every cursor, to carry the outbox over to another store."""
        try:
            with self._use() as conn:
                rows = conn.execute("SELECT seq, body, created FROM records ORDER BY seq").fetchall()
                cursors = dict(conn.execute("SELECT sink, acked FROM cursors").fetchall())
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read the outbox: {exc}") from exc
        return [(int(a), str(b), float(c)) for a, b, c in rows], {str(k): int(v) for k, v in cursors.items()}

    def adopt(self, rows: Sequence[tuple[int, str, float]], cursors: dict[str, int],
              document: Document | None, state: Mapping[str, str | None] | None = None) -> None:
        """Replace this store's outbox and state with another store's (see `dump`), in one transaction.

        Sequence numbers and cursors are kept as they were, so each sink resumes where it stood.
        """
        with self._transaction() as conn:
            conn.execute("DELETE FROM records")
            conn.executemany("INSERT INTO records (seq, body, created) VALUES (?, ?, ?)", rows)
            for sink, acked in cursors.items():
                conn.execute("UPDATE cursors SET acked = ? WHERE sink = ?", (acked, sink))
            # New records must number after everything adopted, or a cursor would skip them; and right after
            # the last record adopted, so that the numbers have no gap (`_stored` counts on it). The rows of
            # a store have no gap either: `dump` reads them all.
            high = max([seq for seq, _, _ in rows] + list(cursors.values()) + [0])
            current = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'records'").fetchone()
            conn.execute("DELETE FROM sqlite_sequence WHERE name = 'records'")
            conn.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('records', ?)",
                         (high if rows else max(high, current[0] if current else 0),))
            self._save_document(conn, document)
            self._save_states(conn, state)

    def merge(self, rows: Sequence[tuple[int, str, float]], document: Document | None,
              state: Mapping[str, str | None] | None = None) -> None:
        """Add another store's records (see `dump`) after this one's, and its document and saved states over this
        one's, in one transaction. For a store that took over when this one could not even be read (Outbox): it
        began empty, so this one's records still wait and must not be replaced. Its records are numbered on from
        this store's last, in their order, so the numbers stay without a gap (`_stored`) and no cursor skips them;
        each sink's cursor stays where it stood here (a record a sink took from the other store is sent again,
        under the same id: at least once). A state row the other store deleted is not known here and stays (fleet
        mode reads an event's ended row over its open one: forewarn.fleet.state.load)."""
        with self._transaction() as conn:
            conn.executemany("INSERT INTO records (body, created) VALUES (?, ?)",
                             [(body, created) for _, body, created in rows])
            self._save_document(conn, document)
            self._save_states(conn, state)

    def close(self) -> None:
        """Close every connection of every thread, once what they are running has ended; from then on
        every use raises StoreError. A statement still running after CLOSE_WAIT_SECONDS (a disk that hangs)
        keeps the connections open: leaving them is safe, closing one in use is not."""
        with self._users:
            self._closed = True
            if not self._users.wait_for(lambda: self._active == 0, timeout=CLOSE_WAIT_SECONDS):
                return
        for conn in self._connections:
            with contextlib.suppress(sqlite3.Error):
                conn.close()
