"""One version everywhere: the package, `forewarn version` and `forewarn --version`, the image's version label,
the kustomize image tag, the Helm chart's version and appVersion, and the newest CHANGELOG entry. The release
workflow runs this file with RELEASE_TAG set to the pushed tag, which must be `v` + that version.
docs/releasing.md lists the places a release changes."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

from forewarn import __version__

ROOT = Path(__file__).parent.parent
#: Semantic Versioning 2.0.0 without build metadata (an OCI tag may not hold "+"); PEP 440 reads it the same.
SEMVER = re.compile(r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-((?:alpha|beta|rc)\.(?:0|[1-9]\d*)))?")


def newest_changelog_entry() -> tuple[str, str]:
    """(version, date) of the first `## [VERSION] - DATE` heading; an `## [Unreleased]` one is skipped."""
    for line in (ROOT / "CHANGELOG.md").read_text().splitlines():
        match = re.fullmatch(r"## \[([^\]]+)\](?: - (\S+))?", line.strip())
        if match and match.group(1).lower() != "unreleased":
            return match.group(1), match.group(2) or ""
    raise AssertionError("CHANGELOG.md has no `## [VERSION] - DATE` entry")


def test_the_version_is_semantic_and_the_package_metadata_carries_it() -> None:
    assert SEMVER.fullmatch(__version__), f"{__version__!r} is not MAJOR.MINOR.PATCH[-alpha|beta|rc.N]"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'version = { attr = "forewarn.__version__" }' in pyproject
    # the installed distribution (the editable install of scripts/test) was built from the same attribute
    assert Version(importlib.metadata.version("forewarn")) == Version(__version__)


def test_the_commands_print_it() -> None:
    script = Path(sys.executable).parent / "forewarn"  # the console script users type, beside this Python
    for args in (["--version"], ["version"]):
        result = subprocess.run([str(script), *args], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines()[0] == f"forewarn {__version__}", result.stdout


def test_the_image_chart_and_manifests_name_it() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.findall(r"^ARG VERSION=(\S+)$", dockerfile, re.MULTILINE) == [__version__]
    assert 'org.opencontainers.image.version="${VERSION}"' in dockerfile
    chart = yaml.safe_load((ROOT / "deploy" / "helm" / "forewarn" / "Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (__version__, __version__)
    kustomization = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "base" / "kustomization.yaml").read_text())
    (image,) = [entry for entry in kustomization["images"] if entry["newName"] == "ghcr.io/forewarn/forewarn"]
    assert image["newTag"] == __version__


def test_the_newest_changelog_entry_is_this_version() -> None:
    version, date = newest_changelog_entry()
    assert version == __version__, f"CHANGELOG.md's newest entry is {version}, the package is {__version__}"
    datetime.date.fromisoformat(date)  # YYYY-MM-DD


def test_the_release_tag_is_v_and_the_version() -> None:
    tag = os.environ.get("RELEASE_TAG")
    if tag is None:
        pytest.skip("RELEASE_TAG is not set (the release workflow sets it to the pushed tag)")
    assert tag == f"v{__version__}", f"tag {tag} does not match the version {__version__}: bump it or retag"
