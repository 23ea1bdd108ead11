"""JSON lines on standard output, one record per line (logs go to standard error)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from forewarn.records import Record, json_lines
from forewarn.sinks import SinkError


class StdoutSink:
    name = "stdout"

    def send(self, records: Sequence[Record]) -> None:
        try:
            sys.stdout.write(json_lines(records))
            sys.stdout.flush()
        except (OSError, ValueError) as exc:
            raise SinkError(f"cannot write to standard output: {exc}") from exc

    def close(self) -> None:
        return None
