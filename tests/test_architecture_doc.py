"""docs/architecture.md held to the code: its listing of the package is every module there is, and every module,
folder, class and `module.name` it mentions exists."""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "forewarn"
PAGE = ROOT / "docs" / "architecture.md"
#: Names the page gives from the standard library, not forewarn's.
STANDARD_LIBRARY = {"ThreadingHTTPServer"}
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def page() -> str:
    return PAGE.read_text(encoding="utf-8")


def modules() -> set[str]:
    """Every module of the package, as a path under src/forewarn (packages' __init__.py left out)."""
    return {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
            if path.name != "__init__.py" and "__pycache__" not in path.parts}


def listed() -> list[str]:
    """The modules the page's first code block lists: `  folder/  a.py b.py` (more of the folder's files on
    lines indented further), or `  a.py b.py` at the top; a line's first word that is not a module ends it."""
    block = page().split("```\n", 2)[1]
    assert block.startswith("src/forewarn/\n")
    found: list[str] = []
    folder = ""
    for line in block.splitlines()[1:]:
        words = line.split()
        if not words:
            continue
        if len(line) - len(line.lstrip()) <= 2:   # a new entry: a folder, or modules at the top
            folder = words[0] if words[0].endswith("/") else ""
            words = words[1:] if folder else words
        for word in words:
            if not word.endswith(".py"):
                break
            found.append(folder + word)
    return found


@functools.cache
def definitions() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """What the package defines: module name (its file's stem, or a package's folder) -> its top-level names,
    and class name -> its members (methods, class attributes, attributes set on `self`)."""
    by_module: dict[str, set[str]] = {}
    by_class: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        name = path.parent.name if path.name == "__init__.py" else path.stem
        top = by_module.setdefault(name, set())
        for node in tree.body:
            top.update(defined(node))
            if isinstance(node, ast.ClassDef):
                members = by_class.setdefault(node.name, set())
                for item in node.body:
                    members.update(defined(item))
                members.update(target.attr for item in ast.walk(node) if isinstance(item, (ast.Assign, ast.AnnAssign))
                               for target in (item.targets if isinstance(item, ast.Assign) else [item.target])
                               if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                               and target.value.id == "self")
    return by_module, by_class


def defined(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {target.id for target in node.targets if isinstance(target, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    if isinstance(node, (ast.Import, ast.ImportFrom)):   # a package's re-exports
        return {alias.asname or alias.name.split(".")[0] for alias in node.names}
    return set()


def test_the_listing_names_every_module_of_the_package_once() -> None:
    named = listed()
    assert len(named) == len(set(named)), [name for name in named if named.count(name) > 1]
    assert not set(named) - modules(), "listed, but no such module"
    assert not modules() - set(named), "modules of the package the listing leaves out"


def test_every_module_and_folder_the_page_names_exists() -> None:
    text = page()
    basenames = {Path(name).name for name in modules()}
    paths = set(re.findall(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.py)\b", text))
    assert len(paths) > 40
    for path in paths:
        if path.startswith(("tests/", "bench/", "scripts/")):
            assert (ROOT / path).is_file(), path
        elif "/" in path:
            relative = path.removeprefix("src/").removeprefix("forewarn/")
            assert (PACKAGE / relative).is_file(), path
        else:
            assert path in basenames, path
    folders = set(re.findall(r"`((?:src/)?(?:forewarn/)?[a-z]+(?:/[a-z]+)*/?)`", text))
    for folder in folders:
        if "/" in folder:
            relative = folder.removeprefix("src/").removeprefix("forewarn").strip("/")
            assert (PACKAGE / relative).is_dir() or (PACKAGE / f"{relative}.py").is_file(), folder


def test_every_class_constant_and_module_name_the_page_names_is_defined() -> None:
    by_module, by_class = definitions()
    everything = set().union(*by_module.values()) | STANDARD_LIBRARY
    named = {token.removesuffix("()") for token in re.findall(r"`([^`\s]+)`", page())}
    checked = 0
    for token in sorted(named):
        parts = token.split(".")
        if token.endswith(".py") or not all(IDENTIFIER.fullmatch(part) for part in parts):
            continue
        if len(parts) == 1:
            if re.fullmatch(r"[A-Z][a-z]+[A-Z]\w*|[A-Z][A-Z_]{3,}|_?[A-Z][a-z]+", token) and token not in {
                    "Resources", "Started", "Scheduled"}:
                assert token in everything, f"`{token}` is defined nowhere in src/forewarn"
                checked += 1
            continue
        owner, name = parts[-2], parts[-1]
        if owner in by_class:
            assert name in by_class[owner], f"`{token}`: {owner} has no {name}"
        elif owner in by_module:
            assert name in by_module[owner], f"`{token}`: no {name} in a module named {owner}"
        else:
            assert importlib.util.find_spec(".".join(parts[:-1]) if parts[0] != "http" else token), token
        checked += 1
    assert checked > 60
