"""What every notification sink shares: the filter, the rate limit, the record ids already sent, the POST.

A notification sink posts one message per record, in order. The outbox already retries until a send
succeeds and keeps what is waiting across restarts; what it cannot promise is "once": after a crash or a
failed acknowledgement it hands the same records over again. People do not want the same Slack message
twice, so each notification sink remembers the ids it has posted (`SentIds`, a small table beside the
outbox) and skips a repeat. Record ids are deterministic (VM, event, change, incarnation), so the same
change seen again after a restart has the same id.

The URL is a secret (Slack and Teams webhook URLs carry their key in the path, others in the query): it
comes from an environment variable or a file, is never logged, and only `scheme://host/...` appears in
errors.
"""

from __future__ import annotations

import logging
import os
import re
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from forewarn.config import safe_url
from forewarn.records import APPROVED, DRAIN, NODE_ACTION, Record
from forewarn.retry import parse_retry_after
from forewarn.sinks import SinkConfigError, SinkError
from forewarn.tracker import ChangeKind

log = logging.getLogger(__name__)

#: The changes a filter may name: the tracker's (added, updated, removed) and the approver's (approved, and
#: node_action and drain for Kubernetes node actions).
CHANGES = (*(str(kind) for kind in ChangeKind), APPROVED, NODE_ACTION, DRAIN)
#: How each step of a drain reads in a headline.
_DRAIN_WORDS = {"started": "started", "blocked": "blocked by a PodDisruptionBudget",
                "deleted": "deleted a pod at the deadline", "done": "done", "failed": "failed"}
#: Ids remembered per sink; far more than one VM's changes between two restarts.
MAX_SENT = 10_000
#: The file beside the outbox database that holds the ids sent.
SENT_FILE = "notify-sent.db"
#: Per-request timeout (connect and each read).
TIMEOUT = 10.0
#: Most of an endpoint's answer read: forewarn only needs its status.
MAX_ANSWER_BYTES = 64 * 1024


class NotifyError(SinkError):
    """A failed post; `retry_after` is the peer's Retry-After in seconds, when it sent one."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def check_url(url: str | None, what: str) -> str:
    """A webhook URL from `what` (the variable or file option), checked without ever echoing it."""
    if not url:
        raise SinkConfigError(f"needs {what}")
    url = url.strip()
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - reading it checks it
    except ValueError:
        raise SinkConfigError(f"{what}: not a URL (the value is not shown)") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in url):
        raise SinkConfigError(f"{what}: expected an http:// or https:// URL (the value is not shown)")
    return url


@dataclass(frozen=True)
class Filter:
    """Which records a sink notifies about; an empty set means any."""

    types: frozenset[str] = frozenset()
    changes: frozenset[str] = frozenset()
    this_vm: bool = False

    def matches(self, record: Record) -> bool:
        data = record.data
        if self.changes and data.get("change") not in self.changes:
            return False
        if self.types and data.get("event", {}).get("EventType") not in self.types:
            return False
        return not self.this_vm or bool(data.get("affects_this_vm"))


def parse_filter(text: str | None, option: str) -> Filter:
    """`types=Reboot,Redeploy changes=added,approved this-vm` (terms separated by spaces or ';')."""
    if not text or not text.strip():
        return Filter()
    types: set[str] = set()
    changes: set[str] = set()
    this_vm = False
    valid = "terms types=T1,T2 changes=C1,C2 this-vm, separated by spaces"
    for position, term in enumerate(re.split(r"[\s;]+", text.strip()), start=1):
        key, equals, value = term.partition("=")
        items = [item for item in value.split(",") if item]
        if key == "this-vm" and (not equals or value.lower() in ("true", "yes", "1")):
            this_vm = True
        elif key == "this-vm" and value.lower() in ("false", "no", "0"):
            this_vm = False
        elif key == "types" and items:
            types.update(items)
        elif key == "changes" and items:
            unknown = [item for item in items if item not in CHANGES]
            if unknown:
                raise SinkConfigError(f"--{option}: term {position}: change {unknown[0]!r} is not known; "
                                      f"valid: {', '.join(CHANGES)}")
            changes.update(items)
        else:
            raise SinkConfigError(f"--{option}: term {position} {term!r} is not understood; valid: {valid}")
    return Filter(frozenset(types), frozenset(changes), this_vm)


class RateLimit:
    """At most `per_second` messages a second, spaced evenly (0: no limit). Slack takes about one message
    a second per webhook and answers bursts with 429; spacing them avoids the 429 in the first place."""

    def __init__(self, per_second: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.interval = 1.0 / per_second if per_second > 0 else 0.0
        self._clock = clock
        self._sleep = sleep
        self._next = 0.0

    def wait(self) -> None:
        if not self.interval:
            return
        now = self._clock()
        if now < self._next:
            self._sleep(self._next - now)
            now = self._next
        self._next = now + self.interval


class SentIds:
    """The record ids a sink has posted, the newest MAX_SENT of them, kept on disk beside the outbox (in
    memory when there is no state dir or it cannot be written: repeats are then skipped until a restart)."""

    def __init__(self, state_dir: str | None, sink: str, limit: int = MAX_SENT) -> None:
        self.sink = sink
        self.limit = limit
        self._memory: OrderedDict[str, None] = OrderedDict()
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self._added = 0
        if state_dir:
            try:
                Path(state_dir).mkdir(parents=True, exist_ok=True)
                db = sqlite3.connect(Path(state_dir) / SENT_FILE, check_same_thread=False, isolation_level=None)
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across a process crash
                db.execute("CREATE TABLE IF NOT EXISTS sent (sink TEXT NOT NULL, id TEXT NOT NULL, "
                           "seq INTEGER PRIMARY KEY AUTOINCREMENT, UNIQUE (sink, id))")
                # Loaded once: a lookup per message then costs no query (the newest `limit` ids suffice).
                rows = db.execute("SELECT id FROM sent WHERE sink = ? ORDER BY seq DESC LIMIT ?", (sink, limit))
                for (known,) in reversed(rows.fetchall()):
                    self._memory[known] = None
                self._db = db
            except sqlite3.Error:
                self._db = None  # the outbox reports an unusable state dir; repeats are skipped in memory

    def __contains__(self, record_id: object) -> bool:
        with self._lock:
            return record_id in self._memory

    def add(self, record_id: str) -> None:
        self.add_many((record_id,))

    def add_many(self, record_ids: Iterable[str]) -> None:
        """Remembers ids in one transaction (a sink that sends a whole batch in one request)."""
        ids = list(record_ids)
        if not ids:
            return
        with self._lock:
            for record_id in ids:
                self._memory[record_id] = None
            while len(self._memory) > self.limit:
                self._memory.popitem(last=False)
            if self._db is None:
                return
            try:
                with self._db:  # isolation_level=None: the with block alone does not open a transaction
                    self._db.execute("BEGIN")
                    self._db.executemany("INSERT OR IGNORE INTO sent (sink, id) VALUES (?, ?)",
                                         [(self.sink, record_id) for record_id in ids])
                before, self._added = self._added, self._added + len(ids)
                if before // 500 != self._added // 500:  # keep the table bounded, without a DELETE per message
                    self._db.execute("DELETE FROM sent WHERE sink = ? AND seq <= (SELECT seq FROM sent WHERE "
                                     "sink = ? ORDER BY seq DESC LIMIT 1 OFFSET ?)", (self.sink, self.sink,
                                                                                      self.limit))
            except sqlite3.Error:
                pass  # remembered in memory; after a restart these records may be sent again

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


class Poster:
    """POSTs to one URL over one kept-alive connection; any answer but 2xx is a NotifyError (429 and 503 carry
    the peer's Retry-After). Messages name the endpoint as scheme://host/... only.

    urllib3 directly rather than a requests Session: requests' per-call preparation (merging settings,
    hooks, cookies) cost more than the POST itself on loopback and held the drain below 1,000 messages a
    second. What requests gave is kept: HTTPS_PROXY / NO_PROXY (read once), and certificates checked
    against REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE when set, else certifi's bundle."""

    def __init__(self, url: str, timeout: float = TIMEOUT) -> None:
        import certifi
        import requests.utils
        import urllib3

        self.url = url
        self.target = safe_url(url)
        self._timeout = urllib3.Timeout(connect=timeout, read=timeout)
        ca_file = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or certifi.where()
        proxy = requests.utils.get_environ_proxies(url).get(urlsplit(url).scheme)
        self._pool: urllib3.PoolManager = (urllib3.ProxyManager(proxy, maxsize=1, ca_certs=ca_file) if proxy
                                           else urllib3.PoolManager(maxsize=1, ca_certs=ca_file))

    def post(self, body: bytes, headers: Mapping[str, str]) -> None:
        import urllib3

        try:
            response = self._pool.request("POST", self.url, body=body, headers=dict(headers), timeout=self._timeout,
                                          redirect=False, retries=False, preload_content=False)
            # The answer's body is not needed: read at most MAX_ANSWER_BYTES so the connection can be kept,
            # and drop the connection when there is more (an endpoint cannot make forewarn hold megabytes).
            response.read(MAX_ANSWER_BYTES)
            if response.read(1):
                response.close()
            else:
                response.release_conn()
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            # str(exc) of a connection error quotes the URL, path and query included: name the type only.
            raise NotifyError(f"POST {self.target}: {type(exc).__name__}") from None
        if 200 <= response.status < 300:
            return
        retry_after = parse_retry_after(response.headers.get("Retry-After"))
        raise NotifyError(f"POST {self.target}: HTTP {response.status}", retry_after=retry_after)

    def close(self) -> None:
        self._pool.clear()


class NotifySink:
    """A sink that posts one message per record: filtered, rate limited, each record id at most once.
    Subclasses give `render(record)`: the body and its headers."""

    name = "notify"

    def __init__(self, url: str, filter: Filter, rate_limit: float, state_dir: str | None,
                 clock: Callable[[], float] = time.time) -> None:
        self.filter = filter
        self.clock = clock
        self._poster = Poster(url)
        self._rate = RateLimit(rate_limit)
        self.sent = SentIds(state_dir, self.name)

    def render(self, record: Record) -> tuple[bytes, Mapping[str, str]]:
        raise NotImplementedError

    def send(self, records: Sequence[Record]) -> None:
        for record in records:
            if not self.filter.matches(record) or record.id in self.sent:
                continue
            try:
                body, headers = self.render(record)
            except SinkError as exc:
                # Rendering is deterministic: retrying would block every later record behind this one.
                log.error("sink %s: record %s skipped: %s", self.name, record.id, exc)
                continue
            self._rate.wait()
            self._poster.post(body, headers)
            self.sent.add(record.id)

    def close(self) -> None:
        self._poster.close()
        self.sent.close()


# --- what a message says ---------------------------------------------------------------------------------
def event_of(record: Record) -> Mapping[str, Any]:
    event = record.data.get("event", {})
    return event if isinstance(event, Mapping) else {}


def when(record: Record, now: float) -> str:
    """`2022-04-11 22:26 UTC (in 14 min)`, or `not set` for an event without NotBefore."""
    from datetime import datetime, timezone

    not_before = record.data.get("not_before")
    if not not_before:
        return "not set (now or already running)"
    moment = datetime.fromisoformat(str(not_before).replace("Z", "+00:00")).astimezone(timezone.utc)
    minutes = round((moment.timestamp() - now) / 60)
    relative = ("now" if minutes == 0 else f"in {_span(minutes)}" if minutes > 0 else f"{_span(-minutes)} ago")
    return f"{moment:%Y-%m-%d %H:%M} UTC ({relative})"


def _span(minutes: int) -> str:
    if minutes < 120:
        return f"{minutes} min"
    if minutes < 48 * 60:
        return f"{minutes // 60} h {minutes % 60} min"
    return f"{minutes // (24 * 60)} days"


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def listed(items: Iterable[Any], limit: int) -> str:
    """`vm-0, vm-1 … and 498 more` within `limit` characters."""
    names = [str(item) for item in items]
    shown_names: list[str] = []
    for index, name in enumerate(names):
        rest = len(names) - index
        candidate = ", ".join([*shown_names, name])
        if len(candidate) + len(f" … and {rest} more") > limit:
            return ", ".join(shown_names) + f" … and {rest} more"
        shown_names.append(name)
    return ", ".join(shown_names) or "none"


def node_facts(record: Record) -> list[tuple[str, str]]:
    """The facts a message adds for a node action or a drain step: the node, and what happened."""
    data = record.data
    if data.get("change") == DRAIN:
        facts = [("Node", str(data.get("node", "?"))), ("Drain", str(data.get("phase", "?")))]
        blocked = data.get("blocked") or []
        if blocked:
            facts.append(("Blocked", listed((f"{b.get('pod')} (PDB {b.get('budget')})" for b in blocked), 1900)))
        if "evicted_count" in data:
            facts.append(("Evicted", f"{data['evicted_count']} pod(s) in {data.get('seconds', '?')} s"))
        if data.get("pod"):
            facts.append(("Pod", f"{data['pod']} (grace {data.get('grace', '?')} s)"))
        return facts
    if data.get("change") == NODE_ACTION:
        action = f"{data.get('action', '?')}: {data.get('result', '?')}"
        return [("Node", str(data.get("node", "?"))), ("Action", action)]
    return []


def headline(record: Record) -> str:
    """`Reboot scheduled for vm-0`, `Freeze started on vm-0`, `Redeploy approved on vm-0`, ..."""
    event = event_of(record)
    change = str(record.data.get("change", ""))
    vm = record.data.get("vm", {}).get("name") or "this VM"
    kind = event.get("EventType") or "Maintenance"
    status = event.get("EventStatus") or ""
    if change == DRAIN:
        phase = str(record.data.get("phase", ""))
        return f"{kind}: drain of node {record.data.get('node', '?')} {_DRAIN_WORDS.get(phase, phase)}"
    if change == NODE_ACTION:
        return (f"{kind}: {record.data.get('action', '?')} {record.data.get('result', '?')} on node "
                f"{record.data.get('node', '?')}")
    if change == APPROVED:
        return f"{kind} approved on {vm}" + (" (dry run)" if record.data.get("dry_run") else "")
    if change == str(ChangeKind.REMOVED):
        return f"{kind} over ({record.data.get('outcome', 'ended')}) on {vm}"
    if status == "Started":
        return f"{kind} started on {vm}"
    return f"{kind} scheduled on {vm}" if record.data.get("affects_this_vm") else f"{kind} scheduled near {vm}"
