"""Where records go. Every sink has the same narrow shape: `send(records)` returns once the records are
safely delivered and raises `SinkError` otherwise; the delivery worker retries, in order.

Sinks are named by a spec on the command line: `stdout`, `file:PATH`, `eventhubs`, `otlp`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from forewarn.records import Record


class SinkError(Exception):
    """A delivery attempt failed; the message is safe to log (no secrets)."""


class SinkConfigError(ValueError):
    """A sink spec or its settings are unusable; the message names the option."""


class Sink(Protocol):
    #: Short, stable label for metrics and logs (`stdout`, `file:/var/log/x.jsonl`, ...).
    name: str

    def send(self, records: Sequence[Record]) -> None: ...

    def close(self) -> None: ...


def build_sink(spec: str) -> Sink:
    """The sink a `--sink` spec names; raises SinkConfigError for an unknown or incomplete spec."""
    kind, _, arg = spec.partition(":")
    if kind == "stdout" and not arg:
        from forewarn.sinks.stdout import StdoutSink

        return StdoutSink()
    if kind == "file":
        if not arg:
            raise SinkConfigError("--sink file:PATH needs a path, e.g. file:/var/log/forewarn/events.jsonl")
        from forewarn.sinks.file import FileSink

        return FileSink(arg)
    raise SinkConfigError(f"--sink {spec!r} is not a known sink; valid: stdout, file:PATH")
