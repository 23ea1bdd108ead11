"""Azure Event Hubs sink: records in batches, one partition key per VM so each VM's records stay in order.

Authentication, in order of preference for production:
- `--eventhubs-namespace` + `--eventhubs-name` with Azure AD: a managed identity (`--eventhubs-client-id`
  picks a user-assigned one) or whatever DefaultAzureCredential finds;
- a connection string from `FOREWARN_EVENTHUBS_CONNECTION_STRING` or `--eventhubs-connection-string-file`
  (never from a flag: command lines are visible to every user through `ps`).

Each event body is the CloudEvents JSON (content type `application/cloudevents+json`); application
properties carry what consumers route on without parsing: record type, event type and status, event id
and VM name. The producer's own retries are kept short: the outbox worker retries, with backoff, forever.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any, cast

from azure.core.settings import settings as azure_settings
from azure.eventhub import EventData, EventDataBatch, EventHubProducerClient
from azure.eventhub.exceptions import EventHubError

from forewarn.metrics.codecs import CODECS
from forewarn.records import Record
from forewarn.sinks import SinkConfigError, SinkError, amqpwire

log = logging.getLogger(__name__)

CONTENT_TYPE = "application/cloudevents+json"
_SECRET = re.compile(r"(SharedAccessKey|SharedAccessSignature)=[^;]*", re.IGNORECASE)


def scrub(text: str) -> str:
    """Remove keys and signatures from anything that might echo a connection string."""
    return _SECRET.sub(r"\1=<redacted>", text)


def partition_key(record: Record) -> str:
    vm = record.data.get("vm", {})
    return str(vm.get("vm_id") or vm.get("name") or record.source)


def routing_properties(record: Record) -> dict[str, Any]:
    """The application properties of a record's event: what consumers route on without parsing the body."""
    data = record.data
    raw = data.get("event", {})
    return {
        "record_type": data["change"],
        "event_type": raw.get("EventType", ""),
        "event_status": raw.get("EventStatus", ""),
        "event_id": record.subject,
        "vm_name": data.get("vm", {}).get("name", ""),
        "affects_this_vm": bool(data.get("affects_this_vm", False)),
    }


def to_event(record: Record) -> EventData:
    event = EventData(record.to_json())
    event.content_type = CONTENT_TYPE
    event.properties = cast("dict[str | bytes, Any]", routing_properties(record))
    event.message_id = record.id
    return event


def encoded_event(prefix: bytes, record: Record) -> bytes | None:
    """The AMQP message `EventDataBatch.add` would make of `to_event(record)` in a batch whose events start with
    `prefix` (`amqpwire.prefix` of its partition key), or None where only the SDK encodes it (a property value
    that is neither a string nor a bool, a message id that is not a string)."""
    application = amqpwire.application_properties(routing_properties(record))
    if application is None or type(record.id) is not str:
        return None
    body = amqpwire.data(record.to_json().encode())
    return prefix + amqpwire.properties(record.id, CONTENT_TYPE) + application + body


class EventHubsSink:
    name = "eventhubs"

    def __init__(self, connection_string: str | None = None, namespace: str | None = None, hub: str | None = None,
                 client_id: str | None = None, timeout: float = 30.0) -> None:
        self.timeout = timeout
        options: dict[str, Any] = {"retry_total": 2, "retry_backoff_factor": 0.5, "retry_backoff_max": 5}
        if connection_string:
            try:
                self._client = EventHubProducerClient.from_connection_string(
                    connection_string, eventhub_name=hub or None, **options)
            except (ValueError, TypeError, KeyError) as exc:
                raise SinkConfigError(f"Event Hubs connection string is not valid: {scrub(str(exc))}") from None
            if not self._client.eventhub_name:
                raise SinkConfigError("Event Hubs connection string has no EntityPath; set --eventhubs-name")
            endpoint = re.search(r"Endpoint=sb://([^;/]+)", connection_string, re.IGNORECASE)
            self.target = f"{endpoint.group(1) if endpoint else '?'}/{self._client.eventhub_name}"
        elif namespace and hub:
            from azure.identity import DefaultAzureCredential, ManagedIdentityCredential

            self.credential: Any = (ManagedIdentityCredential(client_id=client_id) if client_id
                                    else DefaultAzureCredential())
            self._client = EventHubProducerClient(fully_qualified_namespace=namespace, eventhub_name=hub,
                                                  credential=self.credential, **options)
            self.target = f"{namespace}/{hub}"
        else:
            raise SinkConfigError(
                "--sink eventhubs needs FOREWARN_EVENTHUBS_CONNECTION_STRING, --eventhubs-connection-string-file, "
                "or --eventhubs-namespace with --eventhubs-name (Azure AD / managed identity)")
        self._encode_ourselves = amqpwire.matches_sdk()
        CODECS.checked("amqp", self._encode_ourselves)   # azure_scheduled_events_own_codec_in_use{codec="amqp"}
        if not self._encode_ourselves:
            log.warning("the installed azure-eventhub batches events differently from the version forewarn was "
                        "tested with; events are encoded by azure-eventhub itself (slower)")

    def encode(self, records: Sequence[Record]) -> list[EventDataBatch]:
        """The records as EventDataBatches, ready for `send_encoded`: one partition key per VM, a new batch
        where one is full. Each event is encoded once, by `amqpwire`, unless the SDK must do it: when its
        internals no longer match (`amqpwire.matches_sdk`), or azure-core tracing is on (`add` then puts the
        trace context into each event's properties)."""
        groups: dict[str, list[Record]] = {}
        for record in records:
            groups.setdefault(partition_key(record), []).append(record)
        ourselves = self._encode_ourselves and azure_settings.tracing_implementation() is None
        batches = []
        try:
            for key, group in groups.items():
                batch = self._client.create_batch(partition_key=key)
                start = amqpwire.prefix(key)
                for record in group:
                    encoded = encoded_event(start, record) if ourselves else None
                    try:
                        self._add(batch, record, encoded)
                    except ValueError:  # the batch is full: start the next one
                        batches.append(batch)
                        batch = self._client.create_batch(partition_key=key)
                        self._add(batch, record, encoded)
                batches.append(batch)
        except EventHubError as exc:
            raise self._error(exc) from exc
        return batches

    @staticmethod
    def _add(batch: EventDataBatch, record: Record, encoded: bytes | None) -> None:
        if encoded is None:
            batch.add(to_event(record))
        else:
            amqpwire.add_encoded(batch, encoded)

    def send_encoded(self, batches: list[EventDataBatch]) -> None:
        try:
            for batch in batches:
                self._client.send_batch(batch, timeout=self.timeout)
        except EventHubError as exc:
            raise self._error(exc) from exc

    def send(self, records: Sequence[Record]) -> None:
        self.send_encoded(self.encode(records))

    def _error(self, exc: EventHubError) -> SinkError:
        return SinkError(f"Event Hubs {self.target}: {type(exc).__name__}: {scrub(str(exc))[:200]}")

    def close(self) -> None:
        self._client.close()
