"""Logging: text for people, JSON lines for log pipelines, always on standard error."""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import unicodedata
from typing import Any

_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}

_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_controls(text: str) -> str:
    """`text` on one line: control characters (C0, DEL, C1), line and paragraph separators and lone
    surrogates written as escapes. IMDS strings, event ids and hook output reach the log; a newline in
    one of them would otherwise start a line that looks like forewarn's own."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif unicodedata.category(ch) in ("Cc", "Zl", "Zp", "Cs"):
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


# Other libraries log what they were given: the OTLP exporters put the request URL (with its query) in
# transport errors and the gRPC target (with any user:password@) in retries; the Azure SDK may echo a
# signature. forewarn hides these in its own messages where it writes them; for the rest, here.
_THIRD_PARTY_SECRETS = (
    (re.compile(r"(?<=//)[^\s/@'\"]+@"), "<redacted>@"),                          # scheme://user:pass@
    (re.compile(r"(?<![\w/])[^\s/@'\"(),=:]+:[^\s/@'\"(),]*@(?=[\w\[])"), "<redacted>@"),  # user:pass@host
    (re.compile(r"(?<=[\w/.\-])\?[^\s'\"()<>]+"), "?<redacted>"),                   # path?query
    (re.compile(r"(SharedAccessKey|SharedAccessSignature|sig|Bearer|Basic)([=\s]+)[^\s;,'\"&]+",
                re.IGNORECASE), r"\1\2<redacted>"),
)
#: Loggers whose arguments are the secret itself (a header entry, name=value): keep the text, not the value.
_ARGUMENTS_HIDDEN = ("opentelemetry.util.re",)


def redact_secrets(text: str) -> str:
    for pattern, replacement in _THIRD_PARTY_SECRETS:
        text = pattern.sub(replacement, text)
    return text


class ThirdPartyRedaction(logging.Filter):
    """Scrubs URL credentials, queries and signatures from records of loggers that are not forewarn's."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "forewarn" or record.name.startswith("forewarn."):
            return True
        if record.name in _ARGUMENTS_HIDDEN and record.args:
            hidden = tuple("(not shown: it may hold a secret)" for _ in record.args) \
                if isinstance(record.args, tuple) else ()
            try:
                message = str(record.msg) % hidden
            except (TypeError, ValueError):
                message = str(record.msg)
        else:
            message = record.getMessage()
        record.msg, record.args = redact_secrets(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_secrets(record.exc_text)
        return True


class TextFormatter(logging.Formatter):
    """One line per record: the message is escaped; a traceback after it stays readable on its lines."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s.%(msecs)03dZ %(levelname)-7s %(name)s: %(message)s",
                         datefmt="%Y-%m-%dT%H:%M:%S")
        self.converter = time.gmtime

    def formatMessage(self, record: logging.LogRecord) -> str:
        return escape_controls(super().formatMessage(record))


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
            entry["exception"] = record.exc_text or self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(fmt: str = "text", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(ThirdPartyRedaction())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Connection-level chatter from urllib3 is noise at info; failures are reported by forewarn itself.
    logging.getLogger("urllib3").setLevel(logging.WARNING)
    # The Azure SDK (azure.eventhub, azure.core, azure.identity, the AMQP stack) logs INFO on every link
    # attach and retry; the Event Hubs sink reports failures itself. Shown only when debugging.
    for name in ("azure", "uamqp"):
        logging.getLogger(name).setLevel(logging.NOTSET if level.lower() == "debug" else logging.WARNING)


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
