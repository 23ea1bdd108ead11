"""Azure Monitor Logs sink: records as rows of a custom table through the Logs Ingestion API.

`azure-monitor-ingestion` posts to the data collection endpoint (--logs-endpoint) for a data collection
rule (--logs-rule-id) and stream (--logs-stream); the rule maps the stream to the table (the deploy file
deploy/azure-monitor/forewarn-logs.json creates both). Authentication is Azure AD: the VM's managed
identity (--logs-client-id picks a user-assigned one) or whatever DefaultAzureCredential finds (workload
identity on AKS). The client gzips the rows and splits large uploads; the outbox retries failed ones.

Like the notification sinks, the sink remembers the record ids it has uploaded (`SentIds`, beside the outbox)
and leaves out a repeat when the outbox hands a batch over again after a crash, so a row arrives once per
record id. A private endpoint behind a private CA: put the CA in the system trust store or name a bundle in
REQUESTS_CA_BUNDLE, which azure-core (and so the token request too) honours.

Each row has the columns of the stream declared in the deploy file (COLUMNS below; a test keeps them in step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from forewarn.config import safe_url
from forewarn.records import Record
from forewarn.sinks import SinkConfigError, SinkError
from forewarn.sinks.notify import SentIds

#: The stream's columns and their types, as declared in the data collection rule.
COLUMNS: dict[str, str] = {
    "TimeGenerated": "datetime", "RecordId": "string", "Change": "string", "EventId": "string",
    "EventType": "string", "EventStatus": "string", "ResourceType": "string", "Resources": "dynamic",
    "NotBefore": "datetime", "DurationInSeconds": "int", "Description": "string", "EventSource": "string",
    "AffectsThisVm": "boolean", "Incarnation": "int", "VmName": "string", "VmId": "string",
    "ResourceId": "string", "Outcome": "string", "PolicyRule": "string", "DryRun": "boolean",
    "Record": "dynamic",
}


def to_row(record: Record) -> dict[str, Any]:
    data = record.data
    event = data.get("event", {})
    vm = data.get("vm", {})
    row: dict[str, Any] = {
        "TimeGenerated": record.time, "RecordId": record.id, "Change": data.get("change"),
        "EventId": record.subject, "EventType": event.get("EventType"), "EventStatus": event.get("EventStatus"),
        "ResourceType": event.get("ResourceType"), "Resources": list(event.get("Resources", [])),
        "NotBefore": data.get("not_before"), "DurationInSeconds": event.get("DurationInSeconds"),
        "Description": event.get("Description"), "EventSource": event.get("EventSource"),
        "AffectsThisVm": bool(data.get("affects_this_vm")), "Incarnation": data.get("incarnation"),
        "VmName": vm.get("name"), "VmId": vm.get("vm_id"), "ResourceId": vm.get("resource_id"),
        "Outcome": data.get("outcome"), "PolicyRule": data.get("policy_rule"), "DryRun": data.get("dry_run"),
        "Record": record.to_dict(),
    }
    return {key: value for key, value in row.items() if value is not None}


class LogsIngestionSink:
    name = "logs-ingestion"

    def __init__(self, endpoint: str | None, rule_id: str | None, stream: str | None,
                 client_id: str | None = None, credential: Any = None, state_dir: str | None = None) -> None:
        """`credential`: any azure-core TokenCredential (an object with `get_token`); by default the managed
        identity (`client_id`) or DefaultAzureCredential."""
        if not endpoint or not rule_id or not stream:
            raise SinkConfigError("--sink logs-ingestion needs --logs-endpoint (the data collection endpoint), "
                                  "--logs-rule-id (the rule's immutable id) and --logs-stream")
        if not endpoint.startswith("https://"):
            raise SinkConfigError("--logs-endpoint: expected an https:// URL (Azure AD tokens are sent only "
                                  "over TLS)")
        from azure.monitor.ingestion import LogsIngestionClient

        if credential is None:
            from azure.identity import DefaultAzureCredential, ManagedIdentityCredential

            credential = ManagedIdentityCredential(client_id=client_id) if client_id else DefaultAzureCredential()
        self.credential = credential
        self.rule_id = rule_id
        self.stream = stream
        self.target = safe_url(endpoint)
        self._client = LogsIngestionClient(endpoint=endpoint, credential=credential, logging_enable=False)
        self.sent = SentIds(state_dir, self.name)

    def send(self, records: Sequence[Record]) -> None:
        from azure.core.exceptions import AzureError

        fresh = [record for record in records if record.id not in self.sent]
        if not fresh:
            return
        failures: list[Any] = []  # LogsUploadError: the error and the rows of the chunk it refused
        try:
            self._client.upload(rule_id=self.rule_id, stream_name=self.stream,
                                logs=[to_row(record) for record in fresh],
                                on_error=failures.append)
        except (AzureError, OSError, ValueError) as exc:
            raise SinkError(f"Logs Ingestion {self.target}: {type(exc).__name__}: {str(exc)[:200]}") from exc
        # The client uploads in chunks of up to 1 MB; the rows of the chunks taken are remembered, so the
        # outbox's retry of the batch sends only the refused ones again.
        refused = {row.get("RecordId") for failure in failures for row in failure.failed_logs}
        self.sent.add_many(record.id for record in fresh if record.id not in refused)
        if failures:
            error = failures[0].error
            raise SinkError(f"Logs Ingestion {self.target}: {len(failures)} chunk(s) refused: "
                            f"{type(error).__name__}: {str(error)[:200]}")

    def close(self) -> None:
        self._client.close()
        self.sent.close()
