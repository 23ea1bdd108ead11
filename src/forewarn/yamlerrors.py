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


class YamlSyntaxError(ValueError):
    """A file that is not YAML; `str()` is `LABEL: line L, column C: not valid YAML (problem)`."""


def load_yaml(text: str, label: str) -> object:
    """`yaml.safe_load(text)`, with a syntax error reported against `label` (say `--config FILE`)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        line, column, problem = yaml_problem(exc)
        where = f" line {line}, column {column}:" if line else ""
        raise YamlSyntaxError(f"{label}:{where} not valid YAML ({problem})") from None
