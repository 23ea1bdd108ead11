"""pyproject.toml's dependency ranges are true. scripts/test runs this file in both venvs: .venv with the
newest releases, and .cache/venv-floor with every direct dependency at its floor (scripts/floors.py; scripts/test
sets TESTS_IN_FLOOR_VENV=1 there). docs/dependencies.md's table says the same as pyproject.toml."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import pkgutil
import re
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name
from packaging.version import Version

import forewarn

from conftest import load_script

ROOT = Path(__file__).parent.parent
IN_FLOOR_VENV = os.environ.get("TESTS_IN_FLOOR_VENV") == "1"


floors = load_script("floors")

MODULES = sorted(name for _, name, _ in pkgutil.walk_packages(forewarn.__path__, "forewarn.")
                 if name != "forewarn.__main__")  # running it is the CLI


@pytest.mark.parametrize("module", MODULES)
def test_every_module_imports(module: str) -> None:
    # With every extra installed, no module may fail for a library's version: the floors' first symptom was
    # an ImportError (ReadableLogRecord before opentelemetry-sdk 1.39, httpx2 before lightkube 1.0).
    importlib.import_module(module)


def _installed(name: str) -> Version | None:
    try:
        return Version(importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        return None


def test_what_is_installed_is_within_the_declared_ranges_and_at_the_floor_in_the_floor_venv() -> None:
    declared = [(group, req) for group, reqs in floors.requirements().items() for req in reqs
                if group != floors.TEST_EXTRA or canonicalize_name(req.name) in floors.floors()]
    wrong = []
    for group, req in declared:
        version = _installed(req.name)
        if version is None:
            wrong.append(f"{req} ({group or 'core'}): not installed")
        elif not req.specifier.contains(version, prereleases=True):
            wrong.append(f"{req} ({group or 'core'}): {version} installed")
    if IN_FLOOR_VENV:
        for name, floor in floors.floors().items():
            version = _installed(name)
            if version != Version(floor):
                wrong.append(f"{name}: {version} installed in the floor venv, the floor is {floor}")
    assert not wrong, "\n".join(wrong)


def test_a_dependency_has_one_floor_wherever_it_is_named() -> None:
    # A user who installs one extra gets that extra's floor; the floor venv tests the highest. So they must agree.
    seen: dict[str, dict[str, str | None]] = {}
    for group, reqs in floors.requirements().items():
        if group == floors.TEST_EXTRA:
            continue
        for req in reqs:
            seen.setdefault(canonicalize_name(req.name), {})[group or "core"] = floors.floor(req)
    disagreeing = {name: groups for name, groups in seen.items() if len(set(groups.values())) > 1}
    assert not disagreeing


def test_every_test_file_of_the_floor_run_exists_and_says_why() -> None:
    for node, reason in floors.FLOOR_TESTS.items():
        path, _, function = node.partition("::")
        assert (ROOT / path).is_file(), node
        assert not function or re.search(rf"^def {function}\(", (ROOT / path).read_text(), re.MULTILINE), node
        assert reason.strip(), node
    assert "tests/test_dependency_floors.py" in floors.FLOOR_TESTS


def _table() -> dict[str, tuple[str, str]]:
    """docs/dependencies.md's table: name -> (floor, newest tested)."""
    rows = {}
    for line in (ROOT / "docs" / "dependencies.md").read_text(encoding="utf-8").splitlines():
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and re.fullmatch(r"[\d.]+", cells[2]) and re.fullmatch(r"[\d.]+", cells[3]):
            rows[canonicalize_name(cells[0])] = (cells[2], cells[3])
    return rows


def test_the_dependency_table_names_every_floor_as_pyproject_declares_it() -> None:
    table = _table()
    assert {name: floor for name, (floor, _) in table.items()} == floors.floors()
    for name, (floor, newest) in table.items():
        assert Version(floor) <= Version(newest), name


@pytest.mark.skipif(IN_FLOOR_VENV or os.environ.get("CI") != "true",
                    reason="a fresh .venv (CI's) has the newest releases; an older developer venv may not")
def test_the_main_venv_is_at_least_as_new_as_the_table_says_was_tested() -> None:
    older = {name: (str(_installed(name)), newest) for name, (_, newest) in _table().items()
             if (_installed(name) or Version("0")) < Version(newest)}
    assert not older, f"installed older than docs/dependencies.md's newest tested: {older}"


@pytest.mark.parametrize("accept", [
    # prometheus-client before 0.23.1 answered OpenMetrics 1.0.0 to any application/openmetrics-text, even one
    # asking for 0.0.1 only; forewarn (and prometheus-client from 0.23.1) answers the text format then, since
    # it writes OpenMetrics 1.0.0 alone. So 0.23.1 is the floor of the reference.
    "application/openmetrics-text; version=0.0.1",
    "application/openmetrics-text;version=0.0.1;q=0.9,text/plain;version=0.0.4;q=0.5",
    "application/openmetrics-text;version=0.0.1,application/openmetrics-text;version=1.0.0",
])
def test_openmetrics_before_1_0_0_gets_the_text_format_as_the_reference_chooses(accept: str) -> None:
    from prometheus_client.exposition import choose_encoder

    from forewarn.metrics.core import negotiate

    openmetrics, content_type = negotiate(accept)
    _, theirs = choose_encoder(accept)
    assert content_type.split(";")[0] == theirs.split(";")[0]
    assert openmetrics == ("version=1.0.0" in accept)


PROMETHEUS_CLIENT_IMPORT = re.compile(
    r"prometheus[-_]client\W{0,4}(?:s\b)?[^.]{0,40}?\bimport\b[^.]{0,30}?(\d+(?:\.\d+)?) MiB", re.IGNORECASE)


def test_prometheus_clients_import_cost_is_one_figure_wherever_it_is_quoted() -> None:
    figures = {}
    for path in [ROOT / "pyproject.toml", *sorted((ROOT / "docs").glob("*.md"))]:
        text = " ".join(path.read_text(encoding="utf-8").split())
        for match in PROMETHEUS_CLIENT_IMPORT.finditer(text):
            figures.setdefault(match.group(1), []).append(path.name)
    assert len(figures) == 1, f"prometheus-client's import cost quoted as {figures} (docs/performance.md measures it)"
    quoted_in = {name for names in figures.values() for name in names}
    assert {"pyproject.toml", "architecture.md", "performance.md"} <= quoted_in
