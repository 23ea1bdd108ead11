"""JSON lines appended to a file, one record per line.

The file is opened for each batch, so a rotated file (logrotate without copytruncate) is picked up at
once, and synced before the batch counts as delivered. The records are written as the outbox stored
them, without parsing them again. A missing directory is created, and said so in the log (a typo in the
path would otherwise write records where nobody looks).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from forewarn.records import Record, json_lines
from forewarn.sinks import SinkError

log = logging.getLogger(__name__)


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
            self._make_directory()
            with self.path.open("ab") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            raise SinkError(f"cannot append to {self.path}: {exc.strerror or exc}") from exc

    def _make_directory(self) -> None:
        directory = self.path.parent
        if directory.is_dir():
            return
        top = directory
        while not top.parent.exists() and top.parent != top:
            top = top.parent
        directory.mkdir(parents=True, exist_ok=True)
        created = str(top) if top == directory else f"{top} (down to {directory})"
        log.info("sink %s: created the missing directory %s", self.name, created)

    def close(self) -> None:
        return None
