"""Where records go. Every sink has the same narrow shape: `send(records)` returns once the records are
safely delivered and raises `SinkError` otherwise; the delivery worker retries, in order.

Sinks are named by a spec on the command line: `stdout`, `file:PATH`, `eventhubs`, `otlp`, and the
notification sinks `webhook`, `slack`, `teams`, `template`, plus `logs-ingestion` (Azure Monitor Logs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from forewarn.config import ConfigError, Settings
from forewarn.records import Record


class SinkError(Exception):
    """A delivery attempt failed; the message is safe to log (no secrets)."""


class SinkConfigError(ValueError):
    """A sink spec or its settings are unusable; the message names the option."""


class Sink(Protocol):
    """A sink may also define `idle()`: the delivery worker calls it after a quiet spell (30 s with
    nothing to send), to release what costs CPU while unused; `send` must work again afterwards. And it
    may define `batch_size`: how many records one `send` should get at most (the delivery worker's
    default otherwise), for a sink whose cost per call (an fsync, a request) is worth spreading wider.
    A sink whose encoding costs CPU may split `send` in two, `encode(records) -> payload` (no I/O that
    needs retrying: raising counts as a failed send) and `send_encoded(payload)`; the worker then encodes
    the next batch while the previous one is on its way."""

    #: Short, stable label for metrics and logs (`stdout`, `file:/var/log/x.jsonl`, ...).
    name: str

    def send(self, records: Sequence[Record]) -> None: ...

    def close(self) -> None: ...


def build_sink(spec: str, options: Mapping[str, Any] | None = None) -> Sink:
    """The sink a `--sink` spec names, configured from `options` (the run settings); raises
    SinkConfigError for an unknown or incomplete spec. Heavy client libraries load only here."""
    options = options or {}
    kind, _, arg = spec.partition(":")
    if kind == "stdout" and not arg:
        from forewarn.sinks.stdout import StdoutSink

        return StdoutSink()
    if kind == "file":
        if not arg:
            raise SinkConfigError("--sink file:PATH needs a path, e.g. file:/var/log/forewarn/events.jsonl")
        from forewarn.sinks.file import FileSink

        return FileSink(arg)
    if kind == "otlp" and not arg:
        try:
            from forewarn.sinks.otlp import OtlpSink
        except ImportError as exc:
            raise SinkConfigError(f"--sink otlp needs the OpenTelemetry packages: pip install 'forewarn[otlp]' "
                                  f"({exc.name} is missing)") from None
        return OtlpSink(endpoint=options.get("otlp_endpoint"), protocol=options.get("otlp_protocol"))
    if kind == "eventhubs" and not arg:
        try:
            from forewarn.sinks.eventhubs import EventHubsSink
        except ImportError as exc:
            raise SinkConfigError(f"--sink eventhubs needs azure-eventhub: pip install 'forewarn[eventhubs]' "
                                  f"({exc.name} is missing)") from None
        return EventHubsSink(connection_string=options.get("eventhubs_connection_string"),
                             namespace=options.get("eventhubs_namespace"), hub=options.get("eventhubs_name"),
                             client_id=options.get("eventhubs_client_id"))
    if kind in NOTIFY_KINDS and not arg:
        try:
            return _notify_sink(kind, options)
        except ImportError as exc:
            extra = "logs" if kind == "logs-ingestion" else "notify"
            raise SinkConfigError(f"--sink {kind} needs {exc.name}: pip install 'forewarn[{extra}]'") from None
    raise SinkConfigError(f"--sink {spec!r} is not a known sink; valid: stdout, file:PATH, otlp, eventhubs, "
                          f"{', '.join(NOTIFY_KINDS)}")


#: The sinks that post one message per record (and logs-ingestion, built alongside).
NOTIFY_KINDS = ("webhook", "slack", "teams", "template", "logs-ingestion")


def _notify_sink(kind: str, options: Mapping[str, Any]) -> Sink:
    from forewarn.sinks.notify import check_url, parse_filter

    state_dir = options.get("state_dir")
    link = options.get("notify_link")
    if kind == "logs-ingestion":
        from forewarn.sinks.logsingestion import LogsIngestionSink

        return LogsIngestionSink(endpoint=options.get("logs_endpoint"), rule_id=options.get("logs_rule_id"),
                                 stream=options.get("logs_stream"), client_id=options.get("logs_client_id"),
                                 state_dir=state_dir)
    prefix = {"webhook": "webhook", "slack": "slack-webhook", "teams": "teams-webhook", "template": "template"}[kind]
    key = prefix.replace("-", "_") + "_url"
    where = f"FOREWARN_{key.upper()} or --{prefix}-url-file"
    if not options.get(key):
        raise SinkConfigError(f"--sink {kind} needs the URL in {where} (never a flag: it holds the key)")
    url = check_url(options.get(key), where)
    filter = parse_filter(options.get(f"{kind}_filter"), f"{kind}-filter")
    rate = float(options.get(f"{kind}_rate_limit") or 0)
    if kind == "webhook":
        from forewarn.sinks.webhook import WebhookSink

        return WebhookSink(url, options.get("webhook_mode") or "structured", filter, rate, state_dir)
    if kind == "slack":
        from forewarn.sinks.slack import SlackSink

        return SlackSink(url, filter, rate, state_dir, link)
    if kind == "teams":
        from forewarn.sinks.teams import TeamsSink

        return TeamsSink(url, filter, rate, state_dir, link)
    from forewarn.config import ConfigError, read_text_file
    from forewarn.sinks.template import TemplateSink

    path = options.get("template_file")
    if not path:
        raise SinkConfigError("--sink template needs --template-file (a Jinja2 template of the JSON body)")
    try:
        text = read_text_file(path, "--template-file")
    except ConfigError as exc:
        raise SinkConfigError(str(exc)) from None
    return TemplateSink(url, path, text, filter, rate, state_dir, link)


def build_sinks(specs: Sequence[str], settings: Settings | None = None) -> list[Sink]:
    """The sinks of every `--sink` spec, configured from `settings`; raises ConfigError for an unusable
    spec or a sink given twice (a sink's name keys its outbox cursor and its metrics)."""
    sinks: list[Sink] = []
    for spec in specs:
        try:
            sinks.append(build_sink(spec, settings.values if settings is not None else None))
        except SinkConfigError as exc:
            raise ConfigError(str(exc)) from None
    names = [sink.name for sink in sinks]
    if len(set(names)) != len(names):
        raise ConfigError("--sink: the same sink is given twice")
    return sinks
