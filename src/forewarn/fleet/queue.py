"""The Storage queue that an Event Grid subscription fills with the fleet's Scheduled Events.

One `QueueSource` reads one queue with the `azure-storage-queue` client and hands each message on as a
`Delivery`: the message's handle and what `feed.parse_queue_message` found in it. Nothing leaves the queue
until the caller says its change is safe:

    for delivery in source.poll(stop):
        commit(delivery.events)          # tracker, outbox: one transaction
        source.delete(delivery)          # only now is the message gone

A receive hides a message for `visibility_timeout` seconds instead of removing it, so a process that dies
between receive and delete sees the message again when the timeout ends (the tracker drops the repeat by
its Event Grid id). A message that cannot be read is no one's change: it is counted, its reason logged
once, and it is moved aside to `<queue>-poison` with its text unchanged, the convention Azure Functions
uses for Storage queues. Azure outages (refused connections, timeouts, 5xx, throttling, missing rights)
never raise out of `poll`: they become the source's `QueueStats.state`, logged when they start and end,
and the next receive waits a backoff that the stop signal cuts short.

Connecting: a queue URL with an Azure AD credential (a managed identity, or whatever
DefaultAzureCredential finds; a SAS in the URL works too), or a connection string and a queue name. The
connection string comes from `FOREWARN_QUEUE_CONNECTION_STRING` or a file, never a flag (command lines are
visible to every user through `ps`), and it is never logged: logs and errors name the queue URL without
its query or user info. Rights: reading needs "Storage Queue Data Message Processor"; moving messages
aside also needs to send to the poison queue (and to create it, unless it exists), which "Storage Queue
Data Contributor" grants. Without them a bad message stays where it is and is counted, never lost.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Literal
from urllib.parse import urlsplit

from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    ResourceExistsError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.storage.queue import QueueClient, QueueMessage

from forewarn import __version__
from forewarn.config import ConfigError, read_text_file, redact_url
from forewarn.fleet.feed import FeedError, FeedResult, FleetEvent, parse_queue_message
from forewarn.logs import StateLog, escape_controls, redact_secrets
from forewarn.retry import Backoff, RetryableError

log = logging.getLogger(__name__)

CONNECTION_STRING_ENV = "FOREWARN_QUEUE_CONNECTION_STRING"
POISON_SUFFIX = "-poison"
#: Storage queue names are 3-63 lowercase letters, digits and single hyphens.
_QUEUE_NAME = re.compile(r"[a-z0-9](?:[a-z0-9]|-(?!-)){1,61}[a-z0-9]")
#: Most messages one receive may return, and the longest visibility timeout (7 days), per the Queue service.
MAX_MESSAGES_PER_RECEIVE = 32
MAX_VISIBILITY_TIMEOUT = 7 * 24 * 3600
#: Deletes of one receive sent at once. Each is one request; a few in flight overlap the Queue service's work
#: with the client's own (the GIL keeps the client's part serial anyway).
DELETE_CONCURRENCY = 4
#: Distinct parse-failure reasons remembered, so each is logged once without unbounded memory.
MAX_REASONS_REMEMBERED = 256

State = Literal["unknown", "ok", "unavailable"]


@dataclass(frozen=True)
class QueueOptions:
    """How the source talks to the queue. Every wait is bounded: `connection_timeout` and `read_timeout`
    bound each HTTP exchange on the client (seconds), `operation_timeout` is the Queue service's own
    server-side limit (whole seconds), and the SDK's retries are off, because the source retries itself
    with a backoff the stop signal can end."""

    #: Seconds a received message stays hidden: the time the caller has to commit and delete it. A
    #: message whose caller died comes back after this long.
    visibility_timeout: int = 60
    #: Seconds between receives while the queue is empty.
    poll_interval: float = 2.0
    #: Longest wait between receives while the queue is unavailable.
    max_backoff: float = 30.0
    connection_timeout: float = 5.0
    read_timeout: float = 10.0
    operation_timeout: int = 10
    max_messages: int = MAX_MESSAGES_PER_RECEIVE
    #: Deliveries after which an unreadable message that could not be moved aside is hidden for
    #: `stranded_visibility` seconds instead of `visibility_timeout`: it is left, counted, and looked at
    #: again rarely.
    max_dequeue: int = 5
    stranded_visibility: int = 3600
    #: Where unreadable messages go; None for `<queue>-poison`.
    poison_queue: str | None = None

    def __post_init__(self) -> None:
        checks = (
            ("visibility_timeout", 1 <= self.visibility_timeout <= MAX_VISIBILITY_TIMEOUT,
             f"1 to {MAX_VISIBILITY_TIMEOUT} seconds"),
            ("poll_interval", 0.1 <= self.poll_interval <= 3600, "0.1 to 3600 seconds"),
            ("max_backoff", self.poll_interval <= self.max_backoff <= 3600, "poll_interval to 3600 seconds"),
            ("connection_timeout", 0.1 <= self.connection_timeout <= 300, "0.1 to 300 seconds"),
            ("read_timeout", 0.1 <= self.read_timeout <= 300, "0.1 to 300 seconds"),
            ("operation_timeout", 1 <= self.operation_timeout <= 300, "1 to 300 seconds"),
            ("max_messages", 1 <= self.max_messages <= MAX_MESSAGES_PER_RECEIVE,
             f"1 to {MAX_MESSAGES_PER_RECEIVE}"),
            ("max_dequeue", 1 <= self.max_dequeue <= 1000, "1 to 1000"),
            ("stranded_visibility", 1 <= self.stranded_visibility <= MAX_VISIBILITY_TIMEOUT,
             f"1 to {MAX_VISIBILITY_TIMEOUT} seconds"),
        )
        for name, valid, what in checks:
            if not valid:
                raise ConfigError(f"queue {name} {getattr(self, name)!r} is out of range: {what}")


@dataclass(frozen=True)
class Delivery:
    """One received message: what it held, and the handle `QueueSource.delete` needs. A message with no
    scheduled event (only events of other kinds, `skipped`) is a delivery too, with nothing to commit: it
    is deleted like any other once the caller has looked at it."""

    message_id: str
    pop_receipt: str
    dequeue_count: int
    result: FeedResult

    @property
    def events(self) -> tuple[FleetEvent, ...]:
        return self.result.events

    @property
    def skipped(self) -> int:
        return self.result.skipped

    @property
    def warnings(self) -> tuple[str, ...]:
        return self.result.warnings


@dataclass(frozen=True)
class QueueStats:
    """What the source has done, for the metrics: replaced whole on every change, so a reader on another
    thread always sees one consistent value. Times are Unix seconds."""

    state: State = "unknown"
    #: Why the queue is unavailable (a short fixed label: unreachable, timeout, throttled, server_error,
    #: denied, not_found, client_error, error), or None.
    reason: str | None = None
    error: str | None = None
    #: Messages received, unreadable ones included, and messages deleted after the caller's commit.
    received: int = 0
    deleted: int = 0
    #: Deletes that failed: the message comes back after its visibility timeout and is delivered again.
    delete_failures: int = 0
    parse_failures: int = 0
    poisoned: int = 0
    #: Moves aside that failed (the message stays in the queue), and messages left after max_dequeue.
    poison_failures: int = 0
    stranded: int = 0
    last_success: float | None = None
    consecutive_failures: int = 0


class QueueUnavailable(RetryableError):
    """The queue could not be reached or refused a call. `reason` is a short fixed label for metrics; the
    message names the queue by its URL without query or user info and never holds a secret."""

    def __init__(self, queue: str, detail: str, reason: str, retryable: bool) -> None:
        super().__init__(f"queue {queue}: {detail}", retryable=retryable)
        self.detail = detail
        self.reason = reason


def connection_string_from(path: str | None = None, environ: Mapping[str, str] | None = None,
                           flag: str = "--queue-connection-string-file") -> str | None:
    """The connection string from `FOREWARN_QUEUE_CONNECTION_STRING`, else from the file at `path` (as
    the agent's other secrets: the variable wins), else None. ConfigError names the file, never its text."""
    environ = os.environ if environ is None else environ
    value = environ.get(CONNECTION_STRING_ENV, "").strip()
    if value:
        return value
    if path:
        value = read_text_file(path, flag, secret=True).strip()
        if not value:
            raise ConfigError(f"{flag} {path}: the file is empty")
        return value
    return None


def _check_account_key(connection_string: str) -> None:
    """Refuse an AccountKey that is not base64 now, rather than failing every request later."""
    for part in connection_string.split(";"):
        name, _, value = part.partition("=")
        if name.strip().lower() == "accountkey":
            try:
                base64.b64decode(value.strip(), validate=True)
            except (binascii.Error, ValueError):
                raise ConfigError(f"the queue connection string ({CONNECTION_STRING_ENV} or its file) is not "
                                  "valid: its AccountKey is not base64") from None


def _secret_values(connection_string: str) -> list[str]:
    """The parts of a connection string that must never be shown: the account key and the SAS."""
    secrets = []
    for part in connection_string.split(";"):
        name, _, value = part.partition("=")
        if name.strip().lower() in ("accountkey", "sharedaccesssignature") and value.strip():
            secrets.append(value.strip())
    return secrets


class QueueSource:
    """Receives, deletes and moves aside the messages of one Storage queue. Used by one thread (`delete_all`
    runs its deletes on a small pool of its own and returns when they are done); `stats` may be read from any."""

    def __init__(self, client: QueueClient, poison: QueueClient, options: QueueOptions,
                 secrets: tuple[str, ...] = (), clock: Callable[[], float] = time.time) -> None:
        self._client = client
        self._poison = poison
        self.options = options
        self._secrets = tuple(secret for secret in secrets if secret)
        self._clock = clock
        self.url = self._shown_url(client.url)
        self.poison_url = self._shown_url(poison.url)
        self.stats = QueueStats()
        self._backoff = Backoff(base=options.poll_interval, cap=options.max_backoff)
        self._health = StateLog(log, f"queue {self.url}")
        self._deletes = StateLog(log, f"queue {self.url}: delete")
        self._moves = StateLog(log, f"poison queue {self.poison_url}")
        self._reasons: OrderedDict[str, None] = OrderedDict()
        self._last_count = 0
        # Deletes run on a small pool (delete_all): `stats` and the state logs change under this lock.
        self._lock = threading.RLock()
        self._pool: ThreadPoolExecutor | None = None

    # --- construction ----------------------------------------------------------------------------------

    @classmethod
    def from_connection_string(cls, connection_string: str, queue_name: str,
                               options: QueueOptions | None = None) -> QueueSource:
        options = options or QueueOptions()
        poison_name = _names(queue_name, options)
        secrets = tuple(_secret_values(connection_string))
        _check_account_key(connection_string)
        try:
            settings = _client_options(options, _endpoint(connection_string))
            client, poison = (QueueClient.from_connection_string(connection_string, name, **settings)
                              for name in (queue_name, poison_name))
        except (ValueError, TypeError, KeyError) as exc:
            detail = _scrubbed(str(exc), secrets)
            raise ConfigError(f"the queue connection string ({CONNECTION_STRING_ENV} or its file) is not valid: "
                              f"{detail}") from None
        return cls(client, poison, options, secrets=secrets)

    @classmethod
    def from_queue_url(cls, queue_url: str, credential: Any = None, client_id: str | None = None,
                       options: QueueOptions | None = None) -> QueueSource:
        """`queue_url` is `https://{account}.queue.core.windows.net/{queue}`, optionally with a SAS query.
        Without a SAS and without `credential`, a managed identity (`client_id` picks a user-assigned one)
        or DefaultAzureCredential signs the requests."""
        options = options or QueueOptions()
        try:
            parts = urlsplit(queue_url)
            segments = [segment for segment in parts.path.split("/") if segment]
        except ValueError:
            parts, segments = None, []
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or not segments:
            raise ConfigError(f"queue URL {redact_url(queue_url)} is not valid: expected "
                              "https://<account>.queue.core.windows.net/<queue>")
        queue_name = segments[-1]
        poison_name = _names(queue_name, options)
        sas = parts.query if "sig=" in parts.query else ""
        if credential is None and not sas:
            from azure.identity import DefaultAzureCredential, ManagedIdentityCredential

            credential = ManagedIdentityCredential(client_id=client_id) if client_id else DefaultAzureCredential()
        account_url = queue_url.split("?", 1)[0].rstrip("/")
        account_url = account_url[: -len(queue_name)].rstrip("/")
        secrets = tuple(part[4:] for part in sas.split("&") if part.startswith("sig="))
        try:
            client = QueueClient.from_queue_url(queue_url, credential=credential,
                                                **_client_options(options, account_url))
            poison = QueueClient(account_url + (f"?{sas}" if sas else ""), poison_name, credential=credential,
                                 **_client_options(options, account_url))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"queue URL {redact_url(queue_url)} is not valid: "
                              f"{_scrubbed(str(exc), secrets)}") from None
        return cls(client, poison, options, secrets=secrets)

    # --- the loop's side -------------------------------------------------------------------------------

    def poll(self, stop: threading.Event, max_messages: int | None = None) -> list[Delivery]:
        """One receive. When it brought nothing, or the queue is unavailable, waits before returning (the
        poll interval, or the backoff) unless `stop` is set first. Never raises for Azure's failures:
        they are in `stats`."""
        if stop.is_set():
            return []
        try:
            deliveries = self.receive(max_messages)
        except QueueUnavailable:
            stop.wait(self._backoff.delay(self.stats.consecutive_failures - 1))
            return []
        if self._last_count == 0:
            stop.wait(self.options.poll_interval)
        return deliveries

    def receive(self, max_messages: int | None = None) -> list[Delivery]:
        """Up to `max_messages` messages, each hidden for the visibility timeout until `delete`. Messages
        that cannot be read are moved aside here and not returned. Raises QueueUnavailable."""
        count = min(max_messages or self.options.max_messages, MAX_MESSAGES_PER_RECEIVE)
        opts = self.options
        try:
            pages = self._client.receive_messages(messages_per_page=count, max_messages=count,
                                                  visibility_timeout=opts.visibility_timeout,
                                                  timeout=opts.operation_timeout)
            # One page is one request: the iterator alone would ask again until the queue is empty.
            messages: list[QueueMessage] = list(next(pages.by_page(), []))
        except (AzureError, OSError) as exc:
            raise self._failed(exc, "receive") from None
        self._succeeded(received=len(messages))
        self._last_count = len(messages)
        deliveries = []
        for message in messages:
            text = message.content
            dequeue_count = int(message.dequeue_count or 1)
            try:
                result = parse_queue_message(text if isinstance(text, (str, bytes)) else str(text))
            except FeedError as exc:
                self._unreadable(message, str(exc), dequeue_count)
                continue
            deliveries.append(Delivery(message_id=str(message.id), pop_receipt=str(message.pop_receipt),
                                       dequeue_count=dequeue_count, result=result))
        return deliveries

    def delete(self, delivery: Delivery) -> bool:
        """Remove a delivered message: call it only once what the message held is committed. False when
        it could not be deleted (the queue is unavailable, or the visibility timeout ended first and the
        message was received again): it comes back and is delivered again, and the repeat changes nothing."""
        try:
            self._client.delete_message(delivery.message_id, delivery.pop_receipt,
                                        timeout=self.options.operation_timeout)
        except HttpResponseError as exc:
            with self._lock:
                if _status(exc) in (400, 404):  # MessageNotFound, PopReceiptMismatch: the lease was lost
                    self.stats = replace(self.stats, delete_failures=self.stats.delete_failures + 1)
                    self._deletes.failing("lost", f"message {delivery.message_id} was not deleted: its visibility "
                                          f"timeout ({self.options.visibility_timeout} s) ended before the delete; "
                                          "it will be delivered again")
                    return False
                self._delete_failed(exc)
            return False
        except (AzureError, OSError) as exc:
            with self._lock:
                self._delete_failed(exc)
            return False
        with self._lock:
            self._deletes.ok()
            self._succeeded(deleted=1)
        return True

    def delete_all(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """`delete` for each of `deliveries` (what one receive gave, now committed), up to
        DELETE_CONCURRENCY at once; returns when every one has succeeded or failed, in their order. A
        failed delete means what it means for `delete`: the message comes back and changes nothing."""
        if len(deliveries) <= 1:
            return [self.delete(delivery) for delivery in deliveries]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(DELETE_CONCURRENCY, thread_name_prefix="queue-delete")
        return list(self._pool.map(self.delete, deliveries))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for client in (self._client, self._poison):
            try:
                client.close()
            except Exception:  # closing must not fail a shutdown
                log.debug("closing a queue client failed", exc_info=True)

    # --- unreadable messages ---------------------------------------------------------------------------

    def _unreadable(self, message: QueueMessage, reason: str, dequeue_count: int) -> None:
        self.stats = replace(self.stats, parse_failures=self.stats.parse_failures + 1)
        key = re.sub(r"\d+", "#", reason)[:200]  # one log line per kind of reason, not per size or offset
        if key in self._reasons:
            self._reasons.move_to_end(key)
        else:
            self._reasons[key] = None
            if len(self._reasons) > MAX_REASONS_REMEMBERED:
                self._reasons.popitem(last=False)
            log.warning("queue %s: message %s cannot be read, moving it to %s (further messages failing "
                        "this way are only counted): %s", self.url, message.id, self.poison_url, reason)
        try:
            self._move_aside(message)
        except (AzureError, OSError) as exc:
            failure = self._unavailable(exc, "move aside")
            self._moves.failing(failure.reason, f"{failure.detail}; unreadable messages stay in {self.url}")
            self.stats = replace(self.stats, poison_failures=self.stats.poison_failures + 1)
            if dequeue_count >= self.options.max_dequeue:
                self._strand(message, dequeue_count)
            return
        self._moves.ok()
        self.stats = replace(self.stats, poisoned=self.stats.poisoned + 1)

    def _move_aside(self, message: QueueMessage) -> None:
        """Send the text unchanged to the poison queue (created on first need), then delete the original:
        in that order, so a failure between the two leaves a copy too many rather than none."""
        text = message.content
        timeout = self.options.operation_timeout
        try:
            self._poison.send_message(text, timeout=timeout)
        except ResourceNotFoundError:
            with contextlib.suppress(ResourceExistsError):  # another replica created it meanwhile
                self._poison.create_queue(timeout=timeout)
            self._poison.send_message(text, timeout=timeout)
        self._client.delete_message(message.id, message.pop_receipt, timeout=timeout)

    def _strand(self, message: QueueMessage, dequeue_count: int) -> None:
        """Leave the message, hidden for a long while, so it is neither lost nor read again every minute."""
        self.stats = replace(self.stats, stranded=self.stats.stranded + 1)
        log.warning("queue %s: unreadable message %s was delivered %d times and could not be moved aside; "
                    "left in the queue, hidden for %d s", self.url, message.id, dequeue_count,
                    self.options.stranded_visibility)
        # When this fails too, the message comes back after the visibility timeout and is counted again.
        with contextlib.suppress(AzureError, OSError):
            self._client.update_message(message.id, message.pop_receipt,
                                        visibility_timeout=self.options.stranded_visibility,
                                        timeout=self.options.operation_timeout)

    # --- health ----------------------------------------------------------------------------------------

    def _succeeded(self, received: int = 0, deleted: int = 0) -> None:
        with self._lock:
            self._health.ok()
            self.stats = replace(self.stats, state="ok", reason=None, error=None, consecutive_failures=0,
                                 received=self.stats.received + received, deleted=self.stats.deleted + deleted,
                                 last_success=self._clock())

    def _failed(self, exc: BaseException, doing: str) -> QueueUnavailable:
        failure = self._unavailable(exc, doing)
        with self._lock:
            self._health.failing(failure.reason, failure.detail)
            self.stats = replace(self.stats, state="unavailable", reason=failure.reason, error=str(failure),
                                 consecutive_failures=self.stats.consecutive_failures + 1)
        return failure

    def _delete_failed(self, exc: BaseException) -> None:
        self.stats = replace(self.stats, delete_failures=self.stats.delete_failures + 1)
        self._failed(exc, "delete")

    def _unavailable(self, exc: BaseException, doing: str) -> QueueUnavailable:
        reason, retryable, detail = _classify(exc)
        detail = _scrubbed(detail, self._secrets)
        return QueueUnavailable(self.url, f"{doing} failed: {detail}", reason, retryable)

    def _shown_url(self, url: str) -> str:
        return _scrubbed(redact_url(url), self._secrets)


def _names(queue_name: str, options: QueueOptions) -> str:
    """The poison queue's name, after checking both names against the Queue service's rules."""
    poison = options.poison_queue or queue_name + POISON_SUFFIX
    for what, name in (("queue name", queue_name), ("poison queue name", poison)):
        if not _QUEUE_NAME.fullmatch(name):
            raise ConfigError(f"{what} {name!r} is not valid: 3 to 63 lowercase letters, digits and single "
                              "hyphens, starting and ending with a letter or digit"
                              + (f" (the poison queue adds {POISON_SUFFIX!r})" if name.endswith(POISON_SUFFIX)
                                 and not options.poison_queue else ""))
    if poison == queue_name:
        raise ConfigError(f"the poison queue must differ from the queue {queue_name!r}")
    return poison


def _endpoint(connection_string: str) -> str:
    """The queue endpoint a connection string names (QueueEndpoint, else the account's public one), for the
    proxy settings; an empty string when it names neither (the SDK then refuses the string itself)."""
    parts = {name.strip().lower(): value.strip() for name, _, value in
             (part.partition("=") for part in connection_string.split(";"))}
    if parts.get("queueendpoint"):
        return parts["queueendpoint"]
    if parts.get("accountname"):
        return (f"{parts.get('defaultendpointsprotocol') or 'https'}://{parts['accountname']}.queue."
                f"{parts.get('endpointsuffix') or 'core.windows.net'}")
    return ""


def environment_settings(url: str) -> dict[str, Any]:
    """The proxy and CA settings `requests` would take from the environment for `url`, read once.

    `requests` reads them again on every request (HTTPS_PROXY, HTTP_PROXY, ALL_PROXY, NO_PROXY, each also in
    lower case, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE and ~/.netrc): scanning os.environ twice a request was
    12% of the client's CPU per queue message. The queue's host is fixed, so the answer is too: the clients
    are given it and stop looking (`use_env_settings=False`). A change to these variables takes a restart,
    as every other setting does."""
    from requests.utils import get_environ_proxies

    settings: dict[str, Any] = {"use_env_settings": False}
    proxies = get_environ_proxies(url) if url else {}
    if proxies:
        settings["proxies"] = dict(proxies)
    ca_bundle = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
    if ca_bundle:
        settings["connection_verify"] = ca_bundle
    return settings


def _client_options(options: QueueOptions, url: str = "") -> dict[str, Any]:
    # No message encode or decode policy: the SDK passes the text through, so feed.py sees the message as
    # Event Grid wrote it (base64) or as another writer put it (plain JSON), and detects which.
    return {
        "connection_timeout": options.connection_timeout,
        "read_timeout": options.read_timeout,
        "retry_total": 0,
        "retry_to_secondary": False,
        "user_agent": f"forewarn/{__version__}",
        **environment_settings(url),
    }


def _status(exc: BaseException) -> int | None:
    status = getattr(exc, "status_code", None)
    return status if isinstance(status, int) else None


def _classify(exc: BaseException) -> tuple[str, bool, str]:
    """(reason label, worth retrying soon, what happened) for a failed call."""
    if isinstance(exc, ClientAuthenticationError):
        status = _status(exc)
        return "denied", False, (f"HTTP {status} {_error_code(exc)}".rstrip() if status
                                 else f"the credential failed: {_first_line(exc)}")
    if isinstance(exc, HttpResponseError):
        status = _status(exc) or 0
        described = f"HTTP {status} {_error_code(exc)}".rstrip()
        if status in (429, 503):
            return "throttled", True, described
        if status == 408 or status >= 500:
            return "server_error", True, described
        if status in (401, 403):
            return "denied", False, described
        if status == 404:
            return "not_found", False, described + " (does the queue exist?)"
        return "client_error", False, described
    if isinstance(exc, ServiceResponseError):
        return "timeout", True, f"no complete reply ({_os_error(exc) or 'timed out or reset'})"
    if isinstance(exc, ServiceRequestError):
        cause = _os_error(exc)
        if cause and "timed out" in cause:
            return "timeout", True, f"cannot connect ({cause})"
        return "unreachable", True, f"cannot connect ({cause or _first_line(exc)})"
    if isinstance(exc, OSError):
        return "unreachable", True, exc.strerror or type(exc).__name__
    return "error", True, f"{type(exc).__name__}: {_first_line(exc)}"


def _error_code(exc: BaseException) -> str:
    code = getattr(exc, "error_code", None)
    return str(code) if code else ""


def _os_error(exc: BaseException) -> str | None:
    """The operating system's words for the failure deepest in the chain (`connection refused`, `timed
    out`), which say more than the SDK's wrapper."""
    seen: set[int] = set()
    found: str | None = None
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, TimeoutError) or "timed out" in str(current).lower():
            found = "timed out"
        elif isinstance(current, OSError) and current.strerror:
            found = current.strerror.lower()
        current = current.__cause__ or current.__context__ or getattr(current, "inner_exception", None)
    if found is None:
        text = str(exc).lower()
        for words in ("connection refused", "connection reset", "name or service not known", "timed out"):
            if words in text:
                return words
    return found


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def _scrubbed(text: str, secrets: tuple[str, ...] | list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "<redacted>")
    return escape_controls(redact_secrets(text))
