"""Deploy files for VMs: the systemd unit verifies and is hardened."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from conftest import require_tool

UNIT = Path(__file__).parent.parent / "deploy" / "systemd" / "forewarn.service"


def unit_with_exec(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at this environment's forewarn, as verify checks that it exists."""
    binary = shutil.which("forewarn")
    assert binary is not None, "forewarn is installed in the test environment"
    unit = tmp_path / "forewarn.service"
    unit.write_text(UNIT.read_text().replace("/opt/forewarn/bin/forewarn", binary))
    return unit


def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    analyze = require_tool("systemd-analyze", "Debian package systemd")
    result = subprocess.run([analyze, "verify", str(unit_with_exec(tmp_path))], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


def test_unit_is_hardened(tmp_path: Path) -> None:
    analyze = require_tool("systemd-analyze", "Debian package systemd")
    text = UNIT.read_text()
    for setting in ("DynamicUser=yes", "StateDirectory=forewarn", "ProtectSystem=strict", "NoNewPrivileges=yes",
                    "CapabilityBoundingSet=", "PrivateTmp=yes", "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX"):
        assert re.search(rf"^{re.escape(setting)}$", text, re.MULTILINE), setting
    result = subprocess.run([analyze, "security", "--offline=yes", str(unit_with_exec(tmp_path))],
                            capture_output=True, text=True, timeout=60)
    score = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
    assert score is not None, result.stdout + result.stderr
    assert float(score.group(1)) <= 2.0, "systemd rates the unit's exposure as low"
