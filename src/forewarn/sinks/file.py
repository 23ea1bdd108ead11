"""JSON lines appended to a file, one record per line.

The file is opened for each batch, so a rotated file (logrotate without copytruncate) is picked up at
once, and synced before the batch counts as delivered.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from forewarn.records import Record
from forewarn.sinks import SinkError


class FileSink:
    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.name = f"file:{path}"

    def send(self, records: Sequence[Record]) -> None:
        data = "".join(record.to_json() + "\n" for record in records).encode()
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
