"""The sdist and the wheel, built and checked as the release workflow builds and checks them before PyPI: `python -m
build`, `twine check --strict`, `check-wheel-contents`; and what a user installs from them: the version, the
`forewarn` command, the schemas the records and policies are checked against, the extras, and no tests."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from forewarn import __version__

ROOT = Path(__file__).parent.parent
RELEASE = ROOT / ".github" / "workflows" / "release.yml"
pytestmark = pytest.mark.slow


def tools_of_the_release() -> list[str]:
    """The packaging tools the release workflow installs, pinned: the test extra pins the same ones."""
    match = re.search(r"pip install --disable-pip-version-check (build==\S+ twine==\S+ check-wheel-contents==\S+)",
                      RELEASE.read_text())
    assert match, "release.yml installs build, twine and check-wheel-contents, pinned"
    return match.group(1).split()


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(out), str(ROOT)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def test_the_test_extra_pins_the_release_tools() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    for requirement in tools_of_the_release():
        assert f'"{requirement}"' in pyproject, f"{requirement}: pin it in the test extra as release.yml does"


def test_twine_and_check_wheel_contents_pass(dist: Path) -> None:
    files = sorted(str(path) for path in dist.iterdir())
    expected = [f"forewarn-{__version__}-py3-none-any.whl", f"forewarn-{__version__}.tar.gz"]
    assert [Path(f).name for f in files] == expected
    twine = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *files], capture_output=True,
                           text=True, timeout=120)
    assert twine.returncode == 0, twine.stdout + twine.stderr
    wheel = [f for f in files if f.endswith(".whl")]
    contents = subprocess.run([str(Path(sys.executable).parent / "check-wheel-contents"), *wheel],
                              capture_output=True, text=True, timeout=120)
    assert contents.returncode == 0, contents.stdout + contents.stderr


def test_the_wheel_holds_what_users_need_and_no_tests(dist: Path) -> None:
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        info = f"forewarn-{__version__}.dist-info"
        metadata = Parser().parsestr(whl.read(f"{info}/METADATA").decode())
        entry_points = whl.read(f"{info}/entry_points.txt").decode()
    assert metadata["Version"] == __version__
    assert metadata["License-Expression"] == "Apache-2.0"
    extras = set(metadata.get_all("Provides-Extra") or [])
    assert {"all", "slim", "eventhubs", "otlp", "notify", "logs", "web", "kubernetes"} <= extras
    assert "forewarn = forewarn.cli:main" in entry_points
    assert {"forewarn/py.typed", "forewarn/schemas/record.schema.json", "forewarn/schemas/policy.schema.json"} <= names
    assert not [name for name in names if name.startswith(("tests/", "bench/", "scripts/", "deploy/"))]


def test_the_sdist_builds_the_same_package(dist: Path) -> None:
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert {"pyproject.toml", "README.md", "src/forewarn/__init__.py",
            "src/forewarn/schemas/record.schema.json"} <= names
