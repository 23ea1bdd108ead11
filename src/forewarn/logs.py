"""Logging: text for people, JSON lines for log pipelines, always on standard error."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _RESERVED})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(fmt: str = "text", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        formatter = logging.Formatter("%(asctime)s.%(msecs)03dZ %(levelname)-7s %(name)s: %(message)s",
                                      datefmt="%Y-%m-%dT%H:%M:%S")
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Connection-level chatter from urllib3 is noise at info; failures are reported by forewarn itself.
    logging.getLogger("urllib3").setLevel(logging.WARNING)


class StateLog:
    """Logs a condition when it starts, changes or clears, not on every repetition (once per second
    polling would otherwise flood the log during an outage)."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._log = logger
        self._what = what
        self._state: str | None = None
        self._since = 0.0
        self.repeats = 0

    def failing(self, key: str, message: str) -> None:
        if key != self._state:
            self._log.error("%s: %s", self._what, message)
            self._state = key
            self._since = time.monotonic()
            self.repeats = 0
        else:
            self.repeats += 1

    def ok(self) -> None:
        if self._state is not None:
            self._log.info("%s recovered after %.1f s (%d repeated failures not logged)",
                           self._what, time.monotonic() - self._since, self.repeats)
            self._state = None
