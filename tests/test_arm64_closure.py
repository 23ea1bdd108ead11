"""Every dependency of every runtime extra installs on linux/arm64 from a binary wheel: the image's
`pip install ".[all]"` on an arm64 node (Graviton, Ampere, Cobalt) must never fall back to building an sdist,
because the slim base has no compiler. pip's own resolver answers the question from PyPI, for the Python of the
image's base and for 3.11 (the Debian base the tests build), without an arm64 machine.

Known limit of pip's cross-platform resolve (pypa/pip#10050, #11010): environment markers in requirements
(`; platform_machine == "aarch64"`, `; python_version >= "3.12"`) are evaluated for the interpreter running the
test, not for the target, so a dependency that only arm64 or only the target Python pulls in is not seen."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).parent.parent
PYPI = "https://pypi.org/simple/pip/"
#: Extras that are not part of what the agent runs.
NOT_RUNTIME_EXTRAS = {"test"}
#: Extras an image is built with (Dockerfile `ARG EXTRAS`), each resolved on its own when pyproject defines it.
IMAGE_EXTRAS = ("all", "slim")
#: The newest glibc baseline first; pip tries every tag of every listed platform.
AARCH64_PLATFORMS = ("manylinux_2_28_aarch64", "manylinux_2_17_aarch64", "manylinux2014_aarch64")
#: A wheel installs on arm64 Linux when one of its platform tags is one of these.
AARCH64_TAG = re.compile(r"^(any|manylinux\w*_aarch64|musllinux_\d+_\d+_aarch64)$")
#: Compiled dependencies of the heavy extras: if they are missing, a resolve of every extra did not cover them.
HEAVY = ("grpcio", "cryptography", "azure-eventhub")
#: A cold resolve of the whole closure takes ~15 s; PyPI on a slow link, a few minutes.
PIP_TIMEOUT = 600

pytestmark = pytest.mark.slow


def base_python() -> str:
    """The Python of the image's default base: `ARG BASE=python:3.12-slim`, else the first `FROM python:X`."""
    text = (ROOT / "Dockerfile").read_text()
    found = re.search(r"^ARG\s+BASE=\S*python:(\d+\.\d+)", text, re.MULTILINE) or re.search(
        r"^FROM\s+(?:--\S+\s+)*\S*python:(\d+\.\d+)", text, re.MULTILINE)
    assert found, "Dockerfile: no `ARG BASE=python:X.Y-...` default and no `FROM python:X.Y-...` line"
    return found.group(1)


PYTHONS = sorted({base_python(), "3.11"}, key=Version)


def pyproject() -> dict[str, Any]:
    project: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project


def runtime_requirements(extras: list[str]) -> list[str]:
    """project.dependencies plus the requirements of `extras`, with self-references such as
    `forewarn[eventhubs,otlp]` expanded (forewarn itself is not on PyPI at this version)."""
    project = pyproject()
    name = canonicalize_name(project["name"])
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    found: list[str] = []
    seen_extras: set[str] = set()

    def add(requirements: list[str]) -> None:
        for text in requirements:
            requirement = Requirement(text)
            if canonicalize_name(requirement.name) != name:
                if text not in found:
                    found.append(text)
                continue
            for extra in sorted(requirement.extras - seen_extras):
                assert extra in optional, f"pyproject.toml: {text!r} names extra {extra!r}, which is not defined"
                seen_extras.add(extra)
                add(optional[extra])

    add(project.get("dependencies", []))
    add([f"{name}[{','.join(extras)}]"] if extras else [])
    return found


def runtime_extras() -> list[str]:
    return sorted(set(pyproject().get("optional-dependencies", {})) - NOT_RUNTIME_EXTRAS)


def extra_sets() -> dict[str, list[str]]:
    """What to resolve: each image's extra alone (the Dockerfile installs `.[${EXTRAS}]`, all or slim), since an
    extra resolved alone may pick other versions than a union does; and every runtime extra at once
    ("every-extra"), unless one of those already expands to the same requirements (today `all` does)."""
    runtime = runtime_extras()
    sets = {extra: [extra] for extra in IMAGE_EXTRAS if extra in runtime}
    if all(set(runtime_requirements(extras)) != set(runtime_requirements(runtime)) for extras in sets.values()):
        sets["every-extra"] = runtime
    return sets


EXTRA_SETS = extra_sets()


def pip_env(tmp: Path) -> dict[str, str]:
    """The environment without this machine's pip settings (config files, find-links, constraints, mirrors):
    the question is what PyPI offers, not what lies on this disk."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", TMPDIR=str(tmp))
    return env


def cert_args() -> list[str]:
    """Keep the CA bundle (a TLS-intercepting proxy needs it), wherever the environment names it."""
    for key in ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        if os.environ.get(key):
            return ["--cert", os.environ[key]]
    return []


@cache
def pypi_unreachable() -> str | None:
    """Why PyPI cannot be reached within a few seconds, or None when it can."""
    import ssl

    cert = cert_args()
    context = ssl.create_default_context(cafile=cert[1] if cert else None)
    try:
        with urllib.request.urlopen(urllib.request.Request(PYPI, method="HEAD"), timeout=10, context=context):
            return None
    except OSError as error:  # URLError is one
        return f"PyPI unreachable ({PYPI}: {error})"


def pip_resolve(requirements: list[str], args: list[str], tmp: Path) -> tuple[list[dict[str, Any]], str]:
    """`pip install --dry-run --report` of `requirements` with `args`: the report's items, or [] and pip's output."""
    reason = pypi_unreachable()
    if reason:
        pytest.skip(reason)
    tmp.mkdir(parents=True, exist_ok=True)
    report = tmp / "report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", str(report), *cert_args(), *args, *requirements]
    done = subprocess.run(command, env=pip_env(tmp), capture_output=True, text=True, timeout=PIP_TIMEOUT)
    if done.returncode != 0:
        return [], done.stdout + done.stderr
    items: list[dict[str, Any]] = json.loads(report.read_text())["install"]
    return items, ""


def unresolvable(output: str) -> list[str]:
    """The distributions pip names when it finds no file it may install."""
    return sorted(set(re.findall(r"(?:No matching distribution found for|satisfies the requirement) ([^\s;(]+)",
                                 output)))


def not_for_aarch64(items: list[dict[str, Any]]) -> list[str]:
    """`name version (file)` for every resolved item that is an sdist or a wheel without an aarch64/any tag."""
    bad = []
    for item in items:
        filename = item["download_info"]["url"].rsplit("/", 1)[-1]
        label = f"{item['metadata']['name']} {item['metadata']['version']} ({filename})"
        if not filename.endswith(".whl"):
            bad.append(f"{label}: an sdist")
            continue
        platforms = {tag.platform for tag in parse_wheel_filename(filename)[3]}
        if not any(AARCH64_TAG.match(platform) for platform in platforms):
            bad.append(f"{label}: platforms {', '.join(sorted(platforms))}")
    return bad


def versions(items: list[dict[str, Any]]) -> dict[str, Version]:
    return {canonicalize_name(item["metadata"]["name"]): Version(item["metadata"]["version"]) for item in items}


@pytest.fixture(scope="module")
def newest(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[dict[str, Version], str]]:
    """The versions a plain `pip install` of an extra set picks (sdists allowed), as the image build does, or {}
    and pip's output: a binary-only resolve that lands below them went back to an older release because the
    newest has no aarch64 wheel. Checked after the aarch64 resolve, so that an sdist which cannot even be built
    here is named first. Once per extra set, for the interpreter running the tests."""

    @cache
    def resolve(extra_set: str) -> tuple[dict[str, Version], str]:
        items, output = pip_resolve(runtime_requirements(EXTRA_SETS[extra_set]), [],
                                    tmp_path_factory.mktemp("newest"))
        return versions(items), output

    return resolve


@pytest.mark.parametrize("extra_set", EXTRA_SETS)
@pytest.mark.parametrize("python", PYTHONS)
def test_every_runtime_dependency_has_an_aarch64_wheel(
        python: str, extra_set: str, tmp_path: Path,
        newest: Callable[[str], tuple[dict[str, Version], str]]) -> None:
    requirements = runtime_requirements(EXTRA_SETS[extra_set])
    platforms = [arg for platform in AARCH64_PLATFORMS for arg in ("--platform", platform)]
    items, output = pip_resolve(requirements, ["--only-binary=:all:", *platforms, "--implementation", "cp",
                                               "--python-version", python, "--target", str(tmp_path / "target")],
                                tmp_path / "pip")
    where = f"Python {python}, {extra_set}"
    names = unresolvable(output)
    assert items, (f"{where}: no aarch64 or pure-Python wheel for {', '.join(names)}" if names else
                   f"{where}: pip could not resolve the requirements for linux/arm64") + f"\n{output[-3000:]}"

    bad = not_for_aarch64(items)
    assert not bad, f"{where}: not installable on linux/arm64 from a wheel:\n" + "\n".join(bad)

    # Not vacuous: every direct requirement that applies here was resolved, and the heavy extras were covered.
    resolved = versions(items)
    expected = [canonicalize_name(Requirement(text).name) for text in requirements
                if Requirement(text).marker is None or Requirement(text).marker.evaluate()]
    runtime = runtime_extras()
    if set(requirements) == set(runtime_requirements(runtime)):
        expected += HEAVY
    missing = sorted(set(expected) - set(resolved))
    assert not missing, f"{where}: the resolve left out {', '.join(missing)}"

    plain, plain_output = newest(extra_set)
    assert plain, f"{extra_set}: the requirements do not resolve even for this machine:\n{plain_output[-3000:]}"
    older = [f"{name} {version} (a plain install takes {plain[name]})" for name, version in sorted(resolved.items())
             if name in plain and version < plain[name]]
    assert not older, (f"{where}: on arm64 these fell back to an older release, so `pip install` in the image "
                       "would build the newest from its sdist:\n" + "\n".join(older))
