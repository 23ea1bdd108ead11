"""The Makefile's targets are what the README says: `make lint` runs the four linters (the script scripts/test
runs first) and no test, and `make bench`'s times are the same in both."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def test_make_lint_runs_scripts_lint_which_scripts_test_runs_before_the_tests() -> None:
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    planned = subprocess.run([make, "-n", "lint"], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True)
    assert planned.stdout.splitlines()[-1] == "scripts/lint", planned.stdout
    assert "pytest" not in planned.stdout
    lint = (ROOT / "scripts" / "lint").read_text(encoding="utf-8")
    assert re.findall(r'^echo "== (\w+)"$', lint, re.MULTILINE) == ["ruff", "mypy", "actionlint", "zizmor"]
    assert "pytest" not in lint
    test = (ROOT / "scripts" / "test").read_text(encoding="utf-8")
    assert test.index("\nscripts/lint\n") < test.index(".venv/bin/python -m pytest")
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert "**Run only the linters** (ruff, mypy, and actionlint and zizmor" in readme
    assert "```sh make lint ```" in readme


def test_the_readme_gives_make_benchs_times_as_the_makefile_does() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    full = re.search(r"#[^\n]*\(about (\d+) minutes on 2 cores\)\.?\nbench:", makefile)
    quick = re.search(r"#[^\n]*\(about (\d+) minutes\)[^\n]*\nbench-quick:", makefile)
    assert full and quick
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert f"`make bench` runs every benchmark (about {full.group(1)} minutes on 2 cores)" in readme
    assert f"`make bench-quick` is a smoke run of the same (about {quick.group(1)} minutes)" in readme
    assert len(re.findall(r"make bench\S* [^.]*?about \d+ minutes", readme)) == 2, "no other figure for them"
