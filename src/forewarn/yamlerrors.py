"""Where a YAML file went wrong, for messages a person can act on (shared by config and policy files)."""

from __future__ import annotations

import yaml


def yaml_problem(exc: yaml.YAMLError) -> tuple[int | None, int | None, str]:
    """(line, column) of the problem, both 1-based when known, and what the parser said."""
    mark = getattr(exc, "problem_mark", None)
    problem = str(getattr(exc, "problem", None) or exc)
    if mark is None:
        return None, None, problem
    return mark.line + 1, mark.column + 1, problem
