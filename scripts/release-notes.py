#!/usr/bin/env python3
"""Print the CHANGELOG.md section of one version: the GitHub release notes (.github/workflows/release.yml).

    scripts/release-notes.py [VERSION] [--changelog FILE]

VERSION may carry the tag's leading "v" (v0.1.0); without it, the package's own version
(src/forewarn/__init__.py). Prints the text under "## [VERSION] - DATE" up to the next "## " heading,
without the heading and without the link definitions Keep a Changelog puts at the end of the file.
Exits 1, naming the file and the versions it does have, when the version has no section or an empty one:
a release without its changelog entry is a mistake to stop at, not to publish.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHANGELOG = ROOT / "CHANGELOG.md"
#: "## [0.1.0] - 2026-11-24", "## [0.1.0]" or "## 0.1.0 - 2026-11-24"; "## [Unreleased]" is no version.
HEADING = re.compile(r"^## \[?(?P<version>[^\]\s]+)\]?(?:\s+-\s+\S.*)?\s*$")
LINK_DEFINITION = re.compile(r"^\[[^\]]+\]:\s+\S+")


class ChangelogError(Exception):
    """A version without a usable section; the message names the file and what it does have."""


def package_version() -> str:
    """__version__ from src/forewarn/__init__.py, read as text so that no install is needed."""
    source = (ROOT / "src" / "forewarn" / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__ = "([^"]+)"', source, re.MULTILINE)
    if match is None:
        raise ChangelogError("src/forewarn/__init__.py: no __version__ = \"X.Y.Z\" line")
    return match.group(1)


def sections(text: str) -> dict[str, str]:
    """Each version's section text, in the file's order (newest first in a Keep a Changelog file)."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("## "):
            match = HEADING.match(line)
            version = match.group("version") if match else None
            current = None if version is None or version.lower() == "unreleased" else found.setdefault(version, [])
        elif current is not None and not LINK_DEFINITION.match(line):
            current.append(line)
    return {version: "\n".join(lines).strip() for version, lines in found.items()}


def release_notes(version: str, changelog: Path = CHANGELOG) -> str:
    """The section of `version` (a leading "v" is dropped); ChangelogError when it has none or an empty one."""
    version = version.removeprefix("v")
    found = sections(changelog.read_text(encoding="utf-8"))
    if version not in found:
        listed = ", ".join(found) or "none"
        raise ChangelogError(f"{changelog.name}: no section \"## [{version}] - YYYY-MM-DD\" (versions with a section: "
                         f"{listed}); add the release's entry before tagging it")
    if not found[version]:
        raise ChangelogError(f"{changelog.name}: the section of {version} is empty; say what the release changes")
    return found[version]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", nargs="?", help="X.Y.Z or vX.Y.Z (default: the package's __version__)")
    parser.add_argument("--changelog", type=Path, default=CHANGELOG, help="default: CHANGELOG.md at the top")
    args = parser.parse_args(argv)
    try:
        notes = release_notes(args.version or package_version(), args.changelog)
    except ChangelogError as error:
        print(f"release-notes: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"release-notes: cannot read {error.filename}: {error.strerror}", file=sys.stderr)
        return 1
    print(notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
