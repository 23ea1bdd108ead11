"""The policy language: loading errors with positions, matching, and decisions."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from forewarn.approval.policy import Decision, PolicyError, decide, load_policy, parse_policy
from forewarn.imds.document import EVENT_SOURCES, EVENT_STATUSES, EVENT_TYPES, Event, parse_document

from conftest import free_port

EXAMPLES = Path(__file__).parent.parent / "examples" / "policies"
NOW = datetime(2026, 11, 23, 12, 0, tzinfo=timezone.utc).timestamp()  # a Monday, noon UTC


def event(event_type: str = "Reboot", status: str = "Scheduled", source: str | None = "Platform",
          duration: int | None = -1, resources: tuple[str, ...] = ("vm-0", "vm-1"), not_before_in: float = 900,
          description: str = "") -> Event:
    raw: dict[str, Any] = {"EventId": "E", "EventType": event_type, "ResourceType": "VirtualMachine",
                           "Resources": list(resources), "EventStatus": status, "Description": description,
                           "NotBefore": "" if status == "Started" else
                           datetime.fromtimestamp(NOW + not_before_in, tz=timezone.utc).strftime(
                               "%a, %d %b %Y %H:%M:%S GMT")}
    if source is not None:
        raw["EventSource"] = source
    if duration is not None:
        raw["DurationInSeconds"] = duration
    return parse_document({"DocumentIncarnation": 1, "Events": [raw]}).events[0]


DOCS_SAMPLE = load_policy(EXAMPLES / "docs-sample.yaml")


def verdict(decision: Decision) -> tuple[str, str | None]:
    """The action and the name of the rule that matched."""
    return decision.action, decision.rule.name if decision.rule else None


@pytest.mark.parametrize(("event_type", "source", "status"),
                         list(itertools.product(EVENT_TYPES, EVENT_SOURCES, EVENT_STATUSES)))
def test_rule_matrix_of_the_documented_sample(event_type: str, source: str, status: str) -> None:
    for duration in (-1, 0, 5, 8, 9, 900):
        decision = decide(DOCS_SAMPLE, event(event_type, status, source, duration), "vm-0", NOW, NOW)
        user = source == "User"
        short_freeze = event_type == "Freeze" and 0 <= duration <= 8
        if status == "Started":
            assert decision.action == "hold"
        elif user:
            assert verdict(decision) == ("approve", "user-initiated")
        elif short_freeze:
            assert verdict(decision) == ("approve", "short-freeze")
        else:
            assert verdict(decision) == ("hold", "everything-else")


def test_every_example_policy_loads() -> None:
    names = sorted(path.name for path in EXAMPLES.glob("*.yaml"))
    assert names == ["docs-sample.yaml", "drain-then-approve.yaml", "scale-set-staggered.yaml",
                     "spot-checkpoint.yaml"]
    for path in EXAMPLES.glob("*.yaml"):
        assert load_policy(path, check_commands=False).rules  # their hook programs live on the user's VMs


def test_drain_example_runs_a_hook_before_reboots_of_this_vm_only() -> None:
    policy = load_policy(EXAMPLES / "drain-then-approve.yaml", check_commands=False)
    mine = decide(policy, event("Reboot", resources=("vm-0",)), "vm-0", NOW, NOW)
    assert verdict(mine) == ("approve", "drain-then-approve")
    assert policy.rules[0].prepare[0].command == ("/usr/local/bin/lb-member", "leave", "--wait-for-drain")
    theirs = decide(policy, event("Reboot", resources=("vm-7",)), "vm-0", NOW, NOW)
    assert theirs.action == "hold"
    assert policy.max_approvals_per_hour == 4 and policy.recover[0].name == "rejoin-load-balancer"


def test_spot_example_approves_preempt_even_after_a_failed_checkpoint() -> None:
    policy = load_policy(EXAMPLES / "spot-checkpoint.yaml", check_commands=False)
    decision = decide(policy, event("Preempt", duration=None, not_before_in=30), "vm-0", NOW, NOW)
    assert verdict(decision) == ("approve", "checkpoint-on-preempt")
    assert policy.rules[0].on_hook_failure == "approve"


def test_staggered_example_orders_vms_by_position_and_respects_windows() -> None:
    policy = load_policy(EXAMPLES / "scale-set-staggered.yaml")
    freeze = event("Freeze", duration=5, resources=("vm-0", "vm-1", "vm-2"))
    assert decide(policy, freeze, "vm-0", NOW, NOW).earliest == NOW
    assert decide(policy, freeze, "vm-2", NOW, NOW).earliest == NOW + 120
    reboot = event("Reboot", resources=("vm-0",), not_before_in=3600)
    at_noon = decide(policy, reboot, "vm-0", NOW, NOW)
    assert at_noon.action == "wait" and "maintenance windows" in at_noon.reason
    late = NOW + 11 * 3600  # 23:00 UTC Monday
    at_night = decide(policy, reboot, "vm-0", late, late)
    assert verdict(at_night) == ("approve", "nightly-maintenance")


def test_approve_within_waits_until_shortly_before_not_before() -> None:
    policy = parse_policy("rules: [{name: r, action: approve, approve_within: 600}]")
    decision = decide(policy, event(resources=("vm-0",), not_before_in=3600), "vm-0", NOW, NOW)
    assert decision.action == "approve" and decision.earliest == NOW + 3000


def test_window_across_midnight_belongs_to_the_day_it_starts() -> None:
    policy = parse_policy("maintenance_windows: [{days: [fri], start: '22:00', end: '02:00'}]\n"
                          "rules: [{name: all, action: approve}]")
    friday_2330 = datetime(2026, 11, 27, 23, 30, tzinfo=timezone.utc).timestamp()
    saturday_0130 = datetime(2026, 11, 28, 1, 30, tzinfo=timezone.utc).timestamp()
    sunday_0130 = datetime(2026, 11, 29, 1, 30, tzinfo=timezone.utc).timestamp()
    reboot = event("Reboot", resources=("vm-0",))
    assert decide(policy, reboot, "vm-0", friday_2330, friday_2330).action == "approve"
    assert decide(policy, reboot, "vm-0", saturday_0130, saturday_0130).action == "approve"
    assert decide(policy, reboot, "vm-0", sunday_0130, sunday_0130).action == "wait"
    freeze = event("Freeze", duration=5, resources=("vm-0",))
    assert decide(policy, freeze, "vm-0", sunday_0130, sunday_0130).action == "approve"


def test_first_mode_only_the_first_vm_approves() -> None:
    policy = parse_policy("leader: {mode: first}\nrules: [{name: all, action: approve}]")
    ev = event(resources=("vm-0", "vm-1"))
    assert decide(policy, ev, "vm-0", NOW, NOW).action == "approve"
    second = decide(policy, ev, "vm-1", NOW, NOW)
    assert second.action == "hold" and "vm-0 approves" in second.reason


def test_safety_rules_no_policy_can_override() -> None:
    policy = parse_policy("rules: [{name: all, action: approve}]")
    assert decide(policy, event(resources=("vm-9",)), "vm-0", NOW, NOW).action == "hold"
    assert decide(policy, event(), None, NOW, NOW).action == "hold"
    assert decide(policy, event(status="Started"), "vm-0", NOW, NOW).action == "hold"
    nothing = parse_policy("rules: [{name: freezes, match: {event_type: [Freeze]}, action: approve}]")
    decision = decide(nothing, event("Reboot"), "vm-0", NOW, NOW)
    assert verdict(decision) == ("hold", None)


@pytest.mark.parametrize(("match", "fits"), [
    ({"duration": {"min": 1, "max": 10}}, [False, False, True, False]),
    ({"duration": {"max": 10, "unknown": True}}, [True, True, True, False]),
    ({"duration": {"min": 0}}, [False, True, True, True]),
])
def test_duration_ranges_and_unknown(match: dict[str, Any], fits: list[bool]) -> None:
    import json

    policy = parse_policy(json.dumps({"rules": [{"name": "r", "match": match, "action": "approve"}]}))
    got = [decide(policy, event(duration=d, resources=("vm-0",)), "vm-0", NOW, NOW).action == "approve"
           for d in (-1, 0, 5, 900)]
    assert got == fits


def test_not_before_resources_and_description_matches() -> None:
    policy = parse_policy("""
rules:
  - name: soon
    match: {not_before_in: {max: 300}}
    action: approve
  - name: web
    match: {resources: ["web-*"], description: "live migration"}
    action: approve
  - name: rest
    action: hold
""")
    assert verdict(decide(policy, event(not_before_in=120, resources=("vm-0",)), "vm-0", NOW, NOW)) == \
        ("approve", "soon")
    web = event(resources=("web-3",), description="paused for a Live Migration")
    assert verdict(decide(policy, web, "web-3", NOW, NOW)) == ("approve", "web")
    assert verdict(decide(policy, event(resources=("web-3",)), "web-3", NOW, NOW)) == ("hold", "rest")


def test_a_decision_carries_the_rule_it_matched_and_why_earlier_rules_did_not() -> None:
    """The approver takes the prepare hooks and the record's policy_rule from `rule`, and `policy explain`
    prints `rule` and `skipped`: one value for both."""
    policy = parse_policy("""
rules:
  - name: freezes
    match: {event_type: [Freeze]}
    action: approve
  - name: mine
    match: {affects_this_vm: true}
    action: approve
    prepare: [{name: drain, command: [/bin/true]}]
""")
    decision = decide(policy, event("Reboot", resources=("vm-0",)), "vm-0", NOW, NOW)
    assert decision.action == "approve" and decision.rule is policy.rules[1]
    assert decision.rule.prepare[0].name == "drain"
    assert decision.skipped == ("freezes: event_type Reboot not in ['Freeze']",)
    held = decide(policy, event("Reboot", resources=("vm-7",)), "vm-0", NOW, NOW)
    assert (held.action, held.rule) == ("hold", None)
    assert held.skipped == ("freezes: event_type Reboot not in ['Freeze']", "mine: affects_this_vm is false")


def test_delay_postpones_the_approval() -> None:
    policy = parse_policy("rules: [{name: r, action: approve, delay: 30}]")
    assert decide(policy, event(resources=("vm-0",)), "vm-0", NOW, NOW - 10).earliest == NOW + 20


@pytest.mark.parametrize(("text", "error"), [
    ("rules: []", "p.yaml:1: rules: [] should be non-empty"),
    ("{}", "p.yaml:1: (top level): 'rules' is required"),
    ("rules:\n  - name: a\n    action: aprove\n",
     "p.yaml:3: rules[0].action: 'aprove' is not valid; valid: approve, hold"),
    ("rules:\n  - name: a\n    action: hold\n    colour: red\n",
     "p.yaml:2: rules[0]: unknown field 'colour'; valid: action, after_eviction, approve_within, delay, match, "
     "name, node, on_failure, on_hook_failure, prepare"),
    ("rules:\n  - name: a\n    action: approve\n    match:\n      event_type: [Reboots]\n",
     "p.yaml:5: rules[0].match.event_type[0]: 'Reboots' is not valid; valid: Freeze, Reboot, Redeploy, Preempt, "
     "Terminate"),
    ("rules:\n  - action: hold\n", "p.yaml:2: rules[0]: 'name' is required"),
    ("rules:\n  - {name: a, action: hold}\n  - {name: a, action: hold}\n",
     "p.yaml:3: rules[1].name: rule name 'a' is used twice"),
    ("rules:\n  - name: a\n    action: approve\n    match: {duration: {min: 9, max: 1}}\n",
     "p.yaml:4: rules[0].match.duration: min is greater than max"),
    ("rules:\n  - name: a\n    action: approve\n    match: {description: '('}\n",
     "p.yaml:4: rules[0].match.description: not a valid regular expression"),
    ("rules:\n  - name: a\n    action: approve\n    prepare:\n      - {command: 'drain.sh'}\n",
     "p.yaml:5: rules[0].prepare[0].command: 'drain.sh' must be a list of arguments, run without a shell"),
    ("rules:\n  - name: a\n    action: approve\n    prepare:\n      - {name: x}\n",
     "p.yaml:5: rules[0].prepare[0]: a hook needs either 'command' (a list of arguments) or 'webhook'"),
    ("rules:\n  - name: a\n    action: hold\n    prepare: [{command: [x]}]\n",
     "p.yaml:3: rules[0].action: prepare, delay and approve_within only apply to approve rules"),
    ("leader: {mode: random}\nrules: [{name: a, action: hold}]\n",
     "p.yaml:1: leader.mode: 'random' is not valid; valid: any, first, staggered"),
    ("maintenance_windows: [{start: '25:00', end: '02:00'}]\nrules: [{name: a, action: hold}]\n",
     "p.yaml:1: maintenance_windows[0].start: '25:00' is not a time; use HH:MM (UTC)"),
    ("rules: [{name: a, action: hold}\n", "p.yaml:2: not valid YAML"),
    ("dry_run: yes please\nrules: [{name: a, action: hold}]\n", "p.yaml:1: dry_run: 'yes please' is not of type"),
])
def test_malformed_policies_give_the_exact_error(text: str, error: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml")
    assert str(info.value).startswith(error), str(info.value)


def test_missing_file_is_a_policy_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(tmp_path / "none.yaml")


# --- commands that cannot run, empty files, numbers, encodings --------------------------------------

def forewarn(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "forewarn", *args], capture_output=True, text=True, timeout=30)


def hook_policy(tmp_path: Path, command: list[str]) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text("rules:\n  - name: drain\n    action: approve\n    prepare:\n"
                    f"      - name: lb\n        command: {json.dumps(command)}\n")
    return path


@pytest.mark.parametrize(("command", "problem"), [
    (["no-such-forewarn-hook", "--now"], "command 'no-such-forewarn-hook' not found on PATH"),
    (["/nonexistent/forewarn/drain"], "command '/nonexistent/forewarn/drain' not found"),
    (["{tmp}/plain.txt"], "command '{tmp}/plain.txt' is not executable"),
    (["{tmp}"], "command '{tmp}' is not executable"),
])
def test_policy_check_refuses_a_hook_command_that_cannot_run(tmp_path: Path, command: list[str],
                                                            problem: str) -> None:
    (tmp_path / "plain.txt").write_text("not a program\n")
    command = [part.replace("{tmp}", str(tmp_path)) for part in command]
    path = hook_policy(tmp_path, command)
    done = forewarn("policy", "check", str(path))
    assert done.returncode == 2, done.stdout
    assert done.stderr.strip() == f"forewarn policy: {path}:6: hook lb: {problem.replace('{tmp}', str(tmp_path))}"
    skipped = forewarn("policy", "check", "--no-command-check", str(path))
    assert skipped.returncode == 0 and "OK" in skipped.stdout, skipped.stderr


def test_policy_check_accepts_a_command_found_on_path(tmp_path: Path) -> None:
    done = forewarn("policy", "check", str(hook_policy(tmp_path, [Path(sys.executable).name, "-c", "pass"])))
    assert done.returncode == 0, done.stderr


def test_run_refuses_to_start_with_a_hook_command_that_cannot_run(tmp_path: Path) -> None:
    path = hook_policy(tmp_path, ["no-such-forewarn-hook"])
    done = subprocess.run([sys.executable, "-m", "forewarn", "run", "--policy", str(path), "--imds-endpoint",
                           "http://127.0.0.1:9", "--state-dir", str(tmp_path / "state"), "--listen-address",
                           f"127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert f"{path}:6: hook lb: command 'no-such-forewarn-hook' not found on PATH" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "---\n"])
def test_an_empty_policy_says_so(tmp_path: Path, text: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    done = forewarn("policy", "check", str(path))
    assert done.returncode == 2
    assert done.stderr.strip() == f"forewarn policy: {path}: the policy is empty; expected a mapping with 'rules'"


def test_a_policy_that_is_not_a_mapping_says_so() -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy("- name: a\n  action: hold\n", "p.yaml")
    assert str(info.value) == "p.yaml:1: (top level): expected a mapping with 'rules', e.g. rules: [...]"


def test_a_policy_that_is_not_utf8_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_bytes(b"rules: [{name: caf\xe9, action: hold}]\n")
    done = forewarn("policy", "check", str(path))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().startswith(f"forewarn policy: {path}: not UTF-8 text (byte 0xe9 at offset 18)")


BAD_NUMBERS = [".nan", ".NaN", ".inf", "-.inf", "-1", "1.0e+400", "100000000000000000000"]
NUMBER_FIELDS = [
    ("leader: {{mode: staggered, stagger: {v}}}\nrules: [{{name: a, action: approve}}]\n", 1, "leader.stagger"),
    ("rules:\n  - name: a\n    action: approve\n    delay: {v}\n", 4, "rules[0].delay"),
    ("rules:\n  - name: a\n    action: approve\n    approve_within: {v}\n", 4, "rules[0].approve_within"),
    ("rules:\n  - name: a\n    action: approve\n    prepare:\n      - {{command: [x], timeout: {v}}}\n", 5,
     "rules[0].prepare[0].timeout"),
    ("hooks:\n  recover:\n    - {{webhook: 'https://h/x', timeout: {v}}}\nrules: [{{name: a, action: hold}}]\n", 3,
     "hooks.recover[0].timeout"),
    ("rules:\n  - name: a\n    action: approve\n    match: {{duration: {{min: {v}}}}}\n", 4,
     "rules[0].match.duration.min"),
    ("rules:\n  - name: a\n    action: approve\n    match: {{duration: {{max: {v}}}}}\n", 4,
     "rules[0].match.duration.max"),
    ("max_approvals_per_hour: {v}\nrules: [{{name: a, action: approve}}]\n", 1, "max_approvals_per_hour"),
]


@pytest.mark.parametrize("value", BAD_NUMBERS)
@pytest.mark.parametrize(("template", "line", "field_name"), NUMBER_FIELDS)
def test_numbers_must_be_finite_and_in_range(template: str, line: int, field_name: str, value: str) -> None:
    if value == "-1" and field_name.endswith(("duration.min", "duration.max")):
        value = "-5"
    with pytest.raises(PolicyError) as info:
        parse_policy(template.format(v=value), "p.yaml")
    assert str(info.value).startswith(f"p.yaml:{line}: {field_name}: "), str(info.value)


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "1.0e+400", "-100000000000"])
@pytest.mark.parametrize("bound", ["min", "max"])
def test_not_before_bounds_must_be_finite_and_in_range(value: str, bound: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(f"rules:\n  - name: a\n    action: approve\n    match: {{not_before_in: {{{bound}: {value}}}}}\n",
                     "p.yaml")
    assert str(info.value).startswith(f"p.yaml:4: rules[0].match.not_before_in.{bound}: "), str(info.value)


def test_nan_stagger_no_longer_defeats_staggered_approval() -> None:
    with pytest.raises(PolicyError, match=r"p.yaml:1: leader.stagger: \.?nan is not a finite number"):
        parse_policy("leader: {mode: staggered, stagger: .nan}\nrules: [{name: a, action: approve}]\n", "p.yaml")


def test_sane_numbers_still_load() -> None:
    policy = parse_policy("leader: {mode: staggered, stagger: 3600}\nmax_approvals_per_hour: 60\n"
                          "rules:\n  - {name: a, action: approve, delay: 0.5, approve_within: 604800,\n"
                          "     match: {duration: {min: 0, max: 86400}, not_before_in: {min: -60, max: 604800}},\n"
                          "     prepare: [{command: [x], timeout: 3600}]}\n")
    assert policy.stagger == 3600 and policy.rules[0].approve_within == 604800


@pytest.mark.parametrize(("env", "error"), [
    ("[PATH, MY_TOKEN, _x9]", None),
    ("[9LIVES]", "p.yaml:5: rules[0].prepare[0].env[0]: '9LIVES' is not a variable name; valid: letters, digits and _, "
                 "not starting with a digit"),
    ("['A=B']", "p.yaml:5: rules[0].prepare[0].env[0]: 'A=B' is not a variable name"),
    ("MY_TOKEN", "p.yaml:5: rules[0].prepare[0].env: 'MY_TOKEN' is not of type 'array'"),
])
def test_hook_env_lists_variable_names(env: str, error: str | None) -> None:
    text = f"rules:\n  - name: a\n    action: approve\n    prepare:\n      - {{command: [x], env: {env}}}\n"
    if error is None:
        assert parse_policy(text).rules[0].prepare[0].env == ("PATH", "MY_TOKEN", "_x9")
        return
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml")
    assert str(info.value).startswith(error), str(info.value)
