"""Pay only for what is configured: an agent with a file sink and no policy loads no policy engine,
no YAML, no jsonschema and no requests, and neither ssl nor the HTTP and email modules of the standard
library (6 MiB of resident memory together; IMDS and the web server speak HTTP through forewarn's own
code); a policy brings the approval engine in."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from conftest import SimulatorHandle, free_port

PROBE = """
import os, re, signal, socket, sys, threading, time

def polls():
    # A bare socket: urllib would load the very modules this probe looks for.
    host, port = '{listen}'.rsplit(':', 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1) as sock:
            sock.sendall(b'GET /metrics HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n')
            data = b''
            while chunk := sock.recv(65536):
                data += chunk
        text = data.decode()
    except OSError:
        return 0
    found = re.search(r'azure_scheduled_events_imds_requests_total[{{][^}}]*code="200"[^}}]*[}}] (\\S+)', text)
    return float(found.group(1)) if found else 0

def report():
    deadline = time.monotonic() + 30
    while polls() < 2 and time.monotonic() < deadline:  # two whole polls: everything a poll uses is loaded
        time.sleep(0.05)
    loaded = sorted(m for m in sys.modules
                    if m.split('.')[0] in ('yaml', 'jsonschema', 'requests', 'ssl', 'email')
                    or m in ('http.client', 'http.server') or m.startswith('forewarn.approval'))
    print(polls(), ','.join(loaded), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=report, daemon=True).start()
from forewarn.cli import main
sys.exit(main({args!r}))
"""


def loaded_by_run(*extra: str, url: str, tmp_path: Path) -> set[str]:
    listen = f"127.0.0.1:{free_port()}"
    args = ["run", "--imds-endpoint", url, "--listen-address", listen, "--state-dir",
            str(tmp_path / "state"), "--sink", f"file:{tmp_path / 'records.jsonl'}", "--poll-interval", "0.3", *extra]
    result = subprocess.run([sys.executable, "-c", PROBE.format(args=args, listen=listen)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    polls, _, loaded = result.stdout.strip().partition(" ")
    assert float(polls) >= 2, f"the agent made {polls} good polls in 30 s:\n{result.stderr}"
    return {name for name in loaded.split(",") if name}


def test_an_agent_without_a_policy_loads_no_policy_engine_yaml_requests_ssl_or_email(
        simulator: Callable[..., SimulatorHandle], tmp_path: Path) -> None:
    assert loaded_by_run(url=simulator("quiet").url, tmp_path=tmp_path) == set()


def test_a_policy_loads_the_approval_engine(simulator: Callable[..., SimulatorHandle], tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("rules:\n  - name: hold-everything\n    action: hold\n")
    loaded = loaded_by_run("--policy", str(policy), url=simulator("quiet").url, tmp_path=tmp_path)
    assert {"forewarn.approval.approver", "forewarn.approval.policy", "jsonschema", "yaml"} <= loaded

