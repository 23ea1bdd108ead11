"""Pay only for what is configured: an agent with a file sink and no policy loads no policy engine,
no YAML, no jsonschema and no requests; a policy brings them in."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from conftest import SimulatorHandle, free_port

PROBE = """
import os, signal, sys, threading, time

def report():
    time.sleep(2.5)  # the agent is polling by now
    loaded = sorted(m for m in sys.modules
                    if m.split('.')[0] in ('yaml', 'jsonschema', 'requests') or m.startswith('forewarn.approval'))
    print(','.join(loaded), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=report, daemon=True).start()
from forewarn.cli import main
sys.exit(main({args!r}))
"""


def loaded_by_run(*extra: str, url: str, tmp_path: Path) -> set[str]:
    args = ["run", "--imds-endpoint", url, "--listen-address", f"127.0.0.1:{free_port()}", "--state-dir",
            str(tmp_path / "state"), "--sink", f"file:{tmp_path / 'records.jsonl'}", *extra]
    result = subprocess.run([sys.executable, "-c", PROBE.format(args=args)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return {name for name in result.stdout.strip().split(",") if name}


def test_an_agent_without_a_policy_loads_no_policy_engine_yaml_or_requests(
        simulator: Callable[..., SimulatorHandle], tmp_path: Path) -> None:
    assert loaded_by_run(url=simulator("quiet").url, tmp_path=tmp_path) == set()


def test_a_policy_loads_the_approval_engine(simulator: Callable[..., SimulatorHandle], tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("rules:\n  - name: hold-everything\n    action: hold\n")
    loaded = loaded_by_run("--policy", str(policy), url=simulator("quiet").url, tmp_path=tmp_path)
    assert {"forewarn.approval.approver", "forewarn.approval.policy", "jsonschema", "yaml"} <= loaded
