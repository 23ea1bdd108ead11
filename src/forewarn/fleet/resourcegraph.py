"""Azure Resource Graph as a source for fleet mode: every row of one query, across its pages and
subscription batches, read over deadline-bound HTTPS.

Facts this relies on (shared FLEET-FACTS.md, §1 and §1a):
- `POST {arm}/providers/Microsoft.ResourceGraph/resources?api-version=2024-04-01` with the scopes
  (`subscriptions` or `managementGroups`), the KQL `query` and `options`; the reply is
  `{totalRecords, count, resultTruncated, $skipToken?, data}`; the next page is the same request with
  `options.$skipToken`; a page holds at most 1000 rows;
- pages come back in a stable order only when the projection keeps `id`;
- replies carry `x-ms-user-quota-remaining` (an integer) and `x-ms-user-quota-resets-after` (hh:mm:ss);
  an exhausted quota is answered with 429 and Retry-After; the docs recommend batches of fewer than 300
  subscriptions over one query per subscription;
- scheduled events live in `maintenanceresources` as type `microsoft.maintenance/scheduledevents`
  (a preview, opt-in per VM, scale set or availability set).

Why not azure-mgmt-resourcegraph: azure-core's default transport reads a whole reply into memory and may
wait 300 s for it. Here each request has one deadline for the whole exchange, a size cap and the stop
signal (forewarn.deadline), as IMDS requests have; the bearer token still comes from an azure-identity
credential. Scheduled-event fields are not read here: rows go to the fleet feed as they came.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

from forewarn.deadline import Deadline, Stopped
from forewarn.fleet.arm import ArmConnection, ArmError, TokenCredential, Tokens, arm_base, tls_context
from forewarn.imds.reply import ReplyError, capped, decode_reply
from forewarn.retry import Backoff, parse_retry_after

__all__ = [
    "ALL_STATUSES", "DEFAULT_API_VERSION", "DEFAULT_ARM_ENDPOINT", "DEFAULT_QUERY", "OPEN_STATUSES",
    "ResourceGraphClient", "ResourceGraphError", "Snapshot", "Stopped", "parse_resets_after",
    "scheduled_events_query",
]

log = logging.getLogger(__name__)

DEFAULT_ARM_ENDPOINT = "https://management.azure.com"
DEFAULT_API_VERSION = "2024-04-01"
RESOURCES_PATH = "/providers/Microsoft.ResourceGraph/resources"

#: Subscriptions per query. The docs recommend fewer than 300; 100 keeps each query's result small while
#: 1,000 subscriptions still cost only 10 queries of the documented example quota (15 per 5 s).
DEFAULT_BATCH_SIZE = 100
#: Rows per page: the most Resource Graph gives in one page.
MAX_PAGE_SIZE = 1000
#: A page of 1000 rows at 16 KiB each (a scale-set event lists every instance name in Resources).
DEFAULT_MAX_REPLY_BYTES = 16 * 2**20
#: More rows than this in one snapshot is a runaway query (or a peer that pages forever), not a fleet.
DEFAULT_MAX_ROWS = 100_000
#: When the quota is spent and the reply does not say when it returns: the documented example's window.
QUOTA_WINDOW_GUESS = 5.0

OPEN_STATUSES = ("Scheduled", "Started")
#: Completed and Canceled exist only in the central feeds (IMDS drops a finished event instead).
ALL_STATUSES = ("Scheduled", "Started", "Completed", "Canceled")


#: What a resource group name may hold in the query: ARM's characters for one (letters, digits, `_ . - ( )`).
#: None of them can end a KQL string literal, so a name goes into the query between double quotes as it is.
_RESOURCE_GROUP = re.compile(r"[\w.()-]{1,90}")


def scheduled_events_query(statuses: Sequence[str] | None = OPEN_STATUSES, resource_groups: Sequence[str] = ()) -> str:
    """KQL for the scheduled-event rows with one of `statuses` (None: every status, history included), in one of
    `resource_groups` when given (compared without regard to case, as ARM compares them).

    A scheduled event's row carries the resource group of the VM, scale set or availability set it is on (its
    ID is an extension of theirs), so the filter keeps the events of the VMs in those resource groups.
    The projection keeps `id` because paging needs it, and `properties` whole, so the feed reads the same
    PascalCase fields IMDS documents carry (EventId, EventType, EventStatus, NotBefore, Resources, ...),
    typed as Resource Graph stores them, and fields not documented yet pass through.
    """
    lines = ["maintenanceresources", '| where type =~ "microsoft.maintenance/scheduledevents"']
    if isinstance(resource_groups, str) or not all(
            isinstance(g, str) and _RESOURCE_GROUP.fullmatch(g) for g in resource_groups):
        raise ValueError(f"resource_groups must be a list of resource group names (letters, digits, _ . - ( ), up "
                         f"to 90); got {resource_groups!r}")
    if resource_groups:
        groups = ", ".join(f'"{group}"' for group in dict.fromkeys(resource_groups))
        lines.append(f"| where resourceGroup in~ ({groups})")
    if statuses is not None:
        if not statuses or not all(isinstance(s, str) and re.fullmatch(r"[A-Za-z]+", s) for s in statuses):
            raise ValueError(f"statuses must be event status words such as {', '.join(ALL_STATUSES)}; "
                             f"got {list(statuses)!r}")
        wanted = ", ".join(f'"{status}"' for status in statuses)
        lines.append(f"| where tostring(properties.EventStatus) in~ ({wanted})")
    lines += ["| project id, name, subscriptionId, resourceGroup, location, properties", "| order by id asc"]
    return "\n".join(lines)


#: The open events (Scheduled, Started): what a fleet poll needs to see what is coming.
DEFAULT_QUERY = scheduled_events_query()


class ResourceGraphError(ArmError):
    """A query that gave no usable answer. `status` is the HTTP status, or None when there was none
    (transport, deadline, a reply that is too large or not the documented shape). Messages name the
    endpoint and status, never the token."""


@dataclass(frozen=True)
class Snapshot:
    """Every row one query gave (or what `convert` made of each), and how getting them went."""

    rows: tuple[Any, ...]
    #: Pages read (a page is one 200 answer), and HTTP requests sent (retries included).
    pages: int
    requests: int
    #: Queries, one per batch of scopes.
    batches: int
    seconds: float
    #: 429 answers, and waits for a spent quota before a request.
    throttled: int
    quota_waits: int
    #: The last reply's x-ms-user-quota-remaining and x-ms-user-quota-resets-after (seconds), if sent.
    quota_remaining: int | None
    quota_resets_after: float | None
    #: The sum of each batch's totalRecords: differs from len(rows) when rows changed between pages.
    total_records: int
    warnings: tuple[str, ...] = ()
    #: Rows read, and rows that `convert` left out (returned None for).
    rows_read: int = 0
    left_out: int = 0


@dataclass
class _Tally:
    started: float = field(default_factory=time.monotonic)
    rows: list[Any] = field(default_factory=list)
    rows_read: int = 0
    left_out: int = 0
    pages: int = 0
    requests: int = 0
    batches: int = 0
    throttled: int = 0
    quota_waits: int = 0
    total_records: int = 0
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Page:
    rows: list[dict[str, Any]]
    total_records: int
    truncated: bool
    skip_token: str | None


_RESETS_AFTER = re.compile(r"(?:(\d+)\.)?(\d+):(\d{1,2}):(\d{1,2}(?:\.\d+)?)")


def parse_resets_after(value: str | None) -> float | None:
    """x-ms-user-quota-resets-after ("hh:mm:ss", also "d.hh:mm:ss.fff" as .NET writes a TimeSpan) in
    seconds, or None when absent or unreadable."""
    match = _RESETS_AFTER.fullmatch(value.strip()) if value else None
    if match is None:
        return None
    days, hours, minutes, seconds = match.groups()
    return int(days or 0) * 86400 + int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def _parse_quota_remaining(value: str | None) -> int | None:
    try:
        return int(value.strip()) if value else None
    except ValueError:
        return None


def _printable(text: str) -> str:
    return "".join(ch if ch.isprintable() else " " for ch in text)


class ResourceGraphClient:
    """Runs Resource Graph queries for fleet mode. One snapshot at a time (a lock keeps them in turn).

    - `arm_endpoint`: ARM's base URL (https only: the request carries a bearer token); the token's scope
      is `{arm_endpoint}/.default`.
    - `credential`: an azure-identity credential (anything with azure-core's `get_token`).
    - `timeout`: seconds each request may take in all, however the bytes arrive; `token_timeout` the same
      for getting a token.
    - `max_reply_bytes`: the largest page read; a longer reply is an error and its connection is dropped.
    - `batch_size`: subscriptions (or management groups) per query; `page_size`: rows per page (<= 1000).
    - `attempts`: tries per request when ARM answers 429 or 5xx; each wait is the reply's Retry-After (or
      backoff), at most `max_wait`, which also bounds a wait for a spent quota.
    - `stop`: once set, any wait (a reply, a token, a Retry-After) ends within 0.25 s with `Stopped`.
    - `context`: TLS trust (default: `default_tls_context()`).
    - `loopback_http`: allow a plain `http://` loopback IP base (the simulated fleet only; `arm_base`).
    Transport failures and deadlines are not retried within a snapshot: the caller's next one is the retry.
    """

    def __init__(self, arm_endpoint: str, credential: TokenCredential, *, api_version: str = DEFAULT_API_VERSION,
                 timeout: float = 30.0, token_timeout: float = 60.0,
                 max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES, batch_size: int = DEFAULT_BATCH_SIZE,
                 page_size: int = MAX_PAGE_SIZE, attempts: int = 4, max_wait: float = 60.0,
                 max_rows: int = DEFAULT_MAX_ROWS, stop: threading.Event | None = None,
                 context: ssl.SSLContext | None = None, loopback_http: bool = False) -> None:
        self.endpoint, self.host, self.port = arm_base(arm_endpoint, loopback_http)
        if not 1 <= page_size <= MAX_PAGE_SIZE:
            raise ValueError(f"page_size must be 1 to {MAX_PAGE_SIZE}; got {page_size}")
        if not 1 <= batch_size <= 1000:
            raise ValueError(f"batch_size must be 1 to 1000 (the docs recommend fewer than 300); got {batch_size}")
        if attempts < 1 or timeout <= 0 or token_timeout <= 0 or max_wait < 0 or max_reply_bytes < 1 or max_rows < 1:
            raise ValueError("attempts, timeout, token_timeout, max_reply_bytes and max_rows must be positive, "
                             "max_wait not negative")
        self.api_version = api_version
        self.scope = f"{self.endpoint}/.default"
        self.timeout = timeout
        self.max_reply_bytes = max_reply_bytes
        self.batch_size = batch_size
        self.page_size = page_size
        self.attempts = attempts
        self.max_wait = max_wait
        self.max_rows = max_rows
        self.stop = stop
        self.context = tls_context(self.endpoint, context)
        self._target = f"{RESOURCES_PATH}?{urlencode({'api-version': api_version})}"
        self._what = f"Resource Graph {self.endpoint}{RESOURCES_PATH}"
        self._tokens = Tokens(credential, self.scope, token_timeout, ResourceGraphError)
        self._backoff = Backoff(base=1.0, cap=max(max_wait, 0.001))
        self._wire = ArmConnection(self.host, self.port, self.context, timeout, max_reply_bytes, self._too_large)
        self._lock = threading.Lock()
        self._quota_remaining: int | None = None
        self._quota_resets_after: float | None = None
        #: When a spent quota returns (monotonic), so the next request waits for it, in this snapshot or the next.
        self._quota_back_at: float | None = None

    def close(self) -> None:
        with self._lock:
            self._wire.close()

    # --- the query ---------------------------------------------------------------------------------------
    def snapshot(self, subscriptions: Sequence[str] | None = None, management_groups: Sequence[str] | None = None,
                 query: str = DEFAULT_QUERY, convert: Callable[[dict[str, Any]], Any] | None = None) -> Snapshot:
        """Every row `query` gives in the given subscriptions or management groups (one of them), across all
        pages and batches. Raises ResourceGraphError when any page cannot be had, Stopped on the stop signal.

        `convert`, when given, turns each row into what `Snapshot.rows` holds as soon as its page is read (None
        leaves the row out, counted in `left_out`): a page's decoded JSON is gone before the next page is asked
        for, so a snapshot never holds more than one page of rows beside what they became."""
        if (subscriptions is None) == (management_groups is None):
            raise ValueError("give subscriptions or management_groups (one of them)")
        scope_key, given = (("subscriptions", subscriptions) if subscriptions is not None
                            else ("managementGroups", management_groups))
        assert given is not None
        if isinstance(given, str):
            raise ValueError(f"{scope_key} must be a list of ids, not one string")
        scopes = list(dict.fromkeys(given))  # a scope twice would bring its rows twice
        if not scopes or not all(isinstance(s, str) and s.strip() for s in scopes):
            raise ValueError(f"{scope_key} must be a non-empty list of non-empty ids; got {list(given)!r}")
        if not isinstance(query, str) or not query.strip():
            raise ValueError("query must be non-empty KQL")
        with self._lock:
            tally = _Tally()
            for start in range(0, len(scopes), self.batch_size):
                self._query({scope_key: scopes[start:start + self.batch_size]}, query, tally, convert)
            return Snapshot(rows=tuple(tally.rows), pages=tally.pages, requests=tally.requests,
                            batches=tally.batches, seconds=time.monotonic() - tally.started,
                            throttled=tally.throttled, quota_waits=tally.quota_waits,
                            quota_remaining=self._quota_remaining, quota_resets_after=self._quota_resets_after,
                            total_records=tally.total_records, warnings=capped(tally.warnings),
                            rows_read=tally.rows_read, left_out=tally.left_out)

    def _query(self, scopes: dict[str, list[str]], query: str, tally: _Tally,
               convert: Callable[[dict[str, Any]], Any] | None) -> None:
        """All pages of one batch."""
        tally.batches += 1
        which = f"batch {tally.batches}"
        skip_token: str | None = None
        seen: set[str] = set()
        while True:
            options: dict[str, Any] = {"$top": self.page_size, "resultFormat": "objectArray"}
            if skip_token is not None:
                options["$skipToken"] = skip_token
            page = self._page(json.dumps({**scopes, "query": query, "options": options}).encode(), tally)
            if skip_token is None:
                tally.total_records += page.total_records
            tally.pages += 1
            tally.rows_read += len(page.rows)
            if tally.rows_read > self.max_rows:
                raise ResourceGraphError(f"{self._what}: more than {self.max_rows} rows (max_rows); narrow the query")
            if convert is None:
                tally.rows.extend(page.rows)
            else:
                for row in page.rows:
                    item = convert(row)
                    if item is None:
                        tally.left_out += 1
                    else:
                        tally.rows.append(item)
            truncated, next_token = page.truncated, page.skip_token
            del page  # its rows, before the next page is read
            if next_token is None:
                if truncated:
                    tally.warnings.append(
                        f"{which}: resultTruncated is true without a $skipToken: rows are missing (a query "
                        "whose projection drops id cannot be paged)")
                return
            if next_token in seen:
                raise ResourceGraphError(f"{self._what}: the same $skipToken came back twice ({which}); "
                                         "paging would not end")
            seen.add(next_token)
            skip_token = next_token

    def _page(self, payload: bytes, tally: _Tally) -> _Page:
        """One page: the request sent (and sent again after 429 or 5xx) until it gives one."""
        renewed = False
        attempt = 0
        while True:
            self._wait_for_quota(tally)
            bearer = self._tokens.bearer(self.stop)
            deadline = Deadline(self.timeout, self.stop)
            tally.requests += 1
            try:
                status, headers, body = self._send(payload, bearer, deadline)
            except TimeoutError:
                raise ResourceGraphError(f"{self._what}: no complete answer within {self.timeout:g} s",
                                         retryable=True) from None
            except (OSError, http.client.HTTPException) as exc:
                reason = str(exc) or type(exc).__name__
                raise ResourceGraphError(f"{self._what}: connection failed ({reason[:200]})", retryable=True) from None
            self._note_quota(headers)
            if status == 200:
                return self._decode(body, tally)
            if status == 401 and not renewed:
                # The token may have been revoked or rotated early: ask for a new one, once.
                renewed = True
                self._tokens.forget()
                continue
            if status == 429:
                tally.throttled += 1
            retry_after = parse_retry_after(headers.get("retry-after"))
            if status == 429 and retry_after is None:
                retry_after = parse_resets_after(headers.get("x-ms-user-quota-resets-after"))
            retryable = status == 429 or status >= 500
            attempt += 1
            if not retryable or attempt >= self.attempts:
                raise self._status_error(status, body, headers, retryable, retry_after, attempt)
            wait = min(retry_after if retry_after is not None else self._backoff.delay(attempt - 1), self.max_wait)
            log.warning("%s: HTTP %d, trying again in %.1f s (attempt %d of %d)", self._what, status, wait,
                        attempt + 1, self.attempts)
            self._sleep(wait)

    def _status_error(self, status: int, body: bytes, headers: dict[str, str], retryable: bool,
                      retry_after: float | None, attempts: int) -> ResourceGraphError:
        """ARM explains itself in {"error": {"code", "message"}}; the start of that, made printable."""
        snippet = _printable(body[:300].decode("utf-8", "replace").strip())
        request_id = _printable(headers.get("x-ms-request-id", "")[:64])
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        return ResourceGraphError(
            f"{self._what}: HTTP {status}{tries}" + (f" ({snippet})" if snippet else "")
            + (f" [x-ms-request-id {request_id}]" if request_id else ""),
            status=status, retryable=retryable, retry_after=retry_after)

    # --- waits -------------------------------------------------------------------------------------------
    def _sleep(self, seconds: float) -> None:
        if self.stop is None:
            time.sleep(seconds)
        elif self.stop.wait(seconds):
            raise Stopped()

    def _note_quota(self, headers: dict[str, str]) -> None:
        remaining = _parse_quota_remaining(headers.get("x-ms-user-quota-remaining"))
        resets_after = parse_resets_after(headers.get("x-ms-user-quota-resets-after"))
        if remaining is None and resets_after is None:
            return
        self._quota_remaining, self._quota_resets_after = remaining, resets_after
        if remaining is not None and remaining <= 0:
            back_in = resets_after if resets_after is not None else QUOTA_WINDOW_GUESS
            self._quota_back_at = time.monotonic() + back_in

    def _wait_for_quota(self, tally: _Tally) -> None:
        """A spent quota would answer the next request with 429: wait until it returns (at most max_wait)."""
        if self._quota_back_at is None:
            return
        wait = min(self._quota_back_at - time.monotonic(), self.max_wait)
        self._quota_back_at = None
        if wait > 0:
            tally.quota_waits += 1
            log.info("%s: query quota spent; waiting %.1f s for it to return", self._what, wait)
            self._sleep(wait)

    # --- the wire ----------------------------------------------------------------------------------------
    def _send(self, payload: bytes, bearer: str, deadline: Deadline) -> tuple[int, dict[str, str], bytes]:
        headers = {"Authorization": f"Bearer {bearer}", "Content-Type": "application/json",
                   "x-ms-client-request-id": str(uuid.uuid4())}
        return self._wire.send("POST", self._target, payload, headers, deadline)

    def _too_large(self) -> ResourceGraphError:
        return ResourceGraphError(f"{self._what}: reply larger than {self.max_reply_bytes} bytes (max_reply_bytes); "
                                  "connection dropped; a smaller page_size keeps pages smaller")

    def _decode(self, body: bytes, tally: _Tally) -> _Page:
        """A 200 reply as a page, or ResourceGraphError when it is not the documented shape."""
        def refuse(why: str) -> ResourceGraphError:
            return ResourceGraphError(f"{self._what}: {why}", status=200)

        try:
            value, warnings = decode_reply(body)
        except ReplyError as exc:
            raise refuse(str(exc)) from None
        if not isinstance(value, dict):
            raise refuse("reply is not a JSON object")
        data = value.get("data")
        if not isinstance(data, list):
            raise refuse("reply has no data array (resultFormat objectArray was asked for)")
        for index, row in enumerate(data):
            if not isinstance(row, dict):
                raise refuse(f"data[{index}] is a {type(row).__name__}, not an object")
        counts: dict[str, int] = {}
        for name in ("totalRecords", "count"):
            number = value.get(name)
            if isinstance(number, bool) or not isinstance(number, int) or number < 0:
                raise refuse(f"{name} is {number!r}, not a count")
            counts[name] = number
        truncated = value.get("resultTruncated")
        if isinstance(truncated, str) and truncated.lower() in ("true", "false"):
            truncated = truncated.lower() == "true"
        if not isinstance(truncated, bool):
            raise refuse(f'resultTruncated is {truncated!r}, not "true" or "false"')
        skip_token = value.get("$skipToken")
        if skip_token is not None and not isinstance(skip_token, str):
            raise refuse(f"$skipToken is a {type(skip_token).__name__}, not a string")
        if counts["count"] != len(data):
            tally.warnings.append(f"page {tally.pages + 1}: count is {counts['count']} but data holds {len(data)} rows")
        tally.warnings.extend(f"page {tally.pages + 1}: {warning}" for warning in warnings)
        return _Page(rows=data, total_records=counts["totalRecords"], truncated=truncated,
                     skip_token=skip_token or None)
