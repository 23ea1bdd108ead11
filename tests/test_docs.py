"""The docs are held to what is true: every flag they name exists in the CLI of its subcommand, every relative
link resolves (file and #anchor, by GitHub's rules), docs/records.md names exactly the fields of the record's
JSON Schema, and docs/metrics.md names exactly the families a live `/metrics` exports in each mode."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import requests

from forewarn.cli import build_parser

from conftest import free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent
#: The pages a reader meets: the README, docs/, and the READMEs beside deploy files.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "deploy").glob("**/README.md"))]

FENCE = re.compile(r"^ {0,3}(```|~~~)")
#: `--name`, or `--prefix-*` for a group of options.
FLAG = re.compile(r"(?<![\w/-])--[a-z][a-z0-9.-]*[a-z0-9](?:-\*)?")
INLINE_CODE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)


def page_name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def split_page(text: str) -> tuple[list[str], list[str]]:
    """The page's code-block lines (continuations joined) and its prose lines, apart."""
    code: list[str] = []
    prose: list[str] = []
    fence = ""
    pending = ""
    for line in text.splitlines():
        match = FENCE.match(line)
        if fence:
            if match and match.group(1) == fence and not line.strip().strip(fence[0]):
                fence = ""
                if pending:
                    code.append(pending)
                    pending = ""
                continue
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
            else:
                code.append(pending + line)
                pending = ""
        elif match:
            fence = match.group(1)
        else:
            prose.append(line)
    return code, prose


# --- flags ------------------------------------------------------------------------------------------------------


def subcommand_options(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], set[str]]:
    """Each (sub)command of `forewarn`, as the words that name it, with its option strings."""
    found = {path: {option for action in parser._actions for option in action.option_strings}}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(subcommand_options(sub, (*path, name)))
    return found


COMMANDS = subcommand_options(build_parser())
EVERY_FLAG = set().union(*COMMANDS.values())
#: A command word: a program's name or path (`helm`, `bench/cost.py`). A YAML key (`args:`), a list marker or a
#: flag is none, and then the flags that follow are forewarn's.
PROGRAM = re.compile(r"^[A-Za-z_][\w.+/-]*$")
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
#: Flags named without their program, in prose or in a diagram, that are not forewarn's. Keep it short.
NOT_FOREWARNS = {
    ("docs/azure-monitor.md", "--grafana-resource-id"): "az aks update's flag, named in the prose after its command",
    ("docs/load-balancer.md", "--protocol"): "az network lb probe's flag, named in the prose after its command",
    ("docs/load-balancer.md", "--port"): "az network application-gateway probe's flag, in the prose",
    ("docs/performance.md", "--quick"): "the bench scripts' smoke-run flag, in the prose",
    ("docs/releasing.md", "--no-deps"): "pip-audit's flag, in the prose",
    ("docs/releasing.md", "--persona"): "zizmor's flag, in the prose",
    ("deploy/azure/README.md", "--storage-queue-msg-ttl"): "az eventgrid's flags in fleet-setup.sh, in the prose",
    ("deploy/azure/README.md", "--event-delivery-schema"): "az eventgrid's flags in fleet-setup.sh, in the prose",
}


def segments(context: str) -> Iterator[list[str]]:
    """The commands of a code line or an inline code span, each as its words: split at pipes, `&&` and `;`, and
    each command substitution `$(...)` a command of its own."""
    inner = re.findall(r"\$\(([^()]*)\)", context)
    for command in inner:
        yield from segments(command)
    for segment in re.split(r"\|\||&&|[|;]|`", re.sub(r"\$\([^()]*\)", "SUBSTITUTION", context)):
        words = segment.split()
        while words and (ENV_ASSIGNMENT.match(words[0]) or words[0] in ("$", "sudo", "exec", "-", "#")):
            words = words[1:]
        if words:
            yield words


def flag_claims(path: Path) -> Iterator[tuple[str, tuple[str, ...] | None]]:
    """Each flag the page names, with the forewarn (sub)command it belongs to: the words after `forewarn` that
    name a subcommand, or None when no command is named (it must then be some subcommand's). Flags of another
    program (the first word of their command) are not forewarn's and are left out."""
    code, prose = split_page(path.read_text(encoding="utf-8"))
    contexts = code + [match.group(2) for match in INLINE_CODE.finditer("\n".join(prose))]
    for context in contexts:
        for words in segments(context):
            first = words[0].strip("\"'[(")
            if first.split("/")[-1] in ("python", "python3") and words[1:3] == ["-m", "forewarn"]:
                first, words = "forewarn", words[2:]
            if first.split("/")[-1] == "forewarn":
                command: tuple[str, ...] = ()
                for word in words[1:]:
                    if (*command, word) in COMMANDS:
                        command = (*command, word)
                    elif not word.startswith("-"):
                        break
                owner: tuple[str, ...] | None = command
            elif PROGRAM.match(first) and not first.startswith("-"):
                continue  # another program's flags
            else:
                owner = None
            for flag in FLAG.findall(" ".join(words)):
                yield flag, owner


def known(flag: str, options: set[str]) -> bool:
    """Whether `flag` is one of `options`, or `--prefix-*` names some of them."""
    return any(option.startswith(flag[:-1]) for option in options) if flag.endswith("-*") else flag in options


#: Pages about one command: a flag they name without a command is that command's.
PAGE_COMMAND = {"docs/fleet.md": ("fleet",)}


def test_every_flag_the_docs_name_is_one_of_its_forewarn_subcommand() -> None:
    wrong = []
    for path in PAGES:
        name = page_name(path)
        for flag, owner in flag_claims(path):
            if owner is None and name in PAGE_COMMAND:
                owner = PAGE_COMMAND[name]
            if owner is None:
                if not known(flag, EVERY_FLAG) and (name, flag) not in NOT_FOREWARNS:
                    wrong.append(f"{name}: {flag} is no option of any forewarn command")
            elif not known(flag, COMMANDS[owner] | COMMANDS[()]):
                wrong.append(f"{name}: {flag} is no option of `forewarn {' '.join(owner)}`".replace(" `", "`", 0))
    assert wrong == []


def test_the_allow_list_of_other_programs_flags_is_still_needed() -> None:
    named = {(page_name(path), flag) for path in PAGES for flag, owner in flag_claims(path) if owner is None}
    assert set(NOT_FOREWARNS) <= named, "remove the entries the docs no longer need"
    assert not set(NOT_FOREWARNS) & {(page, flag) for page, flag in NOT_FOREWARNS if flag in EVERY_FLAG}


# --- links ------------------------------------------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: the text as rendered (code, emphasis and links reduced to their text),
    lower case, anything but letters, digits, `_`, `-` and spaces dropped, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"(\*{1,3}|_{1,3})(\S(?:.*?\S)?)\1", r"\2", text)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown page's headings (a repeated one gets -1, -2, ... as GitHub does)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    _, prose = split_page(path.read_text(encoding="utf-8"))
    for line in prose:
        match = HEADING.match(line)
        if match:
            base = anchor(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    found.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", path.read_text(encoding="utf-8")))
    return found


def links(path: Path) -> Iterator[str]:
    _, prose = split_page(path.read_text(encoding="utf-8"))
    text = INLINE_CODE.sub("", "\n".join(prose))
    for pattern in (LINK, IMAGE, REFERENCE):
        for match in pattern.finditer(text):
            yield match.group(1)


def test_every_relative_link_resolves_to_a_file_and_its_anchor() -> None:
    broken = []
    checked = 0
    for path in PAGES:
        for target in links(path):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("//"):
                continue  # http:, https:, mailto:: not this test's business
            checked += 1
            file, _, fragment = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            if not resolved.exists():
                broken.append(f"{page_name(path)}: {target}: no such file")
            elif fragment and resolved.suffix == ".md" and fragment.lower() not in anchors(resolved):
                broken.append(f"{page_name(path)}: {target}: no heading with that anchor in {resolved.name}")
            elif fragment and resolved.suffix != ".md" and not re.fullmatch(r"L\d+(-L\d+)?", fragment):
                broken.append(f"{page_name(path)}: {target}: an anchor into a file that is not Markdown")
    assert broken == []
    assert checked > 5, "the link pattern finds the pages' links"


#: A path in the repository named in a page's text, a link or not (`docs/fleet.md`, `deploy/kubernetes/base`).
REPOSITORY_PATH = re.compile(r"(?<![\w./-])((?:docs|src|tests|deploy|dashboards|bench|scripts|\.github|\.ci)/"
                             r"[\w./-]*[\w/])(?![\w\\*{<])")


def test_every_repository_path_the_pages_name_exists() -> None:
    """Paths under a folder .gitignore names (outputs such as bench/results/) are not in a clone: left out."""
    ignored = tuple(line.strip().lstrip("/") for line in (ROOT / ".gitignore").read_text().splitlines()
                    if line.strip().endswith("/") and not set(line) & set("*?[!#"))
    missing = []
    for path in PAGES:
        for match in REPOSITORY_PATH.finditer(path.read_text(encoding="utf-8")):
            named = match.group(1)
            if (named + "/").startswith(ignored):
                continue
            if not (ROOT / named).exists() and not (path.parent / named).exists():
                missing.append(f"{page_name(path)}: {named}")
    assert missing == []


def test_anchors_follow_githubs_rules() -> None:
    assert anchor("Fleet mode: `forewarn fleet`") == "fleet-mode-forewarn-fleet"
    assert anchor("Who owns what: the per-VM agent, fleet instances, and undo") == \
        "who-owns-what-the-per-vm-agent-fleet-instances-and-undo"
    assert anchor("Event Grid push (`--eventgrid-path /eventgrid`)") == "event-grid-push---eventgrid-path-eventgrid"
    assert anchor("**Bold** and [a link](x.md) and snake_case") == "bold-and-a-link-and-snake_case"


# --- records ----------------------------------------------------------------------------------------------------

SCHEMA = json.loads(resources.files("forewarn").joinpath("schemas/record.schema.json").read_text())


def schema_fields(schema: dict[str, Any], prefix: str = "") -> set[str]:
    """Every property the schema describes, as a path: `id`, `data.vm.name`, `data.blocked[].pod`."""
    found = set()
    for name, sub in schema.get("properties", {}).items():
        path = f"{prefix}{name}"
        found.add(path)
        found |= schema_fields(sub, path + ".")
        if isinstance(sub.get("items"), dict):
            found |= schema_fields(sub["items"], path + "[].")
    return found


def documented_fields(path: Path) -> set[str]:
    """The fields a page's field tables name: the code in the first column of tables headed `field`."""
    found: set[str] = set()
    in_table = False
    for line in split_page(path.read_text(encoding="utf-8"))[1]:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if not cells:
            in_table = False
        elif cells[0] == "field":
            in_table = True
        elif in_table and not set(cells[0]) <= set("-: "):
            found.update(re.findall(r"`([^`]+)`", cells[0]))
    return found


def test_docs_records_names_every_field_of_the_schema_and_no_other() -> None:
    documented = documented_fields(ROOT / "docs" / "records.md")
    described = schema_fields(SCHEMA)
    assert len(described) > 50
    assert sorted(described - documented) == [], "fields of the schema that docs/records.md leaves out"
    assert sorted(documented - described) == [], "fields docs/records.md names that the schema does not describe"


def test_docs_records_names_every_kind_of_change_the_schema_allows() -> None:
    text = (ROOT / "docs" / "records.md").read_text(encoding="utf-8")
    kinds = SCHEMA["properties"]["data"]["properties"]["change"]["enum"]
    rows = set(re.findall(r"^\| `([a-z_]+)` \|", text.split("## Kinds of change")[1].split("\n## ")[0], re.MULTILINE))
    assert rows == set(kinds)


def test_the_pages_send_readers_to_the_repository_not_outside_it() -> None:
    """The contract is docs/metrics.md and docs/records.md: no page sends a reader to a file of the development
    tree outside the repository."""
    outside = [page_name(path) for path in PAGES
               if re.search(r"\.\./shared/|CONTRACT\.md", path.read_text(encoding="utf-8"))]
    assert outside == []


# --- metrics: docs/metrics.md against a live /metrics of each mode ----------------------------------------------

METRICS_DOC = ROOT / "docs" / "metrics.md"
#: The families of features that may be off, by feature (docs/metrics.md, "Families that appear with their feature").
FEATURES = {
    "approvals": {"azure_scheduled_events_approvals_total"},
    "policy reload": {"azure_scheduled_events_policy_last_reload_successful",      # `forewarn run`'s SIGHUP
                      "azure_scheduled_events_policy_last_reload_success_timestamp_seconds"},
    "hooks": {"azure_scheduled_events_hook_runs_total"},
    "node actions": {"azure_scheduled_events_node_actions_total", "azure_scheduled_events_node_drains_in_progress",
                     "azure_scheduled_events_node_drain_blocked_since_timestamp_seconds",
                     "azure_scheduled_events_node_drain_pods_total",
                     "azure_scheduled_events_node_drain_reports_total"},
    "fleet node actions": {"azure_scheduled_events_fleet_vms_without_node_total",
                           "azure_scheduled_events_fleet_undo_held",
                           "azure_scheduled_events_fleet_nodes_waiting_for_snapshot"},
    "own codec": {"azure_scheduled_events_own_codec_in_use"},
    "queue": {"azure_scheduled_events_queue_messages_total", "azure_scheduled_events_feed_lag_seconds"},
    "lease": {"azure_scheduled_events_handover_skipped_total"},
}


def documented_families() -> dict[str, set[str]]:
    """The families docs/metrics.md names in its tables, by mode (`run`, `fleet`): the code in a table's first
    column, `..._name` read as `azure_scheduled_events_name`, `process_*` as the process families named above
    it. Sections about fleet mode are fleet's; a table with a `mode` column says it per row (`both`, `fleet`)."""
    found: dict[str, set[str]] = {"run": set(), "fleet": set()}
    section = ""
    mode_column = None
    for line in split_page(METRICS_DOC.read_text(encoding="utf-8"))[1]:
        if line.startswith("## "):
            section = line
            continue
        if not line.startswith("|"):
            mode_column = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if set(cells[0]) <= set("-: "):
            continue
        if mode_column is None:
            mode_column = cells.index("mode") if "mode" in cells else -1
            continue  # the header row
        modes = ["fleet"] if "fleet" in section.lower() else ["run"]
        if mode_column >= 0:
            modes = {"both": ["run", "fleet"], "fleet": ["fleet"], "run": ["run"]}[cells[mode_column]]
        for name in re.findall(r"`([a-z_.*]+)`", cells[0]):
            if name.startswith("..._"):
                name = "azure_scheduled_events_" + name[4:]
            for mode in modes:
                if name == "process_*":
                    found[mode] |= {n for n in found["run"] if n.startswith("process_")}
                elif re.fullmatch(r"[a-z_]+", name):
                    found[mode].add(name)
    return found


def exported(text: str) -> set[str]:
    """The families of an exposition in the text format (a counter's family is named with its _total there)."""
    return set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))


def scrape(url: str) -> str:
    return requests.get(url, timeout=5).text


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The /metrics of `forewarn run --simulate` and `forewarn fleet`, each plain (no policy, nothing but a file
    sink) and with every feature configured (a policy with hooks and node actions against the Kubernetes API
    stand-in, an OTLP gRPC sink; fleet mode fed by the Resource Graph stand-in, a Storage queue (Azurite) and
    Event Grid push, under a Lease)."""
    from test_fleet_queue import Azurite, require_azurite
    from test_fleet_service import SUBS, Fleet, row
    from test_node_actions import CLUSTER_ROLE

    from peers.arm import ArmPeer
    from peers.kube_api import KubeApi
    from peers.pki import Authority

    node = require_azurite()
    tmp = tmp_path_factory.mktemp("docs-metrics")
    fleet_roles = tmp / "fleet-roles"  # node actions and the Lease, as the fleet overlay and component grant them
    fleet_roles.mkdir()
    for role in ("components/fleet-node-actions/clusterrole.yaml", "overlays/fleet/role.yaml"):
        (fleet_roles / role.replace("/", "-")).write_text((ROOT / "deploy" / "kubernetes" / role).read_text())
    hook = json.dumps([sys.executable, "-c", "pass"])
    policy = tmp / "policy.yaml"
    policy.write_text(f"rules:\n  - name: reboot\n    action: approve\n    match: {{event_type: [Reboot]}}\n"
                      f"    prepare: [{{command: {hook}}}]\n    node: [cordon]\n")
    nowhere = f"http://127.0.0.1:{free_port()}"  # the OTLP sink starts (and checks its codec) with no receiver
    otlp = ("--sink", "otlp", "--otlp-endpoint", nowhere, "--otlp-protocol", "grpc")
    texts: dict[str, str] = {}
    processes: list[subprocess.Popen[bytes]] = []

    def agent(name: str, *extra: str) -> str:
        port = free_port()
        processes.append(subprocess.Popen(
            [str(Path(sys.executable).parent / "forewarn"), "run", "--simulate", "platform-reboot",
             "--listen-address", f"127.0.0.1:{port}", "--state-dir", str(tmp / name), "--sink",
             f"file:{tmp / name}.jsonl", "--drain-timeout", "1", *extra],
            stdout=subprocess.DEVNULL, stderr=(tmp / f"{name}.log").open("wb")))
        return f"http://127.0.0.1:{port}/metrics"

    def has(url: str, *names: str) -> bool:
        try:
            return set(names) <= exported(scrape(url))
        except requests.RequestException:
            return False

    azurite = Azurite(node, tmp / "azurite")
    authority = Authority("docs-test-ca")
    arm = ArmPeer(authority, rows=[row(SUBS[0], 300)])
    arm.faults.quota_limit = 100
    try:
        with KubeApi(cluster_role=CLUSTER_ROLE) as node_api, KubeApi(cluster_role=fleet_roles,
                                                                      namespaces=["forewarn"]) as fleet_api:
            node_api.add_node("node-1")
            plain_run = agent("plain")
            full_run = agent("full", "--policy", str(policy), "--node-name", "node-1", "--kubeconfig",
                             str(node_api.kubeconfig(tmp / "kubeconfig")), *otlp)
            port = free_port()
            processes.append(subprocess.Popen(
                [str(Path(sys.executable).parent / "forewarn"), "fleet", "--simulate", "tour", "--listen-address",
                 f"127.0.0.1:{port}", "--state-dir", str(tmp / "fleet-plain")],
                stdout=subprocess.DEVNULL, stderr=(tmp / "fleet-plain.log").open("wb")))
            plain_fleet = f"http://127.0.0.1:{port}/metrics"
            fleet = Fleet(tmp, arm, authority, azurite, azurite.queue().queue_name, extra=(
                "--lease-name", "forewarn-fleet", "--lease-seconds", "3",
                "--policy", str(policy), "--kubeconfig", str(fleet_api.kubeconfig(tmp / "fleet-kubeconfig",
                                                                                   namespace="forewarn")),
                "--eventgrid-path", "/eventgrid", *otlp), env={"FOREWARN_EVENTGRID_SECRET": "0" * 32}).start()
            full_fleet = f"http://127.0.0.1:{fleet.port}/metrics"
            per_event = ("azure_scheduled_event_info", "azure_scheduled_event_not_before_timestamp_seconds")
            for url, names in ((plain_run, per_event), (plain_fleet, per_event),
                               (full_run, (*per_event, "azure_scheduled_events_approvals_total")),
                               (full_fleet, (*per_event, "azure_scheduled_events_resourcegraph_quota_remaining"))):
                wait_until(lambda: has(url, *names), timeout=30,  # noqa: B023 (called at once)
                           message=f"{url}: {names}")
            texts = {"run": scrape(plain_run), "run+features": scrape(full_run), "fleet": scrape(plain_fleet),
                     "fleet+features": scrape(full_fleet)}
            assert fleet.proc is not None
            processes.append(fleet.proc)
            yield texts
    finally:
        for proc in processes:
            if proc.poll() is None:
                proc.terminate()
        for proc in processes:
            proc.wait(15)
        arm.stop()
        azurite.stop()


def test_a_plain_agent_and_fleet_export_no_family_of_a_feature_that_is_off(live: dict[str, str]) -> None:
    every = set().union(*FEATURES.values())
    assert exported(live["run"]) & every == set()
    assert exported(live["fleet"]) & every == set()


def test_configured_features_bring_their_families(live: dict[str, str]) -> None:
    assert set().union(*(FEATURES[f] for f in ("approvals", "policy reload", "hooks", "node actions",
                                               "own codec"))) <= exported(live["run+features"])
    assert set().union(*(names for f, names in FEATURES.items() if f != "policy reload")) <= \
        exported(live["fleet+features"])


@pytest.mark.parametrize("mode", ["run", "fleet"])
def test_every_family_a_mode_exports_is_in_docs_metrics(live: dict[str, str], mode: str) -> None:
    shown = exported(live[mode]) | exported(live[f"{mode}+features"])
    assert sorted(shown - documented_families()[mode]) == [], f"families `forewarn {mode}` exports, not documented"


@pytest.mark.parametrize("mode", ["run", "fleet"])
def test_every_family_docs_metrics_names_is_in_a_live_metrics_of_its_mode(live: dict[str, str], mode: str) -> None:
    shown = exported(live[mode]) | exported(live[f"{mode}+features"])
    assert sorted(documented_families()[mode] - shown) == [], f"documented for `forewarn {mode}`, never exported"
