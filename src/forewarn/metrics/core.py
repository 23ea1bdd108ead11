"""Metric types, families and the registry, with the two text formats Prometheus scrapes written here.

forewarn used prometheus-client for this. Its import alone was 13 MiB of an idle agent's 28 (it loads its
HTTP servers, WSGI, the pushgateway's urllib and its collectors), and its rendering, which escapes and
validates every label of every sample at every scrape, was most of a 100-event scrape's 2-6 ms. forewarn
needs a small part of it: counters, gauges and one histogram updated where things happen, families built
at scrape time, and the exposition in the Prometheus text format 0.0.4 or OpenMetrics 1.0.0. Here each
series renders its name and labels once, when it is created (`labels(...)`), and a scrape writes only the
values. The output is the same text prometheus-client writes (tests/test_metrics_core.py compares them).

    Counter, Gauge, Histogram    updated where things happen, registered with a Registry
    Family                       built by a collector at scrape time (a gauge or a counter)
    Registry.render(openmetrics) the whole exposition; negotiate(accept) picks the format
    FeatureFamilies              a sub-registry shown only once its feature is turned on
"""

from __future__ import annotations

import itertools
import math
import threading
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal, Protocol

TEXT = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
#: OpenMetrics ends with this line, once, at the very end.
EOF = b"# EOF\n"

Kind = Literal["counter", "gauge", "histogram"]


def negotiate(accept: str) -> tuple[bool, str]:
    """(OpenMetrics?, content type) for an Accept header. OpenMetrics 1.0.0 when it is asked for without a
    version or with one from 1.0.0 on; the text format 0.0.4 otherwise (Prometheus 3's `text/plain;
    version=1.0.0` too: 0.0.4 is what it falls back to, and every name here is a classic one)."""
    for accepted in (accept or "").split(","):
        media, *params = accepted.split(";")
        if media.strip() != "application/openmetrics-text":
            continue
        version = next((p.split("=", 1)[1].strip() for p in params if p.strip().startswith("version=")), "")
        if not version or _version(version) >= (1, 0, 0):
            return True, OPENMETRICS
    return False, TEXT


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split("."):
        if not part.isdigit():
            return (0,)
        parts.append(int(part))
    return tuple(parts)


def number(value: float) -> str:
    """A sample value as Go writes it (Prometheus's own format): +Inf, -Inf, NaN, and exponents from 1e7."""
    text = repr(float(value))
    dot = text.find(".")
    if dot < 0:  # inf, -inf, nan, or already an exponent (1e+22)
        return _SPECIAL.get(text, text)
    if dot > 6 and text[0] != "-":  # repr keeps 1234567890.0 where Go writes 1.23456789e+09
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return text


_SPECIAL = {"inf": "+Inf", "-inf": "-Inf", "nan": "NaN"}


def escape(value: str) -> str:
    """A label value between double quotes."""
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return value


class LabelSet:
    """The label names of a family and how to write a series' labels: sorted by name, as the client
    libraries write them, so that the same series always has the same text."""

    __slots__ = ("_names", "_order")

    def __init__(self, names: Sequence[str]) -> None:
        self._names = tuple(names)
        self._order = sorted(range(len(self._names)), key=self._names.__getitem__)

    def __len__(self) -> int:
        return len(self._names)

    def text(self, values: Sequence[str], extra: tuple[str, str] | None = None) -> str:
        """`{a="1",b="2"}` for the values in the order of the names (empty without labels). `extra` is one
        more (name, value), sorted in with the rest (a histogram bucket's `le`)."""
        if len(values) != len(self._names):
            raise ValueError(f"expected {len(self._names)} label values, got {len(values)}")
        pairs = [(self._names[i], values[i]) for i in self._order]
        if extra is not None:
            pairs = sorted([*pairs, extra], key=lambda pair: pair[0])
        return "{" + ",".join(f'{name}="{escape(value)}"' for name, value in pairs) + "}" if pairs else ""


def _header(name: str, kind: Kind, documentation: str, openmetrics: bool) -> str:
    if openmetrics:
        family = name[:-len("_total")] if kind == "counter" else name
        text = documentation.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
        return f"# HELP {family} {text}\n# TYPE {family} {kind}\n"
    text = documentation.replace("\\", "\\\\").replace("\n", "\\n")
    return f"# HELP {name} {text}\n# TYPE {name} {kind}\n"


class Header:
    """A family's HELP and TYPE lines in both formats, made once, for a collector that writes its samples
    itself."""

    __slots__ = ("_texts", "name")

    def __init__(self, name: str, documentation: str, kind: Kind = "gauge") -> None:
        self.name = name
        self._texts = (_header(name, kind, documentation, False), _header(name, kind, documentation, True))

    def text(self, openmetrics: bool) -> str:
        return self._texts[openmetrics]


class Exposable(Protocol):
    """Anything a Registry renders: a metric, or a family built at scrape time."""

    def write(self, out: list[str], openmetrics: bool) -> None: ...


class Collector(Protocol):
    """Families built at scrape time, from state read then (never I/O)."""

    def collect(self) -> Iterable[Exposable]: ...


class Family:
    """A family built at scrape time: its samples are written as they are added, so a family of 10,000
    series is text, not 10,000 objects. `name` is the sample name (a counter's ends in `_total`)."""

    __slots__ = ("_chunks", "_labels", "_lines", "documentation", "kind", "name")

    #: Lines kept apart before they are joined into one string: large families stay a few large strings.
    _CHUNK = 512

    def __init__(self, name: str, documentation: str, labels: Sequence[str] = (), kind: Kind = "gauge",
                 value: float | None = None) -> None:
        if kind == "counter" and not name.endswith("_total"):
            raise ValueError(f"a counter's name ends in _total: {name}")
        self.name = name
        self.documentation = documentation
        self.kind = kind
        self._labels = LabelSet(labels)
        self._lines: list[str] = []
        self._chunks: list[str] = []
        if value is not None:
            self.add((), value)

    def add(self, values: Sequence[str], value: float) -> None:
        self.add_series(self.series(values), value)

    def series(self, values: Sequence[str]) -> str:
        """A series' text up to its value, for a collector that keeps it from one scrape to the next."""
        return f"{self.name}{self._labels.text(values)} "

    def add_series(self, series: str, value: float) -> None:
        """A sample of a series written by `series`."""
        self.add_samples(((series, value),))

    def add_samples(self, samples: Iterable[tuple[str, float]]) -> None:
        """Samples of series written by `series`, as (series, value)."""
        self._lines.extend([f"{series}{number(value)}\n" for series, value in samples])
        if len(self._lines) >= self._CHUNK:
            self._chunks.append("".join(self._lines))
            self._lines.clear()

    def write(self, out: list[str], openmetrics: bool) -> None:
        out.append(_header(self.name, self.kind, self.documentation, openmetrics))
        out.extend(self._chunks)
        out.extend(self._lines)


#: Marks of change: each change to a metric's series stores the next one in the metric's `changed` cell (one
#: C call, atomic under the GIL, and never a value the cell held before), so a scrape tells that a metric is
#: as it last wrote it from one comparison instead of reading every series.
_marks = itertools.count(1)


class _Value:
    """One series of a metric: its text up to the value, and the value. `changed` is its metric's cell."""

    __slots__ = ("_changed", "_lock", "_value", "prefix")

    def __init__(self, prefix: str, changed: list[int]) -> None:
        self.prefix = prefix
        self._value = 0.0
        self._lock = threading.Lock()
        self._changed = changed

    @property
    def value(self) -> float:
        return self._value

    def state(self) -> object:
        return self._value

    def write(self, out: list[str], state: object) -> None:
        assert isinstance(state, float)
        out.append(f"{self.prefix}{number(state)}\n")

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self._value += amount
            self._changed[0] = next(_marks)


class CounterChild(_Value):
    __slots__ = ()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        super().inc(amount)


class GaugeChild(_Value):
    __slots__ = ()

    def set(self, value: float) -> None:
        with self._lock:
            self._value = float(value)
            self._changed[0] = next(_marks)

    def dec(self, amount: float = 1.0) -> None:
        self.inc(-amount)


class HistogramChild:
    """One histogram series: counts per bucket (not yet cumulative), the count and the sum."""

    __slots__ = ("_bounds", "_changed", "_counts", "_lines", "_lock", "_sum")

    def __init__(self, name: str, labels: LabelSet, values: Sequence[str], bounds: Sequence[float],
                 changed: list[int]) -> None:
        self._bounds = tuple(bounds)
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._lock = threading.Lock()
        self._changed = changed
        self._lines = ([f"{name}_bucket{labels.text(values, ('le', number(b)))} " for b in self._bounds],
                       f"{name}_count{labels.text(values)} ", f"{name}_sum{labels.text(values)} ")

    def observe(self, amount: float) -> None:
        i = bisect_left(self._bounds, amount)  # the first bucket whose bound is >= amount
        with self._lock:
            self._sum += amount
            if i < len(self._counts) and amount <= self._bounds[i]:  # NaN falls in no bucket
                self._counts[i] += 1
            self._changed[0] = next(_marks)

    def state(self) -> object:
        with self._lock:
            return (*self._counts, self._sum)

    def write(self, out: list[str], state: object) -> None:
        assert isinstance(state, tuple)
        *counts, total = state
        buckets, count, sums = self._lines
        running = 0
        for prefix, n in zip(buckets, counts, strict=True):
            running += n
            out.append(f"{prefix}{number(running)}\n")
        out.append(f"{count}{number(running)}\n")
        out.append(f"{sums}{number(total)}\n")


class _Metric:
    """What counters, gauges and histograms share: a name, help, label names and the series by values.
    Without label names the metric is its own one series, at zero from the start."""

    kind: Kind

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 registry: Registry | None = None) -> None:
        self.name = name
        self.documentation = documentation
        self._labels = LabelSet(labelnames)
        self._children: dict[tuple[str, ...], object] = {}
        self._lock = threading.Lock()
        self._changed = [0]  # the mark of the last change to any series, or of a series added (see _marks)
        self._single = None if labelnames else self._child(())
        self._header = Header(name, documentation, self.kind)
        self._last: tuple[int, str] = (-1, "")  # the mark its series had at the last write, and their text
        if registry is not None:
            registry.register(self)

    def _new(self, values: tuple[str, ...]) -> object:
        raise NotImplementedError

    def _child(self, values: tuple[str, ...]) -> object:
        child = self._children.get(values)
        if child is None:
            with self._lock:
                child = self._children.get(values)
                if child is None:
                    child = self._children[values] = self._new(values)
                    self._changed[0] = next(_marks)
        return child

    def _values(self, values: Sequence[object]) -> tuple[str, ...]:
        if not len(self._labels):
            raise ValueError(f"{self.name} has no labels")
        return tuple(str(v) for v in values)

    def collect(self) -> Iterable[Exposable]:
        return (self,)

    def write(self, out: list[str], openmetrics: bool) -> None:
        """The header, then the series. Most scrapes find no series changed since the last one wrote them
        (counters move rarely), and reuse that text instead of reading and formatting each value again."""
        out.append(self._header.text(openmetrics))
        mark = self._changed[0]  # read before the values: a change made while they are read is seen next time
        last, text = self._last
        if mark == last:
            out.append(text)
            return
        lines: list[str] = []
        for child in list(self._children.values()):
            child.write(lines, child.state())  # type: ignore[attr-defined]
        text = "".join(lines)
        self._last = (mark, text)  # one assignment: a scrape reads the pair whole, either one's or another's
        out.append(text)


class Counter(_Metric):
    kind: Kind = "counter"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 registry: Registry | None = None) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"a counter's name ends in _total: {name}")
        super().__init__(name, documentation, labelnames, registry)

    def _new(self, values: tuple[str, ...]) -> CounterChild:
        return CounterChild(f"{self.name}{self._labels.text(values)} ", self._changed)

    def labels(self, *values: object) -> CounterChild:
        child = self._child(self._values(values))
        assert isinstance(child, CounterChild)
        return child

    def inc(self, amount: float = 1.0) -> None:
        assert isinstance(self._single, CounterChild), f"{self.name} has labels"
        self._single.inc(amount)

    @property
    def value(self) -> float:
        assert isinstance(self._single, CounterChild), f"{self.name} has labels"
        return self._single.value


class Gauge(_Metric):
    kind: Kind = "gauge"

    def _new(self, values: tuple[str, ...]) -> GaugeChild:
        return GaugeChild(f"{self.name}{self._labels.text(values)} ", self._changed)

    def labels(self, *values: object) -> GaugeChild:
        child = self._child(self._values(values))
        assert isinstance(child, GaugeChild)
        return child

    def set(self, value: float) -> None:
        assert isinstance(self._single, GaugeChild), f"{self.name} has labels"
        self._single.set(value)

    def inc(self, amount: float = 1.0) -> None:
        assert isinstance(self._single, GaugeChild), f"{self.name} has labels"
        self._single.inc(amount)

    def dec(self, amount: float = 1.0) -> None:
        self.inc(-amount)

    @property
    def value(self) -> float:
        assert isinstance(self._single, GaugeChild), f"{self.name} has labels"
        return self._single.value


class Histogram(_Metric):
    kind: Kind = "histogram"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 registry: Registry | None = None, buckets: Sequence[float] = (0.1, 1, 10)) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self._bounds = tuple(bounds)
        super().__init__(name, documentation, labelnames, registry)

    def _new(self, values: tuple[str, ...]) -> HistogramChild:
        return HistogramChild(self.name, self._labels, values, self._bounds, self._changed)

    def labels(self, *values: object) -> HistogramChild:
        child = self._child(self._values(values))
        assert isinstance(child, HistogramChild)
        return child

    def observe(self, amount: float) -> None:
        assert isinstance(self._single, HistogramChild), f"{self.name} has labels"
        self._single.observe(amount)


def encode(pieces: Iterable[str], size: int = 1 << 16) -> Iterator[bytes]:
    """Text pieces as UTF-8 parts of about `size` bytes, one at a time: small pieces are joined, a large one
    is encoded alone, and nothing is joined into one copy of the whole (a fleet's exposition is megabytes)."""
    pending: list[str] = []
    length = 0
    for piece in pieces:
        pending.append(piece)
        length += len(piece)
        if length >= size:
            yield "".join(pending).encode()
            pending.clear()
            length = 0
    if pending:
        yield "".join(pending).encode()


class Registry:
    """What one exposition shows: metrics and collectors, rendered in the order they were registered."""

    def __init__(self) -> None:
        self._parts: list[Collector] = []
        self._lock = threading.Lock()

    def register(self, part: Collector) -> None:
        with self._lock:
            self._parts.append(part)

    def families(self) -> Iterator[Exposable]:
        for part in list(self._parts):
            yield from part.collect()

    def write(self, out: list[str], openmetrics: bool) -> None:
        """The families' text, without OpenMetrics's closing line."""
        for family in self.families():
            family.write(out, openmetrics)

    def render(self, openmetrics: bool = False) -> bytes:
        out: list[str] = []
        self.write(out, openmetrics)
        body = "".join(out).encode()
        return body + EOF if openmetrics else body

    def get_sample_value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """The value of one sample, or None: for tests and tools, not for the scrape path."""
        labels = labels or {}
        prefix = name + LabelSet(list(labels)).text(list(labels.values())) + " "
        for line in self.render().decode().splitlines():
            if line.startswith(prefix):
                return float(line[len(prefix):].replace("+Inf", "inf").replace("-Inf", "-inf"))
        return None


class FeatureFamilies(Registry):
    """The families of a feature that may be off (approvals, hooks, node actions), registered in their place in
    the exposition and shown only once the feature is turned on: a plain agent's /metrics carries no series of
    what it does not do (issue #37). Turned on, they stay on (counters never vanish mid-run). The metrics exist
    either way, so the code that counts holds them as it would any other."""

    def __init__(self, registry: Registry) -> None:
        super().__init__()
        self.on = False
        registry.register(self)

    def turn_on(self) -> None:
        self.on = True

    def collect(self) -> Iterable[Exposable]:
        return self.families() if self.on else ()
