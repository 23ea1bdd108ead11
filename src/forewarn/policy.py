"""Approval policy: which scheduled events forewarn may start early, and when.

Loading checks the file against `schemas/policy.schema.json` and reports the first problem with its
file, line and field. `decide` is pure: given a policy, an event and the moment, it says what to do and
why; the approver carries the decision out (hooks, leader election timing, the POST).

Safety rules that no policy can change:
- without a policy nothing is approved (there is no default rule that approves);
- only Scheduled events are approved, and only by a VM that is among the event's Resources, because an
  approval releases the event for every VM it lists;
- an event no rule matches is held.
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from forewarn.imds.document import Event
from forewarn.yamlerrors import yaml_problem

DEFAULT_IMPACTFUL = ("Reboot", "Redeploy", "Preempt", "Terminate")
DEFAULT_STAGGER = 60.0
DEFAULT_HOOK_TIMEOUT = 60.0
_DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


class PolicyError(ValueError):
    """The policy file is unusable. `str()` is `FILE:LINE: field: problem`."""


@dataclass(frozen=True)
class Hook:
    name: str
    command: tuple[str, ...] = ()
    webhook: str | None = None
    timeout: float = DEFAULT_HOOK_TIMEOUT


@dataclass(frozen=True)
class Match:
    event_type: frozenset[str] | None = None
    source: frozenset[str] | None = None
    status: frozenset[str] | None = None
    duration_min: int | None = None
    duration_max: int | None = None
    duration_unknown: bool = False
    duration_set: bool = False
    not_before_min: float | None = None
    not_before_max: float | None = None
    affects_this_vm: bool | None = None
    resources: tuple[str, ...] = ()
    description: re.Pattern[str] | None = None


@dataclass(frozen=True)
class Rule:
    name: str
    action: str
    match: Match = field(default_factory=Match)
    prepare: tuple[Hook, ...] = ()
    on_hook_failure: str = "hold"
    delay: float = 0.0
    approve_within: float | None = None


@dataclass(frozen=True)
class Window:
    days: frozenset[int]
    start: int      # minutes after midnight UTC
    end: int

    def contains(self, moment: datetime) -> bool:
        minute = moment.hour * 60 + moment.minute
        day = moment.weekday()
        if self.start < self.end:
            return day in self.days and self.start <= minute < self.end
        # Across midnight: the part after midnight belongs to the window that started the day before.
        if minute >= self.start:
            return day in self.days
        return minute < self.end and (day - 1) % 7 in self.days


@dataclass(frozen=True)
class Policy:
    rules: tuple[Rule, ...]
    dry_run: bool = False
    leader_mode: str = "any"
    stagger: float = DEFAULT_STAGGER
    max_approvals_per_hour: int | None = None
    windows: tuple[Window, ...] = ()
    impactful_types: frozenset[str] = frozenset(DEFAULT_IMPACTFUL)
    recover: tuple[Hook, ...] = ()
    source: str = "<policy>"


@dataclass(frozen=True)
class Decision:
    """What the policy says about one event at one moment.

    `action` is `approve` (send it, from `not_before_time` on, once hooks passed), `hold` (a rule or a
    safety rule says no) or `wait` (approve later: outside a maintenance window, or another VM leads).
    """

    action: str
    rule: str | None
    reason: str
    earliest: float | None = None


# --- loading ----------------------------------------------------------------------------------

def _schema() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(
        resources.files("forewarn").joinpath("schemas/policy.schema.json").read_text(encoding="utf-8"))
    return loaded


def _line_of(root: yaml.Node | None, path: Sequence[str | int]) -> int | None:
    """The 1-based line of the YAML node at `path` (keys and indexes), or of its nearest parent."""
    node = root
    line = node.start_mark.line + 1 if node is not None else None
    for step in path:
        if isinstance(node, yaml.MappingNode):
            found = next((value for key, value in node.value if getattr(key, "value", None) == step), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(step, int) and step < len(node.value):
            found = node.value[step]
        else:
            found = None
        if found is None:
            break
        node = found
        line = node.start_mark.line + 1
    return line


def _field(path: Sequence[str | int]) -> str:
    text = ""
    for step in path:
        text += f"[{step}]" if isinstance(step, int) else (f".{step}" if text else str(step))
    return text or "(top level)"


def _describe(error: jsonschema.ValidationError) -> str:
    schema = error.schema if isinstance(error.schema, Mapping) else {}
    if error.validator == "additionalProperties":
        allowed = sorted(schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed)) if isinstance(error.instance, dict) else []
        return f"unknown field {extra[0]!r}; valid: {', '.join(allowed)}" if extra else error.message
    if error.validator == "enum":
        values = error.validator_value if isinstance(error.validator_value, list) else []
        return f"{error.instance!r} is not valid; valid: {', '.join(map(str, values))}"
    if error.validator == "required":
        return error.message.replace("is a required property", "is required")
    if error.validator == "oneOf" and isinstance(error.instance, dict):
        return "a hook needs either 'command' (a list of arguments) or 'webhook' (an http(s) URL), with " \
               "optional 'name' and 'timeout'"
    if error.validator == "type" and list(error.absolute_path)[-1:] == ["command"]:
        return (f"{error.instance!r} must be a list of arguments, run without a shell, "
                f"e.g. [\"/usr/bin/drain\", \"--now\"]")
    if error.validator == "pattern" and str(error.validator_value).startswith("^([01]"):
        return f"{error.instance!r} is not a time; use HH:MM (UTC)"
    return error.message


def load_policy(path: str | Path) -> Policy:
    """Read, validate and compile a policy file; raises PolicyError naming file, line and field."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(f"{path}: cannot read ({exc.strerror or exc})") from None
    return parse_policy(text, str(path))


def parse_policy(text: str, source: str = "<policy>") -> Policy:
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        line, _, problem = yaml_problem(exc)
        raise PolicyError(f"{source}{f':{line}' if line else ''}: not valid YAML ({problem})") from None
    if data is None:
        data = {}
    validator = jsonschema.Draft202012Validator(_schema())
    errors = sorted(validator.iter_errors(data), key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    if errors:
        error = jsonschema.exceptions.best_match(errors)
        path = list(error.absolute_path)
        line = _line_of(root, path)
        raise PolicyError(f"{source}:{line}: {_field(path)}: {_describe(error)}")

    def fail(path: Sequence[str | int], message: str) -> PolicyError:
        return PolicyError(f"{source}:{_line_of(root, path)}: {_field(path)}: {message}")

    names: set[str] = set()
    rules = []
    for index, raw in enumerate(data["rules"]):
        if raw["name"] in names:
            raise fail(["rules", index, "name"], f"rule name {raw['name']!r} is used twice")
        names.add(raw["name"])
        rules.append(_compile_rule(raw, index, fail))
    windows = []
    for index, raw in enumerate(data.get("maintenance_windows", [])):
        start, end = _minutes(raw["start"]), _minutes(raw["end"])
        if start == end:
            raise fail(["maintenance_windows", index], "start and end are the same time")
        days = frozenset(_DAYS.index(day) for day in raw.get("days", _DAYS))
        windows.append(Window(days=days, start=start, end=end))
    leader = data.get("leader", {})
    return Policy(
        rules=tuple(rules),
        dry_run=bool(data.get("dry_run", False)),
        leader_mode=leader.get("mode", "any"),
        stagger=float(leader.get("stagger", DEFAULT_STAGGER)),
        max_approvals_per_hour=data.get("max_approvals_per_hour"),
        windows=tuple(windows),
        impactful_types=frozenset(data.get("impactful_types", DEFAULT_IMPACTFUL)),
        recover=_hooks(data.get("hooks", {}).get("recover", []), "recover"),
        source=source,
    )


def _minutes(text: str) -> int:
    hours, minutes = text.split(":")
    return int(hours) * 60 + int(minutes)


def _hooks(raw: list[dict[str, Any]], prefix: str) -> tuple[Hook, ...]:
    hooks = []
    for index, item in enumerate(raw):
        name = item.get("name") or f"{prefix}[{index}]"
        hooks.append(Hook(name=name, command=tuple(item.get("command", ())), webhook=item.get("webhook"),
                          timeout=float(item.get("timeout", DEFAULT_HOOK_TIMEOUT))))
    return tuple(hooks)


def _compile_rule(raw: Mapping[str, Any], index: int, fail: Any) -> Rule:
    match = raw.get("match", {})
    duration = match.get("duration")
    window = match.get("not_before_in", {})
    if duration and "min" in duration and "max" in duration and duration["min"] > duration["max"]:
        raise fail(["rules", index, "match", "duration"], "min is greater than max")
    if "min" in window and "max" in window and window["min"] > window["max"]:
        raise fail(["rules", index, "match", "not_before_in"], "min is greater than max")
    pattern = None
    if "description" in match:
        try:
            pattern = re.compile(match["description"], re.IGNORECASE)
        except re.error as exc:
            raise fail(["rules", index, "match", "description"], f"not a valid regular expression ({exc})") from None
    if raw["action"] == "hold" and (raw.get("prepare") or "delay" in raw or "approve_within" in raw):
        raise fail(["rules", index, "action"], "prepare, delay and approve_within only apply to approve rules")
    return Rule(
        name=raw["name"],
        action=raw["action"],
        match=Match(
            event_type=frozenset(match["event_type"]) if "event_type" in match else None,
            source=frozenset(match["source"]) if "source" in match else None,
            status=frozenset(match["status"]) if "status" in match else None,
            duration_min=duration.get("min") if duration else None,
            duration_max=duration.get("max") if duration else None,
            duration_unknown=bool(duration.get("unknown", False)) if duration else False,
            duration_set=duration is not None,
            not_before_min=window.get("min"),
            not_before_max=window.get("max"),
            affects_this_vm=match.get("affects_this_vm"),
            resources=tuple(match.get("resources", ())),
            description=pattern,
        ),
        prepare=_hooks(raw.get("prepare", []), f"{raw['name']}.prepare"),
        on_hook_failure=raw.get("on_hook_failure", "hold"),
        delay=float(raw.get("delay", 0)),
        approve_within=raw.get("approve_within"),
    )


# --- deciding ---------------------------------------------------------------------------------

def mismatch(match: Match, event: Event, vm_name: str | None, now: float) -> str | None:
    """Why `match` does not fit `event` (None when it does)."""
    if match.event_type is not None and event.event_type not in match.event_type:
        return f"event_type {event.event_type} not in {sorted(match.event_type)}"
    if match.source is not None and (event.source or "") not in match.source:
        return f"source {event.source or '(none)'} not in {sorted(match.source)}"
    if match.status is not None and event.status not in match.status:
        return f"status {event.status} not in {sorted(match.status)}"
    if match.duration_set:
        duration = event.duration_seconds
        if duration is None or duration < 0:
            if not match.duration_unknown:
                return "duration is unknown and the rule does not accept unknown durations"
        elif (match.duration_min is not None and duration < match.duration_min) or (
                match.duration_max is not None and duration > match.duration_max):
            return f"duration {duration} s outside [{match.duration_min}, {match.duration_max}]"
    if match.not_before_min is not None or match.not_before_max is not None:
        remaining = event.seconds_to_not_before(now)
        if remaining is None:
            return "no NotBefore to compare"
        if (match.not_before_min is not None and remaining < match.not_before_min) or (
                match.not_before_max is not None and remaining > match.not_before_max):
            return f"NotBefore in {remaining:.0f} s outside [{match.not_before_min}, {match.not_before_max}]"
    if match.affects_this_vm is not None and event.affects(vm_name) != match.affects_this_vm:
        return f"affects_this_vm is {str(event.affects(vm_name)).lower()}"
    if match.resources and not any(fnmatch.fnmatchcase(r, p) for r in event.resources for p in match.resources):
        return f"no resource matches {list(match.resources)}"
    if match.description is not None and not match.description.search(event.description or ""):
        return f"description does not match /{match.description.pattern}/"
    return None


def first_match(policy: Policy, event: Event, vm_name: str | None, now: float) -> tuple[Rule | None, list[str]]:
    """The first rule that fits, and why each earlier rule did not."""
    misses: list[str] = []
    for rule in policy.rules:
        why = mismatch(rule.match, event, vm_name, now)
        if why is None:
            return rule, misses
        misses.append(f"{rule.name}: {why}")
    return None, misses


def in_window(policy: Policy, event_type: str, now: float) -> bool:
    if not policy.windows or event_type not in policy.impactful_types:
        return True
    moment = datetime.fromtimestamp(now, tz=timezone.utc)
    return any(window.contains(moment) for window in policy.windows)


def decide(policy: Policy, event: Event, vm_name: str | None, now: float, first_seen: float) -> Decision:
    """What to do with `event` at `now`, seen first at `first_seen`, as the VM `vm_name`."""
    rule, _ = first_match(policy, event, vm_name, now)
    if rule is None:
        return Decision("hold", None, "no rule matched (events no rule matches are held)")
    if rule.action == "hold":
        return Decision("hold", rule.name, f"rule {rule.name} holds it")
    if event.status != "Scheduled":
        return Decision("hold", rule.name, f"already {event.status}: only Scheduled events can be approved")
    if not event.affects(vm_name):
        return Decision("hold", rule.name, "this VM is not in Resources; only an affected VM approves, since "
                        "an approval releases the event for every VM it lists")
    earliest = first_seen + rule.delay
    position = event.resources.index(vm_name) if vm_name in event.resources else 0
    if policy.leader_mode == "first" and position != 0:
        return Decision("hold", rule.name, f"leader mode first: {event.resources[0]} approves")
    if policy.leader_mode == "staggered" and position:
        earliest = max(earliest, first_seen + position * policy.stagger)
    if rule.approve_within is not None and event.not_before is not None:
        earliest = max(earliest, event.not_before.timestamp() - rule.approve_within)
    if not in_window(policy, event.event_type, now):
        return Decision("wait", rule.name, "outside the maintenance windows", earliest)
    reason = f"rule {rule.name} approves"
    if policy.leader_mode == "staggered" and position:
        wait = position * policy.stagger
        reason += f" (position {position} in Resources: if still Scheduled {wait:g} s after it appeared)"
    return Decision("approve", rule.name, reason, earliest)
