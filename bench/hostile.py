"""forewarn against a hostile IMDS (tests/peers/hostile_imds.py, raw sockets on loopback).

Four measures, each against a real `forewarn run` subprocess with a file sink and 1 s polls:
- memory: one collector gets hostile replies one after another, each for a few seconds: a 50 MB
  Content-Length body, an endless chunked body, 4 MiB of `{},`, JSON nested 100,000 deep, huge integers,
  lone surrogates (a 3.9 MB description of them), a reply trickled a byte every 0.2 s. The peak RSS of
  each is VmHWM from /proc/PID/status, reset before it starts (clear_refs), with VmRSS also sampled every
  20 ms. After each: the process is alive, /metrics answers, and a new valid event reaches the file sink.
- stop: IMDS reads the request and never answers, on the first call (120 s deadline) and on a
  steady-state poll (--imds-timeout 60, so the deadline cannot be what ends it); time from SIGTERM to
  the process's exit, taken from a pidfd.
- blind: 20 s of 500s, of 410s, of connection resets; then, 50 ms after the next failed poll (the worst
  phase), IMDS serves a new event. Blind time is from the moment IMDS recovered to the event's record in
  the file sink (and, separately, its series on /metrics). Requests during the outage are counted at
  the peer.
- idle: RSS after 60 s of normal polling of the simulator's quiet scenario with the file sink, as
  bench/cost.py measures it, to compare with the figure in docs/performance.md.

    python bench/hostile.py [--quick]

`--quick`: 3 s per hostile reply, 2 repetitions of each stop and outage case, 20 s of idle polling.
Results are printed and written to bench/results/hostile.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import select
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

from forewarn.simulator import Simulator, SimulatorServer, load_scenario

from common import Collector, header, peak_rss_mib, reset_peak_rss, rss_mib, write_results
from peers.hostile_imds import Behaviour, Endless, Hang, HostileImds, Huge, Reply, Reset, Trickle, document, event

WARMUP = 5.0  # as bench/cost.py
#: RSS of the collector with the file sink at 1 poll/s, as docs/performance.md gives it ("idle RSS, file sink").
PUBLISHED_IDLE_RSS_MIB = 20.1
TIMEOUT = 20.0
BIG = "1" + "0" * 3999  # within Python's 4300-digit limit for int(), so it is really parsed


def hostile_replies() -> dict[str, Behaviour]:
    """The hostile replies of the memory run, in the order they are sent."""
    normal = json.dumps(event("H1"))
    huge = normal.replace('"DurationInSeconds": -1', f'"DurationInSeconds": {BIG}')
    padding = ",".join([BIG] * 900)
    surrogates = normal.replace('"H1"', '"\\ud800"').replace('"maintenance"', '"' + "\\udfff" * 650_000 + '"')
    return {
        "content-length 50 MB": Huge(50 * 1024 * 1024),
        "endless chunked body": Endless(),
        # Just under the 4 MiB cap, so the body is read in full and reaches the reply boundary.
        "4 MiB of {},": Reply(body=b'{"DocumentIncarnation": 2, "Events": ['
                              + b"{}," * ((4 * 1024 * 1024 - 64) // 3) + b"{}]}"),
        "nested 100,000 deep": Reply(body=b'{"DocumentIncarnation": 2, "Events": '
                                     + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        # A valid document whose event has a 4000-digit duration, beside 900 more such integers (3.6 MB).
        "huge integers": Reply(body=f'{{"DocumentIncarnation": 2, "Events": [{huge}], "Padding": [{padding}]}}'),
        # A lone-surrogate event id and a 3.9 MB description made of lone surrogate escapes.
        "lone surrogates": Reply(body=f'{{"DocumentIncarnation": 2, "Events": [{surrogates}]}}'),
        "trickled reply (1 byte / 0.2 s)": Trickle(json.dumps(document(2, event("H2"))).encode(), interval=0.2),
    }


def wait_for(condition: Callable[[], bool], timeout: float, what: str, step: float = 0.005) -> float:
    """Poll `condition` until it holds; the monotonic time it was first seen to hold."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return time.monotonic()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:g} s")
        time.sleep(step)


def log_tail(path: Path) -> str:
    """The end of a collector's log, printed when a phase fails (its temporary dir goes with it)."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-20:]) if path.exists() else "(no log)"


def in_file(path: Path, text: str) -> bool:
    return path.exists() and text.encode() in path.read_bytes()


def request_codes(url: str) -> dict[str, float]:
    """azure_scheduled_events_imds_requests_total for GET, by code (the collector's own classification)."""
    response = requests.get(url + "/metrics", timeout=2)
    response.raise_for_status()
    codes = {}
    for match in re.finditer(r'^azure_scheduled_events_imds_requests_total\{([^}]*)\} (\S+)$', response.text,
                             re.MULTILINE):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match[1]))
        if labels.get("method") == "GET":
            codes[labels.get("code", "")] = float(match[2])
    return codes


def metrics_ok(url: str) -> bool:
    try:
        response = requests.get(url + "/metrics", timeout=2)
    except requests.RequestException:
        return False
    return response.status_code == 200 and "azure_scheduled_events_imds_up" in response.text


class RssSampler:
    """VmRSS of `pid` every 20 ms, in a thread; `take()` returns the highest since the last take."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._peak = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                value = rss_mib(self.pid)
            except OSError:
                return
            with self._lock:
                self._peak = max(self._peak, value)

    def take(self) -> float:
        with self._lock:
            peak, self._peak = self._peak, 0.0
        return peak

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1)


def memory(seconds: float, workdir: Path) -> dict[str, Any]:
    imds = HostileImds(Reply(body=document(1, event("START"))))
    records = workdir / "records.jsonl"
    collector = Collector(imds.url, workdir / "state", 1.0, sinks=[f"file:{records}"], log=workdir / "memory.log")
    sampler = RssSampler(collector.pid)
    rows: dict[str, Any] = {}
    try:
        wait_for(lambda: in_file(records, '"START"'), TIMEOUT, "first event", 0.05)
        time.sleep(2)
        startup = {"peak_rss_mib": round(peak_rss_mib(collector.pid), 1), "rss_mib": round(rss_mib(collector.pid), 1)}
        incarnation = 10
        for name, behaviour in hostile_replies().items():
            before = request_codes(collector.url)
            sampler.take()
            at_start = rss_mib(collector.pid)  # what earlier replies left behind counts in this one's peak
            reset = reset_peak_rss(collector.pid)
            served = len(imds.events_requests())
            imds.behaviour = behaviour
            time.sleep(seconds)
            # At least two hostile requests, whatever the pace (a trickled reply holds a poll for 2 s).
            wait_for(lambda s=served: len(imds.events_requests()) >= s + 2, TIMEOUT, f"{name}: two requests", 0.05)
            hostile_requests = len(imds.events_requests()) - served
            incarnation += 1
            after_id = f"AFTER-{incarnation}"
            imds.behaviour = Reply(body=document(incarnation, event(after_id)))
            recovered = time.monotonic()
            alive = collector.proc.poll() is None
            answers = metrics_ok(collector.url)
            seen = wait_for(lambda a=after_id: in_file(records, f'"{a}"'), TIMEOUT, f"{name}: next event")
            codes = request_codes(collector.url)
            rows[name] = {
                "rss_at_start_mib": round(at_start, 1),
                "peak_rss_mib": round(peak_rss_mib(collector.pid), 1) if reset else None,
                "sampled_rss_max_mib": round(sampler.take(), 1),
                "hostile_requests": hostile_requests,
                "codes": {code: int(count - before.get(code, 0)) for code, count in sorted(codes.items())
                          if count - before.get(code, 0) > 0},
                "alive": alive and collector.proc.poll() is None,
                "metrics_answer": answers,
                "next_event_s": round(seen - recovered, 2),
            }
            print(f"memory, {name}: {rows[name]}", flush=True)
        time.sleep(10)
        peak = max([startup["peak_rss_mib"]] + [row["peak_rss_mib"] or row["sampled_rss_max_mib"]
                                                for row in rows.values()])
        return {"seconds_each": seconds, "peak_reset_per_reply": all(r["peak_rss_mib"] is not None
                                                                     for r in rows.values()),
                "startup": startup, "replies": rows, "overall_peak_rss_mib": peak,
                "rss_10_s_after_mib": round(rss_mib(collector.pid), 1),
                "exit_code": collector.stop()}
    except RuntimeError:
        print(log_tail(workdir / "memory.log"), flush=True)
        raise
    finally:
        sampler.stop()
        if collector.proc.poll() is None:
            collector.kill()
        imds.stop()


def stop_once(first: bool, workdir: Path) -> float:
    """Seconds from SIGTERM to exit while a Scheduled Events request hangs."""
    imds = HostileImds(Hang() if first else Reply(body=document(1)))
    collector = Collector(imds.url, workdir / "state", 1.0, sinks=[f"file:{workdir / 'records.jsonl'}"],
                          extra=["--imds-timeout", "60"], wait=not first, log=workdir / "stop.log")
    try:
        if not first:
            wait_for(lambda: len(imds.events_requests()) >= 2, TIMEOUT, "two good polls", 0.05)
            imds.behaviour = Hang()
        hung = len(imds.events_requests()) if not first else 0
        wait_for(lambda: len(imds.events_requests()) > hung, TIMEOUT, "a request to hang on", 0.01)
        # Well into the hang, at a random phase of the client's 0.25 s read slices.
        time.sleep(random.uniform(0.5, 1.5))
        pidfd = os.pidfd_open(collector.pid)
        try:
            started = time.monotonic()
            collector.proc.send_signal(signal.SIGTERM)
            ready, _, _ = select.select([pidfd], [], [], 30)
            elapsed = time.monotonic() - started
        finally:
            os.close(pidfd)
        if not ready:
            raise RuntimeError("the collector did not exit within 30 s of SIGTERM")
        code = collector.proc.wait(5)
        if code != 0:
            raise RuntimeError(f"the collector exited with {code} on SIGTERM")
        return elapsed
    except RuntimeError:
        print(log_tail(workdir / "stop.log"), flush=True)
        raise
    finally:
        if collector.proc.poll() is None:
            collector.kill()
        imds.stop()


def stop(repetitions: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, first in (("first call", True), ("steady-state poll", False)):
        times = []
        for _ in range(repetitions):
            with tempfile.TemporaryDirectory() as tmp:
                times.append(stop_once(first, Path(tmp)))
        out[label] = {"median_s": round(statistics.median(times), 3), "max_s": round(max(times), 3),
                      "samples_s": [round(t, 3) for t in times]}
        print(f"stop, {label}: {out[label]}", flush=True)
    return out


def most_in_any_second(times: list[float]) -> int:
    ordered = sorted(times)
    return max((sum(1 for t in ordered[i:] if t < start + 1.0) for i, start in enumerate(ordered)), default=0)


def outage(kind: str, behaviour: Behaviour, repetitions: int, seconds: float, workdir: Path) -> dict[str, Any]:
    imds = HostileImds(Reply(body=document(1)))
    records = workdir / "records.jsonl"
    collector = Collector(imds.url, workdir / "state", 1.0, sinks=[f"file:{records}"], log=workdir / "outage.log")
    session = requests.Session()
    runs = []
    try:
        for rep in range(repetitions):
            good = len(imds.events_requests())
            wait_for(lambda g=good: len(imds.events_requests()) >= g + 3, TIMEOUT, "three good polls", 0.05)
            imds.behaviour = behaviour
            began = time.monotonic()
            time.sleep(seconds)
            # IMDS recovers just after a failed poll, the worst moment: the collector waits a whole pause.
            # 50 ms lets the peer answer that request with the outage before the answer changes.
            failed = len(imds.events_requests())
            wait_for(lambda f=failed: len(imds.events_requests()) > f, TIMEOUT, "a failed poll", 0.002)
            time.sleep(0.05)
            name = f"BLIND-{kind}-{rep}"
            imds.behaviour = Reply(body=document(100 + rep, event(name, event_type="Preempt")))
            recovered = time.monotonic()
            seen: dict[str, float] = {}
            while len(seen) < 2:
                now = time.monotonic()
                if now - recovered > TIMEOUT:
                    raise RuntimeError(f"{kind}: {name} not reported within {TIMEOUT:g} s ({sorted(seen)})")
                if "file" not in seen and in_file(records, f'"{name}"'):
                    seen["file"] = time.monotonic()
                if "metric" not in seen and f'event_id="{name}"' in session.get(collector.url + "/metrics").text:
                    seen["metric"] = time.monotonic()
                time.sleep(0.005)
            requests_at = [r.at for r in imds.events_requests()]
            during = [t for t in requests_at if began <= t < recovered]
            runs.append({"blind_file_s": seen["file"] - recovered, "blind_metric_s": seen["metric"] - recovered,
                         "first_request_after_s": min(t for t in requests_at if t >= recovered) - recovered,
                         "requests_per_s": len(during) / (recovered - began),
                         "most_in_any_second": most_in_any_second(during)})
            print(f"outage {kind} #{rep + 1}: {runs[-1]}", flush=True)
        exit_code = collector.stop()
    except RuntimeError:
        print(log_tail(workdir / "outage.log"), flush=True)
        raise
    finally:
        if collector.proc.poll() is None:
            collector.kill()
        imds.stop()

    def stats(key: str) -> dict[str, float]:
        values = [run[key] for run in runs]
        return {"median_s": round(statistics.median(values), 3), "max_s": round(max(values), 3)}

    return {"outage_s": seconds, "repetitions": repetitions, "blind_file": stats("blind_file_s"),
            "blind_metric": stats("blind_metric_s"), "first_request_after": stats("first_request_after_s"),
            "requests_per_s_max": round(max(run["requests_per_s"] for run in runs), 2),
            "most_in_any_second": max(run["most_in_any_second"] for run in runs), "exit_code": exit_code,
            "runs": [{k: round(v, 3) if isinstance(v, float) else v for k, v in run.items()} for run in runs]}


def idle(seconds: float) -> dict[str, Any]:
    sim = Simulator(load_scenario("quiet"))
    server = SimulatorServer(sim).serve_in_background()
    with tempfile.TemporaryDirectory() as tmp:
        collector = Collector(server.url, Path(tmp) / "state", 1.0, sinks=[f"file:{tmp}/records.jsonl"])
        try:
            time.sleep(WARMUP + seconds)
            rss = rss_mib(collector.pid)
            out = {"seconds": seconds, "rss_mib": round(rss, 1), "peak_rss_mib": round(peak_rss_mib(collector.pid), 1),
                   "published_rss_mib": PUBLISHED_IDLE_RSS_MIB,
                   "difference_mib": round(rss - PUBLISHED_IDLE_RSS_MIB, 1)}
        finally:
            collector.stop()
            server.stop()
    print(f"idle: {out}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter phases and fewer repetitions (a smoke run)")
    args = parser.parse_args()
    random.seed(12)
    repetitions = 2 if args.quick else 5
    results: dict[str, Any] = header() | {"quick": args.quick, "load_average_at_start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        results["memory"] = memory(3.0 if args.quick else 8.0, Path(tmp))
    results["stop"] = stop(repetitions)
    results["outage"] = {}
    for kind, behaviour in (("500", Reply(status=500, body=b"{}")), ("410", Reply(status=410, body=b"{}")),
                            ("reset", Reset())):
        with tempfile.TemporaryDirectory() as tmp:
            results["outage"][kind] = outage(kind, behaviour, repetitions, 20.0, Path(tmp))
    results["idle"] = idle(20.0 if args.quick else 60.0)
    results["load_average_at_end"] = os.getloadavg()
    write_results("hostile", results)


if __name__ == "__main__":
    main()
