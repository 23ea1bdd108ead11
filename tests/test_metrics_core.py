"""forewarn.metrics.core writes the exposition itself: the same text prometheus-client writes for the same
metrics, in both formats, and parsed back by both of its parsers."""

from __future__ import annotations

import math
import threading

import pytest
from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client import Counter as ClientCounter
from prometheus_client import Gauge as ClientGauge
from prometheus_client import Histogram as ClientHistogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.exposition import generate_latest as client_text
from prometheus_client.openmetrics.exposition import generate_latest as client_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from forewarn.metrics.core import (
    OPENMETRICS,
    TEXT,
    Counter,
    Family,
    Gauge,
    GaugeChild,
    Histogram,
    Registry,
    negotiate,
    number,
)

disable_created_metrics()  # type: ignore[no-untyped-call]  # forewarn writes no _created series

HOSTILE = ['plain', 'with "quotes"', "back\\slash", "new\nline", "ünïcödé ✓", "", "trailing\\"]
VALUES = [0, 1, 0.5, -3, 1234567.0, 1732431234.567, 1e22, 3e-9, math.inf, -math.inf]


class _Families:
    """A scrape-time collector for prometheus-client and for forewarn: the same families, built by each."""

    def __init__(self, family_type: type) -> None:
        self.family_type = family_type

    def collect(self):  # type: ignore[no-untyped-def]
        if self.family_type is Family:
            gauge = Family("zeta_gauge", 'Help with "quotes", back\\slash\nand a new line.',
                           labels=["zone", "alpha", "m"])
            counter = Family("beta_things_total", "Things.", labels=["kind"], kind="counter")
            single = Family("single_value", "One value.", value=42)
        else:
            gauge = GaugeMetricFamily("zeta_gauge", 'Help with "quotes", back\\slash\nand a new line.',
                                      labels=["zone", "alpha", "m"])
            counter = CounterMetricFamily("beta_things", "Things.", labels=["kind"])
            single = GaugeMetricFamily("single_value", "One value.", value=42)
        ours = self.family_type is Family
        for i, text in enumerate(HOSTILE):
            (gauge.add if ours else gauge.add_metric)([text, str(i), "x"], VALUES[i % len(VALUES)])
        for i, value in enumerate(VALUES):
            (counter.add if ours else counter.add_metric)([f"k{i}"], abs(value))
        yield gauge
        yield counter
        yield single


def _both() -> tuple[CollectorRegistry, Registry]:
    theirs, ours = CollectorRegistry(auto_describe=False), Registry()
    for registry, counter, gauge, histogram in ((theirs, ClientCounter, ClientGauge, ClientHistogram),
                                                (ours, Counter, Gauge, Histogram)):
        requests = counter("app_requests_total", "Requests by method and code.", ["method", "code"],
                           registry=registry)
        for method, code in (("GET", "200"), ("POST", "500"), ("GET", "error")):
            requests.labels(method, code).inc(3)
        requests.labels("PUT", 'we"ird\\').inc(0.25)
        errors = counter("app_errors_total", "Errors.", registry=registry)
        errors.inc()
        errors.inc(2)
        ready = gauge("app_ready", "Ready or not.", registry=registry)
        ready.set(1)
        temperature = gauge("app_temperature_celsius", "Several temperatures.", ["room"], registry=registry)
        for value, room in zip(VALUES, HOSTILE, strict=False):
            temperature.labels(room).set(value)
        latency = histogram("app_latency_seconds", "Latency.", ["method", "a"], registry=registry,
                            buckets=(0.005, 0.01, 0.1, 1, 2.5, 10))
        for amount in (0.001, 0.005, 0.05, 0.5, 3, 50, 0.2):
            latency.labels("GET", "z").observe(amount)
        latency.labels("POST", "y")
        bare = histogram("app_bare_seconds", "Without labels.", registry=registry, buckets=(1, 2))
        bare.observe(1.5)
        registry.register(_Families(GaugeMetricFamily if registry is theirs else Family))  # type: ignore[arg-type]
    return theirs, ours


def test_the_text_format_is_prometheus_clients_byte_for_byte() -> None:
    theirs, ours = _both()
    assert ours.render(openmetrics=False) == client_text(theirs)


def test_openmetrics_is_prometheus_clients_byte_for_byte() -> None:
    theirs, ours = _both()
    assert ours.render(openmetrics=True) == client_openmetrics(theirs)


def test_both_parsers_read_every_value_back() -> None:
    _, ours = _both()
    text = {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parse_text(ours.render(False).decode()) for s in family.samples}
    om = {(s.name, tuple(sorted(s.labels.items()))): s.value
          for family in parse_openmetrics(ours.render(True).decode()) for s in family.samples}
    assert text == om
    assert text[("app_requests_total", (("code", "we\"ird\\"), ("method", "PUT")))] == 0.25
    assert text[("zeta_gauge", (("alpha", "3"), ("m", "x"), ("zone", "new\nline")))] == -3
    assert text[("app_latency_seconds_bucket", (("a", "z"), ("le", "+Inf"), ("method", "GET")))] == 7
    assert text[("app_latency_seconds_count", (("a", "y"), ("method", "POST")))] == 0


def test_a_scrape_after_a_change_shows_the_change() -> None:
    """The text of a metric is reused while nothing changed; a change (up, or a gauge back to an earlier
    value) must show at the next scrape."""
    registry = Registry()
    gauge = Gauge("g", "A gauge.", ["k"], registry=registry)
    counter = Counter("c_total", "A counter.", registry=registry)
    histogram = Histogram("h_seconds", "A histogram.", registry=registry, buckets=(1,))
    child = gauge.labels("a")
    for value in (1, 2, 1, 1, 7):
        child.set(value)
        counter.inc()
        histogram.observe(value)
        assert registry.get_sample_value("g", {"k": "a"}) == value
    assert registry.get_sample_value("c_total") == 5
    assert registry.get_sample_value("h_seconds_bucket", {"le": "1.0"}) == 3
    assert registry.get_sample_value("h_seconds_count") == 5
    gauge.labels("b")
    assert registry.get_sample_value("g", {"k": "b"}) == 0


def test_scrapes_racing_with_changes_never_keep_a_stale_text() -> None:
    """Each scrape reuses a metric's text only when no series changed since it was written: with changes
    made from other threads while scrapes run, the scrape after the last change shows every one of them."""
    registry = Registry()
    counter = Counter("hits_total", "Hits.", ["who"], registry=registry)
    histogram = Histogram("wait_seconds", "Waits.", registry=registry, buckets=(1,))

    def hit(who: str) -> None:
        for _ in range(20000):
            counter.labels(who).inc()
            histogram.observe(0.5)

    threads = [threading.Thread(target=hit, args=(who,)) for who in ("a", "b", "c")]
    for thread in threads:
        thread.start()
    scrapes = 0
    while any(thread.is_alive() for thread in threads):
        registry.render()
        scrapes += 1
    assert scrapes > 1
    text = registry.render().decode()
    for who in ("a", "b", "c"):
        assert registry.get_sample_value("hits_total", {"who": who}) == 20000
    assert 'wait_seconds_bucket{le="1.0"} 60000' in text and "wait_seconds_count 60000" in text


def test_a_change_made_while_a_scrape_reads_the_values_shows_at_the_next_scrape() -> None:
    """The moment that decides a text's reuse is taken before the values are read: a change that lands
    while they are read (here, made by reading the second series) is not hidden behind the old text."""
    registry = Registry()
    first: list[GaugeChild] = []

    class ChangesFirst(GaugeChild):
        __slots__ = ()

        def state(self) -> object:
            first[0].set(5)  # as another thread would, between the reads of the two series
            return super().state()

    class Racing(Gauge):
        def _new(self, values: tuple[str, ...]) -> GaugeChild:
            kind = GaugeChild if not self._children else ChangesFirst
            return kind(f"{self.name}{self._labels.text(values)} ", self._changed)

    gauge = Racing("racing", "A gauge changed during a scrape.", ["k"], registry=registry)
    first.append(gauge.labels("a"))
    gauge.labels("b")
    assert 'racing{k="a"} 0.0' in registry.render().decode()
    assert 'racing{k="a"} 5.0' in registry.render().decode()


def test_counters_from_many_threads_lose_no_increment() -> None:
    registry = Registry()
    counter = Counter("hits_total", "Hits.", ["who"], registry=registry)

    def hit() -> None:
        for _ in range(5000):
            counter.labels("x").inc()

    threads = [threading.Thread(target=hit) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert registry.get_sample_value("hits_total", {"who": "x"}) == 40000


def test_mistakes_are_refused() -> None:
    with pytest.raises(ValueError, match="_total"):
        Counter("hits", "No suffix.")
    counter = Counter("hits_total", "Hits.", ["who"])
    with pytest.raises(ValueError, match="1 label values, got 2"):
        counter.labels("a", "b")
    with pytest.raises(ValueError, match="only goes up"):
        counter.labels("a").inc(-1)
    with pytest.raises(ValueError, match="has no labels"):
        Counter("plain_total", "No labels.").labels("a")


@pytest.mark.parametrize("accept", [
    "",
    "*/*",
    "text/plain",
    "text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    # Prometheus 2's header
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "application/openmetrics-text",
    "application/openmetrics-text; version=0.0.1",
    "application/openmetrics-text; version=1.0.0; charset=utf-8",
])
def test_the_format_is_chosen_as_prometheus_client_chooses(accept: str) -> None:
    openmetrics, content_type = negotiate(accept)
    _, theirs = choose_encoder(accept)
    assert content_type == (OPENMETRICS if openmetrics else TEXT)
    assert theirs.split(";")[0] == content_type.split(";")[0]


def test_prometheus_3_gets_the_classic_text_format() -> None:
    # Prometheus 3 asks for text/plain 1.0.0 with UTF-8 names allowed; every name here is a classic one,
    # and 0.0.4 is the format Prometheus falls back to.
    assert negotiate("text/plain;version=1.0.0;escaping=allow-utf-8;q=0.5,*/*;q=0.1") == (False, TEXT)


@pytest.mark.parametrize("value", [0.0, 1.0, -2.5, 0.1, 123456.0, 1234567.0, 1e7, 1732431234.567, 1e22, 2.5e-12,
                                   math.inf, -math.inf])
def test_numbers_are_written_as_go_writes_them(value: float) -> None:
    from prometheus_client.utils import floatToGoString
    assert number(value) == floatToGoString(value)
    assert number(math.nan) == "NaN"
