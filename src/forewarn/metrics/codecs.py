"""Which of forewarn's own codecs this process uses, as their checks at start found.

forewarn encodes OTLP requests (sinks/otlpwire.py) and AMQP messages (sinks/amqpwire.py) itself, and checks
at start that its bytes are the library's for a set of probe values; where they differ, the sink keeps the
library's encoder (slower, never wrong), logs it once and says so here:

    azure_scheduled_events_own_codec_in_use{codec}   1: forewarn's own encoder, 0: the library's

A codec appears once a sink that uses it has started. The checks are facts about the installed libraries,
so they are the process's: `CODECS` is one for the process, shown by the agent's and fleet's registries.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from forewarn.metrics.core import Family


class CodecChecks:
    """The outcome of each own codec's check at start: codec -> whether forewarn's own encoder is used."""

    def __init__(self) -> None:
        self._used: dict[str, bool] = {}
        self._lock = threading.Lock()

    def checked(self, codec: str, own: bool) -> None:
        with self._lock:
            self._used = {**self._used, codec: own}  # replaced whole: a scrape reads it without the lock

    def own(self, codec: str) -> bool | None:
        """Whether `codec` is encoded by forewarn (None: no sink has checked it)."""
        return self._used.get(codec)

    def collect(self) -> Iterator[Family]:
        used = self._used
        if not used:
            return
        family = Family("azure_scheduled_events_own_codec_in_use",
                        "1 while a sink encodes with forewarn's own codec (its bytes were the library's for the "
                        "probes checked at start), 0 when they differed and the library's encoder is used.",
                        labels=["codec"])
        for codec, own in sorted(used.items()):
            family.add([codec], 1 if own else 0)
        yield family


#: The process's checks (the agent's and fleet's registries show them).
CODECS = CodecChecks()
