"""Deploy files for VMs: the systemd unit verifies and is hardened."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

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


CLOUD_INIT = Path(__file__).parent.parent / "deploy" / "cloud-init" / "scale-set.yaml"


def test_cloud_init_example_is_valid_and_installs_the_same_unit() -> None:
    import yaml

    tool = require_tool("cloud-init", "Debian package cloud-init")
    result = subprocess.run([tool, "schema", "--config-file", str(CLOUD_INIT)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "Valid cloud-config" in result.stdout, result.stdout + result.stderr
    config = yaml.safe_load(CLOUD_INIT.read_text())
    files = {f["path"]: f["content"] for f in config["write_files"]}
    assert files["/etc/systemd/system/forewarn.service"] == UNIT.read_text()
    assert ["systemctl", "enable", "--now", "forewarn.service"] in config["runcmd"]
    install = next(cmd for cmd in config["runcmd"] if "install" in cmd)
    assert install[0] == "/opt/forewarn/bin/pip" and "ExecStart=/opt/forewarn/bin/forewarn run" in UNIT.read_text()


POSIX_ONLY = {"geteuid", "getuid", "getgid", "fork", "setsid", "killpg", "getpwnam", "SIGHUP", "SIGKILL",
              "SIGUSR1", "SIGUSR2", "SIGALRM", "SO_LINGER"}
POSIX_MODULES = {"fcntl", "pwd", "grp", "resource", "termios"}


def test_the_agent_avoids_posix_only_calls_outside_guards() -> None:
    """The collector must run on Windows: POSIX-only names appear only behind a guard on the same line."""
    import ast

    src = Path(__file__).parent.parent / "src" / "forewarn"
    findings = []
    for path in src.rglob("*.py"):
        if "simulator" in path.parts:
            continue  # a test and demo tool, not the agent
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in POSIX_ONLY:
                line = lines[node.lineno - 1]
                if "hasattr(" not in line and 'os.name == "posix"' not in line:
                    findings.append(f"{path.name}:{node.lineno}: {node.attr}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                findings += [f"{path.name}:{node.lineno}: import {name}" for name in names
                             if name.split(".")[0] in POSIX_MODULES]
    assert findings == []


WINDOWS_SCRIPT = Path(__file__).parent.parent / "deploy" / "windows" / "install-forewarn.ps1"


# What the script calls: cmdlets that ship with Windows PowerShell 5.1 on Windows Server 2016 and later
# (Microsoft.PowerShell.*, NetSecurity, the service cmdlets) and icacls. A misspelt or foreign command
# would only fail on the user's machine.
WINDOWS_COMMANDS = {"Get-Command", "Get-NetFirewallRule", "Get-Service", "Join-Path", "New-Item",
                    "New-NetFirewallRule", "New-Object", "Out-Null", "Start-Service", "Write-Host", "icacls"}


def powershell_tree(source: bytes) -> Any:
    import tree_sitter_powershell
    from tree_sitter import Language, Parser

    return Parser(Language(tree_sitter_powershell.language())).parse(source)


def test_windows_script_parses_as_powershell() -> None:
    """PowerShell cannot run here; a PowerShell grammar (tree-sitter) parses the script instead."""
    source = WINDOWS_SCRIPT.read_bytes()
    tree = powershell_tree(source)
    assert not tree.root_node.has_error
    # the same check sees the script with the first if block's opening brace missing as broken
    assert b") {\n" in source
    assert powershell_tree(source.replace(b") {\n", b")\n", 1)).root_node.has_error

    called: set[str] = set()
    pending = [tree.root_node]
    while pending:
        node = pending.pop()
        if node.type == "command_name":
            called.add(source[node.start_byte:node.end_byte].decode())
        pending.extend(node.children)
    assert "Start-Service" in called
    assert called <= WINDOWS_COMMANDS, called - WINDOWS_COMMANDS


def test_windows_service_settings_are_options_forewarn_accepts(tmp_path: Path) -> None:
    """PowerShell cannot run here; what the script hands forewarn (the command and its environment) is
    checked against the real option parser instead."""
    from forewarn.cli import build_parser
    from forewarn.config import resolve

    script = WINDOWS_SCRIPT.read_text()
    install = re.search(r"& \$Nssm install forewarn \$exe (.+?) \| Out-Null", script)
    assert install is not None and install.group(1) == "run"
    env_line = re.search(r"\$envLines = @\((.+)\)", script)
    assert env_line is not None
    environ = {}
    for item in re.findall(r'"([A-Z_]+)=([^"]*)"', env_line.group(1)):
        key, value = item
        environ[key] = value.replace("$StateDir", str(tmp_path / "state")).replace("$Port", "9465")
    assert set(environ) == {"FOREWARN_STATE_DIR", "FOREWARN_LISTEN_ADDRESS", "FOREWARN_LOG_FORMAT"}
    settings = resolve(build_parser().parse_args(["run"]), environ=environ)
    assert settings.state_dir == str(tmp_path / "state")
    assert settings.listen_address == ":9465" and settings.log_format == "json"
    # runs unprivileged, restarts on failure, stops with Ctrl+C (a clean stop for forewarn)
    assert 'ObjectName "NT AUTHORITY\\LocalService"' in script
    assert "AppExit Default Restart" in script and "AppStopMethodConsole" in script
