"""JSON lines appended to a file, one record per line.

The file is opened for each batch, so a rotated file (logrotate without copytruncate) is picked up at
once, and synced before the batch counts as delivered. The records are written as the outbox stored
them, without parsing them again.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from forewarn.records import Record, json_lines
from forewarn.sinks import SinkError


class FileSink:
    #: Records per batch: one write and one fsync each. The fsync costs as much as writing a few thousand
    #: records, and 2,000 records of about 1 kB keep a batch within a few MB of memory.
    batch_size = 2000

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.name = f"file:{path}"

    def send(self, records: Sequence[Record]) -> None:
        data = json_lines(records).encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("ab") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            raise SinkError(f"cannot append to {self.path}: {exc.strerror or exc}") from exc

    def close(self) -> None:
        return None
