"""The one boundary every IMDS reply body crosses before any other code sees it.

IMDS is reached over plain HTTP on a link-local address: a broken proxy, a platform bug or anyone on
that network can answer in its place. So a reply is treated as hostile input and decoded here into a
JSON value that the rest of forewarn can trust:
- its size is capped by the client while reading (`DEFAULT_MAX_REPLY_BYTES`, `--imds-max-reply-bytes`);
- it must be UTF-8 text (IMDS sends UTF-8; other encodings are refused rather than guessed);
- at most `MAX_CONTAINERS` objects and arrays, counted on the raw bytes *before* parsing, because 4 MiB
  of `{},` parses into 1.4 million dicts (about 100 MB);
- nesting at most `MAX_DEPTH` levels (a Scheduled Events document has 4);
- no NaN or Infinity, and numbers only within what a 64-bit integer or a finite float holds: anything
  else is replaced by null with a warning, and the document parser then decides whether the field
  mattered;
- every string valid Unicode that encodes to UTF-8: a lone surrogate escape (`"\\ud800"`) is replaced
  by U+FFFD with a warning, so nothing downstream (record ids, label values, SQLite) can fail on it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

#: Largest reply read from IMDS. Real documents are a few KiB; a scale set event listing 1000 VMs is
#: about 40 KiB.
DEFAULT_MAX_REPLY_BYTES = 4 * 1024 * 1024
MAX_CONTAINERS = 10_000
MAX_DEPTH = 16
#: Longest string kept (characters); real ones are under 1 KiB. Longer ones are clipped, with a warning,
#: so one field cannot fill records, the outbox and every sink with megabytes.
MAX_STRING = 32 * 1024
#: Warnings kept per reply: a reply full of bad values gives a few lines of log, not thousands.
MAX_WARNINGS = 20
INT_RANGE = (-(2**63), 2**63 - 1)


class ReplyError(ValueError):
    """The reply cannot be decoded safely; the message says why."""


def _reject_constant(name: str) -> Any:
    raise ReplyError(f"{name} is not a JSON number forewarn accepts")


def decode_reply(body: bytes | str) -> tuple[Any, list[str]]:
    """The reply as a checked JSON value, and warnings about values that were replaced."""
    if isinstance(body, bytes):
        containers = body.count(b"{") + body.count(b"[")
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ReplyError(f"reply is not UTF-8 (byte 0x{body[exc.start]:02x} at offset {exc.start})") from None
    else:
        containers = body.count("{") + body.count("[")
        text = body
    if containers > MAX_CONTAINERS:
        raise ReplyError(f"reply has more than {MAX_CONTAINERS} objects and arrays")
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ReplyError(f"reply is nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as exc:
        raise ReplyError(f"reply is not JSON: {exc}") from None
    warnings: list[str] = []
    return _checked(value, warnings), warnings


def _checked(root: Any, warnings: list[str]) -> Any:
    """Walk the value without recursion: depth, numbers and strings checked, bad leaves replaced."""
    result: list[Any] = [None]
    # Each entry: the value, its container and key in the result, its depth and a path for messages.
    stack: list[tuple[Any, Any, Any, int, str]] = [(root, result, 0, 0, "$")]
    while stack:
        value, parent, key, depth, path = stack.pop()
        if isinstance(value, dict):
            if depth >= MAX_DEPTH:
                raise ReplyError(f"reply is nested more than {MAX_DEPTH} levels deep (at {path})")
            copy: dict[str, Any] = {}
            parent[key] = copy
            for name, item in value.items():
                clean = _text(name, f"{path} key", warnings)
                copy[clean] = None
                stack.append((item, copy, clean, depth + 1, f"{path}.{clean}"))
        elif isinstance(value, (list, tuple)):
            if depth >= MAX_DEPTH:
                raise ReplyError(f"reply is nested more than {MAX_DEPTH} levels deep (at {path})")
            items: list[Any] = [None] * len(value)
            parent[key] = items
            for index, item in enumerate(value):
                stack.append((item, items, index, depth + 1, f"{path}[{index}]"))
        elif isinstance(value, str):
            parent[key] = _text(value, path, warnings)
        elif isinstance(value, bool) or value is None:
            parent[key] = value
        elif isinstance(value, int):
            if INT_RANGE[0] <= value <= INT_RANGE[1]:
                parent[key] = value
            else:
                warnings.append(f"{path}: integer with {len(str(abs(value)))} digits is out of range; "
                                "read as null")
                parent[key] = None
        elif isinstance(value, float):
            if math.isfinite(value):
                parent[key] = value
            else:
                warnings.append(f"{path}: number out of range; read as null")
                parent[key] = None
        else:  # json.loads makes nothing else; a value built in Python might
            raise ReplyError(f"{path}: {type(value).__name__} is not a JSON value")
    return result[0]


_SURROGATE = re.compile("[\ud800-\udfff]")


def _text(value: str, path: str, warnings: list[str]) -> str:
    if len(value) > MAX_STRING:
        warnings.append(f"{path}: string of {len(value)} characters clipped to {MAX_STRING}")
        value = value[:MAX_STRING]
    if value.isascii() or not _SURROGATE.search(value):
        return value
    warnings.append(f"{path}: invalid Unicode (a lone surrogate escape) replaced by U+FFFD")
    return _SURROGATE.sub("\ufffd", value)


def capped(warnings: list[str]) -> tuple[str, ...]:
    """At most MAX_WARNINGS of them, the rest summed up in one line."""
    if len(warnings) <= MAX_WARNINGS:
        return tuple(warnings)
    return (*warnings[:MAX_WARNINGS], f"... and {len(warnings) - MAX_WARNINGS} more problems in this reply")


def check_value(value: Any) -> tuple[Any, list[str]]:
    """An already decoded value (a test, a scenario file) held to the same rules as a reply."""
    warnings: list[str] = []
    return _checked(value, warnings), warnings
