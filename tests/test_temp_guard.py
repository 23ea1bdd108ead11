"""The session guard in conftest.py fails a run whose tests leave something in the temp dir.

Each case runs a pytest of its own (in a subprocess, so its TMPDIR switch stays out of this session) with
this suite's conftest.py and one small test file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")


def run_with_guard(pytester: pytest.Pytester, test_source: str) -> pytest.RunResult:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_source)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider")


def test_a_leaked_temp_dir_fails_the_session_and_is_named(pytester: pytest.Pytester) -> None:
    result = run_with_guard(pytester, """
import os, subprocess, sys, tempfile

def test_leaks_in_process():
    tempfile.mkdtemp(prefix="leaked-here-")

def test_leaks_from_a_child_process():
    code = "import tempfile; tempfile.mkdtemp(prefix='leaked-by-child-')"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})
""")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*tests left 2 item(s) in the temp dir*leaked-by-child-*leaked-here-*"])


def test_tmp_path_and_cleaned_up_temp_files_pass(pytester: pytest.Pytester) -> None:
    result = run_with_guard(pytester, """
import tempfile

def test_uses_tmp_path(tmp_path):
    (tmp_path / "kept").write_text("pytest owns this")

def test_removes_what_it_makes():
    with tempfile.TemporaryDirectory() as scratch, tempfile.NamedTemporaryFile() as handle:
        assert scratch and handle.name
""")
    result.assert_outcomes(passed=2)
