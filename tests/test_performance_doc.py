"""docs/performance.md held to bench/ and the Makefile: a reference someone reads in five minutes, whose every
benchmark exists and is described, whose every command runs a script with options it has, and whose figures each
carry a target, a date and a commit."""

from __future__ import annotations

import ast
import functools
import re
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "performance.md"
BENCH = ROOT / "bench"
#: a "Current figures" row: measure, figure, target, baseline or floor, verdict, "date, commit", command
ROW_CELLS = 7
COMMAND = re.compile(r"`(?:cd bench && \.\./\.venv/bin/python |python )?(?:bench/)?(\w+\.py)((?: [^`|]+)?)`")


def page() -> str:
    return PAGE.read_text(encoding="utf-8")


@functools.cache
def options(script: Path) -> dict[str, set[str] | None]:
    """The script's command-line options, each with its allowed values where the parser lists them (`choices`),
    read from its source: the parsers are built inside main(), which runs the benchmark."""
    tree = ast.parse(script.read_text(encoding="utf-8"))
    constants = {target.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                 for target in node.targets if isinstance(target, ast.Name)}
    found: dict[str, set[str] | None] = {}
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr == "add_argument" and call.args and isinstance(call.args[0], ast.Constant)):
            continue
        choices = next((k.value for k in call.keywords if k.arg == "choices"), None)
        if isinstance(choices, ast.Name):
            choices = constants.get(choices.id)
        found[str(call.args[0].value)] = set(ast.literal_eval(choices)) if choices is not None else None
    if "CASES" in constants and "--only" in found and found["--only"] is None:
        found["--only"] = set(ast.literal_eval(constants["CASES"]))  # a comma-separated list of the cases
    return found


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The body rows of the first table after `heading`."""
    section = text.split(f"\n{heading}\n", 1)[1].split("\n#", 1)[0].splitlines()
    start = next(index for index, line in enumerate(section) if line.startswith("|"))
    end = next((index for index, line in enumerate(section[start:], start) if not line.startswith("|")), len(section))
    return [[cell.strip() for cell in line.strip().strip("|").split(" | ")] for line in section[start + 2:end]]


def test_the_page_is_a_reference_of_at_most_250_lines() -> None:
    assert len(page().splitlines()) <= 250


def test_every_benchmark_in_bench_is_on_the_page_and_every_script_it_names_exists() -> None:
    text = page()
    scripts = {path.name for path in BENCH.glob("*.py")}
    assert not {name for name in scripts if f"`bench/{name}`" not in text}
    named = set(re.findall(r"bench/(\w+\.py)", text)) | {m.group(1) for m in COMMAND.finditer(text)}
    assert named and named <= scripts


def test_every_command_on_the_page_runs_a_benchmark_with_options_it_has() -> None:
    commands = [(m.group(1), m.group(2).split()) for m in COMMAND.finditer(page()) if m.group(2)]
    assert len(commands) >= 10
    for script, words in commands:
        accepted = options(BENCH / script)
        for index, word in enumerate(words):
            if not word.startswith("--"):
                continue
            assert word in accepted, f"{script} has no option {word}"
            value = words[index + 1] if index + 1 < len(words) else ""
            if accepted[word] is not None and value != value.upper():  # DIR, CASE,...: placeholders
                wrong = [v for v in re.split(r"[,|]", value) if v and v not in accepted[word]]
                assert not wrong, f"{script} {word} does not take {wrong}"


def test_every_current_figure_has_a_target_a_baseline_column_a_date_and_a_commit() -> None:
    text = page()
    rows = table_rows(text, "## Current figures")
    assert len(rows) >= 20 and any(row[0].startswith("fleet: ") for row in rows)
    for row in rows:
        assert len(row) == ROW_CELLS, row
        measure, figure, target, _, verdict, when, command = row
        assert measure and figure and target, row
        assert verdict in {"met", "-"} or verdict.startswith(("met ", "**not met**")), row
        match = re.fullmatch(r"(\d{4}-\d\d-\d\d), ([0-9a-f]{7,40})", when)
        assert match, row
        assert date.fromisoformat(match.group(1)) <= date.today()
        assert COMMAND.fullmatch(command), row


def test_make_benchs_time_on_the_page_is_the_makefiles() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    wanted = re.search(r"#[^\n]*\(about (\d+) minutes[^\n]*\)\.?\nbench:", makefile)
    quick = re.search(r"#[^\n]*\(about (\d+) minutes\)[^\n]*\nbench-quick:", makefile)
    assert wanted and quick
    text = " ".join(page().split())
    assert f"(about {wanted.group(1)} minutes on 2 cores)" in text
    assert f"(about {quick.group(1)} minutes)" in text


def test_the_hostile_benchs_published_idle_rss_is_the_pages() -> None:
    row = next(r for r in table_rows(page(), "## Current figures") if r[0].startswith("idle RSS, file"))
    figure = max(float(value) for value in re.findall(r"[\d.]+", row[1].split(" MiB")[0]))
    tree = ast.parse((BENCH / "hostile.py").read_text(encoding="utf-8"))
    published = next(node.value.value for node in tree.body if isinstance(node, ast.Assign)
                     and any(isinstance(t, ast.Name) and t.id == "PUBLISHED_IDLE_RSS_MIB" for t in node.targets)
                     and isinstance(node.value, ast.Constant))
    assert published == figure
