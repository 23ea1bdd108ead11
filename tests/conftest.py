"""Shared helpers: a simulator on loopback, the collector as a real subprocess, metric parsing."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from forewarn.simulator import Simulator, SimulatorServer, load_scenario
from forewarn.simulator.scenarios import Scenario, parse_scenario

pytest_plugins = ["pytester"]  # tests/test_temp_guard.py runs the guard below in a pytest of its own

#: Names in the guarded temp dir that are pytest's own (a --basetemp left at its default lives elsewhere).
PYTEST_OWNED = ("pytest-of-",)


@pytest.fixture(scope="session", autouse=True)
def temp_dir_guard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point TMPDIR and tempfile at a fresh directory for the session; fail the session if a test (or a
    process it started) leaves anything there. Tests keep their files under tmp_path, which stays outside."""
    import shutil
    import tempfile

    tmp_path_factory.getbasetemp()  # created now, in the real temp dir, so tmp_path is never under the guard
    guarded = Path(tempfile.mkdtemp(prefix="forewarn-tests-"))
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = str(guarded)
    try:
        yield guarded
    finally:
        if saved[0] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved[0]
        tempfile.tempdir = saved[1]
        left = sorted(path.name for path in guarded.iterdir() if not path.name.startswith(PYTEST_OWNED))
        shutil.rmtree(guarded, ignore_errors=True)
    if left:
        pytest.fail(f"tests left {len(left)} item(s) in the temp dir (keep files under tmp_path): "
                    + ", ".join(left), pytrace=False)


def require_tool(name: str, installed_by: str) -> str:
    """A tool's path; skips locally when it is missing, but fails in CI, where scripts/test installs it."""
    import shutil

    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing in CI: scripts/test installs it ({installed_by})")
        pytest.skip(f"{name} not installed ({installed_by})")
    return path


def require_promtool() -> str:
    return require_tool("promtool", "Debian package prometheus")


def load_script(name: str) -> ModuleType:
    """A script of scripts/ (not a package) as a module, for the tests of what it generates or checks."""
    path = Path(__file__).parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05,
               message: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {message} (last: {last!r})")


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples keyed by (name, sorted labels)."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def sample(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def series(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> list[dict[str, str]]:
    return [dict(labels) for (n, labels) in samples if n == name]


def outbox_backlog(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> float:
    """Records waiting for delivery, over every sink (0 once everything was delivered)."""
    return sum(value for (name, _), value in samples.items() if name == "azure_scheduled_events_outbox_records")


def wait_for_polls(proc: CollectorProcess, count: int = 3) -> None:
    """Wait until `proc` has made `count` more good polls: the way to check that something did NOT happen,
    since whatever the collector (or its approver) would do about the current document it does within a poll."""
    def polls() -> float:
        return sample(proc.metrics(), "azure_scheduled_events_imds_requests_total", method="GET", code="200") or 0

    target = polls() + count
    wait_until(lambda: polls() >= target, timeout=10 + count * 2, message=f"{count} more polls")


def wait_settled(proc: CollectorProcess, count: int = 2) -> None:
    """Wait for `count` more polls and then for every sink to have taken every record."""
    wait_for_polls(proc, count)
    wait_until(lambda: outbox_backlog(proc.metrics()) == 0, timeout=20, message="an empty outbox")


class SimulatorHandle:
    def __init__(self, scenario: Scenario | str, speed: float = 1.0, **kwargs: Any) -> None:
        if isinstance(scenario, str):
            scenario = load_scenario(scenario)
        self.sim = Simulator(scenario, speed=speed, **kwargs)
        self.server = SimulatorServer(self.sim).serve_in_background()
        self.url = self.server.url

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def simulator() -> Iterator[Callable[..., SimulatorHandle]]:
    handles: list[SimulatorHandle] = []

    def start(scenario: Scenario | str | dict[str, Any] = "quiet", speed: float = 1.0,
              **kwargs: Any) -> SimulatorHandle:
        if isinstance(scenario, dict):
            scenario = parse_scenario(scenario)
        handle = SimulatorHandle(scenario, speed, **kwargs)
        handles.append(handle)
        return handle

    yield start
    for handle in handles:
        handle.stop()


class CollectorProcess:
    """`forewarn run` as a subprocess with a file sink, on a free loopback port."""

    def __init__(self, endpoint: str, state_dir: Path, *extra: str, poll_interval: float = 0.3,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.state_dir = state_dir
        self.records_path = state_dir.parent / f"{state_dir.name}-records.jsonl"
        self.log_path = state_dir.parent / f"{state_dir.name}-{self.port}.log"
        self.args = [sys.executable, "-m", "forewarn", "run", "--imds-endpoint", endpoint,
                     "--listen-address", f"127.0.0.1:{self.port}", "--state-dir", str(state_dir),
                     "--sink", f"file:{self.records_path}", "--poll-interval", str(poll_interval), *extra]
        # A crash in native code (exit -11) leaves the Python stacks of every thread in the log.
        self.env = {**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait_ready: bool = True) -> CollectorProcess:
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=self._log, env=self.env)
        if wait_ready:
            wait_until(self.ready, 20, message="collector /readyz")
        else:
            wait_until(self.alive, 20, message="collector /healthz")
        return self

    def alive(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"collector exited with {self.proc.returncode}:\n{self.log()}")
        try:
            return requests.get(self.url + "/healthz", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def ready(self) -> bool:
        if not self.alive():
            return False
        return requests.get(self.url + "/readyz", timeout=1).status_code == 200

    def metrics_text(self) -> str:
        response = requests.get(self.url + "/metrics", timeout=2)
        response.raise_for_status()
        return response.text

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return parse_metrics(self.metrics_text())

    def records(self) -> list[dict[str, Any]]:
        if not self.records_path.exists():
            return []
        return [json.loads(line) for line in self.records_path.read_text().splitlines() if line.strip()]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(15)
        self._log.close()
        return code

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)
        self._log.close()


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[Callable[..., CollectorProcess]]:
    started: list[CollectorProcess] = []

    def start(endpoint: str, *extra: str, name: str = "state", wait_ready: bool = True,
              **kwargs: Any) -> CollectorProcess:
        proc = CollectorProcess(endpoint, tmp_path / name, *extra, **kwargs).start(wait_ready=wait_ready)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.kill()


def agent_ledger(node: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The per-VM agent's entries of a node's forewarn.io/applied ledger, by event id, without the owner fields
    (`event`, `by`). Every entry must be keyed `{EventId}@agent` and name the agent: the per-VM agent writes no
    other."""
    import json

    text = ((node.get("metadata") or {}).get("annotations") or {}).get("forewarn.io/applied")
    entries: dict[str, dict[str, Any]] = {}
    for key, entry in (json.loads(text) if text else {}).items():
        event_id, _, owner = key.partition("@")
        assert owner == "agent" and entry.get("by") == "agent" and entry.get("event") == event_id, (key, entry)
        entries[event_id] = {kind: held for kind, held in entry.items() if kind not in ("event", "by")}
    return entries
