"""The README's two quick starts ("Try it without Azure"), run as the README writes them: the `forewarn ...`
part of each command line is read from README.md, so a change to the README is what is tested. Only the
listen address differs (FOREWARN_LISTEN_ADDRESS=127.0.0.1:0, so a test never takes port 9465), and the tour
is stopped once its first record is out and /metrics has answered."""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import requests

from conftest import wait_until

ROOT = Path(__file__).parent.parent
#: Where the README's commands expect forewarn: the .venv its own first steps create.
README_FOREWARN = ".venv/bin/forewarn"


def quick_starts() -> dict[str, list[str]]:
    """The command each sh block of the README's "Try it without Azure" paragraphs ends with, by subcommand:
    the part after the last `&&` (the steps before it create .venv and install forewarn, which the test
    environment has done)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("**Try it without Azure**", 1)[1].split("\n**", 1)[0]
    found: dict[str, list[str]] = {}
    for block in re.findall(r"^```sh\n(.*?)^```", section, re.MULTILINE | re.DOTALL):
        (line,) = block.strip().splitlines()
        argv = shlex.split(line.rsplit("&&", 1)[-1])
        assert argv[0] == README_FOREWARN, line
        found[argv[1]] = argv
    return found


def test_the_readme_has_a_quick_start_for_each_mode() -> None:
    commands = quick_starts()
    assert sorted(commands) == ["fleet", "run"]
    assert all("--simulate" in argv for argv in commands.values())


def next_line(stream: queue.Queue[str | None], timeout: float) -> str:
    line = stream.get(timeout=timeout)
    assert line is not None, "standard output closed before the first record"
    return line


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["run", "fleet"])
def test_the_quick_start_prints_records_and_serves_metrics(mode: str, tmp_path: Path) -> None:
    argv = quick_starts()[mode]
    forewarn = Path(sys.executable).parent / "forewarn"   # the installed one, as .venv/bin/forewarn in the README
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("FOREWARN_")}
    env["FOREWARN_LISTEN_ADDRESS"] = "127.0.0.1:0"
    log = tmp_path / "stderr.log"
    with log.open("wb") as stderr:
        proc = subprocess.Popen([str(forewarn), *argv[1:]], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=stderr, text=True)
    assert proc.stdout is not None
    stdout: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            stdout.put(line)
        stdout.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        # the tour's first change is out within about a second of start (run) or of the first snapshot (fleet)
        record = json.loads(next_line(stdout, timeout=10))
        assert record["specversion"] == "1.0" and record["type"] == "io.github.forewarn.scheduled_event.added"
        event_id = record["data"]["event"]["EventId"]
        url = wait_until(lambda: re.search(r"metrics on (http://127\.0\.0\.1:\d+/metrics)", log.read_text()),
                         message="the log line naming the metrics address")[1]
        reply = requests.get(url, timeout=5)
        assert reply.status_code == 200
        assert "azure_scheduled_events_build_info{" in reply.text
        assert f'event_id="{event_id}"' in reply.text, "the first record's event in /metrics"
    finally:
        proc.terminate()
        code = proc.wait(15)
    assert code == 0, log.read_text()
