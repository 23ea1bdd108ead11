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
import math
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from forewarn.config import safe_url
from forewarn.imds.document import Event
from forewarn.yamlerrors import yaml_problem

DEFAULT_IMPACTFUL = ("Reboot", "Redeploy", "Preempt", "Terminate")
DEFAULT_STAGGER = 60.0
DEFAULT_HOOK_TIMEOUT = 60.0
NODE_ACTIONS = ("cordon", "taint", "label", "condition", "event", "drain")
DEFAULT_NODE_KEY = "forewarn.io/scheduled-event"   # the default taint and label key
DEFAULT_CONDITION = "ForewarnScheduledEvent"
DEFAULT_DRAIN_TIMEOUT = 600.0
DEFAULT_DRAIN_MARGIN = 5.0
#: The PriorityClasses a drain evicts last, whatever their value (Kubernetes' own, for the cluster's and the
#: node's critical pods: DNS, CNI, proxies).
CRITICAL_CLASSES = ("system-cluster-critical", "system-node-critical")
#: The NoExecute taint a drain with stop_daemonsets puts on the node once it is empty: DaemonSet pods that do
#: not tolerate it stop with their own grace period (forewarn's own DaemonSet tolerates it).
STOP_TAINT = "forewarn.io/drained"
_DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


class PolicyError(ValueError):
    """The policy file is unusable. `str()` is `FILE:LINE: field: problem`."""


@dataclass(frozen=True)
class Hook:
    name: str
    command: tuple[str, ...] = ()
    webhook: str | None = field(default=None, repr=False)   # often carries a token: never printed whole
    timeout: float = DEFAULT_HOOK_TIMEOUT
    env: tuple[str, ...] = ()     # names of variables passed from forewarn's environment to the command

    def target(self) -> str:
        """What the hook runs, safe to show: the command's program, or the webhook as scheme://host/..."""
        return f"webhook {safe_url(self.webhook)}" if self.webhook else f"command {self.command[0]}"


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"]*")


def _hide_urls(message: str, webhooks: Sequence[str]) -> str:
    """`message` without any webhook URL in it (also one so malformed it has no scheme)."""
    for webhook in sorted(webhooks, key=len, reverse=True):
        if webhook:
            message = message.replace(webhook, safe_url(webhook))
    return _URL.sub(lambda found: safe_url(found.group(0)), message)


# A label key: an optional DNS-subdomain prefix and '/', then a name of at most 63 characters
# (Kubernetes' IsQualifiedName); a value: empty or a name of at most 63 characters (IsValidLabelValue).
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_PREFIX = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_LABEL_KEY = re.compile(rf"({_LABEL_PREFIX}/)?{_LABEL_NAME}")
_LABEL_VALUE = re.compile(rf"({_LABEL_NAME})?")
_SELECTOR_TOKEN = re.compile(r"\s*(==|!=|=|!|\(|\)|,|<|>|[^\s!=(),<>]+)")
SELECTOR_GRAMMAR = "k=v, k==v, k!=v, k, !k, k in (a,b), k notin (a,b), joined by ',' (all must hold)"


@dataclass(frozen=True)
class LabelRequirement:
    """One term of a label selector: `op` is =, !=, in, notin, exists or ! (the key is absent)."""

    key: str
    op: str
    values: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.op == "exists":
            return self.key
        if self.op == "!":
            return f"!{self.key}"
        if self.op in ("in", "notin"):
            return f"{self.key} {self.op} ({','.join(self.values)})"
        return f"{self.key}{self.op}{self.values[0]}"


def _label_key(text: str) -> str:
    if not _LABEL_KEY.fullmatch(text) or len(text.rpartition("/")[0]) > 253:
        raise ValueError(f"{text!r} is not a valid label key: a name of at most 63 letters, digits, '-', '_' and "
                         "'.', starting and ending with a letter or digit, optionally after a DNS subdomain and "
                         "'/' (e.g. forewarn.io/cannot-pause)")
    return text


def _label_value(text: str) -> str:
    if not _LABEL_VALUE.fullmatch(text):
        raise ValueError(f"{text!r} is not a valid label value: at most 63 letters, digits, '-', '_' and '.', "
                         "starting and ending with a letter or digit")
    return text


def parse_label_selector(text: str) -> tuple[LabelRequirement, ...]:
    """The requirements of a label selector in the grammar of `kubectl -l` (SELECTOR_GRAMMAR), checked as
    the API server checks them; raises ValueError saying what is wrong and where. An empty selector, which
    would select every pod, is refused: a drain of the whole node is a drain without a selector."""
    tokens: list[str] = []
    position = 0
    while position < len(text):
        found = _SELECTOR_TOKEN.match(text, position)
        if found is None:  # only trailing whitespace is left
            break
        tokens.append(found.group(1))
        position = found.end()
    if not tokens:
        raise ValueError("the selector is empty; leave 'selector' out to drain every pod on the node")
    requirements: list[LabelRequirement] = []
    at = 0

    def peek() -> str | None:
        return tokens[at] if at < len(tokens) else None

    def take(what: str) -> str:
        nonlocal at
        token = peek()
        if token is None:
            raise ValueError(f"expected {what} at the end")
        at += 1
        return token

    def is_word(token: str | None) -> bool:
        return token is not None and token not in ("==", "!=", "=", "!", "(", ")", ",", "<", ">")

    while True:
        first = take("a requirement")
        if first == "!":
            key = take("a label key after '!'")
            if not is_word(key):
                raise ValueError(f"expected a label key after '!', found {key!r}")
            requirements.append(LabelRequirement(_label_key(key), "!"))
        elif not is_word(first) or first in ("in", "notin"):
            raise ValueError(f"expected a label key, found {first!r}")
        else:
            key = _label_key(first)
            operator = peek()
            if operator is None or operator == ",":
                requirements.append(LabelRequirement(key, "exists"))
            elif operator in ("=", "==", "!="):
                at += 1
                value = peek()
                if value is None or value == ",":  # k= selects the label with an empty value
                    value = ""
                elif is_word(value):
                    at += 1
                else:
                    raise ValueError(f"expected a value after '{key}{operator}', found {value!r}")
                requirements.append(LabelRequirement(key, "!=" if operator == "!=" else "=", (_label_value(value),)))
            elif operator in ("in", "notin"):
                at += 1
                if peek() != "(":
                    raise ValueError(f"expected '(' after '{key} {operator}', e.g. {key} {operator} (x,y)")
                at += 1
                if peek() == ")":
                    raise ValueError(f"the set of '{key} {operator}' is empty; it needs at least one value")
                values: list[str] = []
                while True:
                    value = take(f"a value or ')' in the set of '{key} {operator}'")
                    if not is_word(value):
                        raise ValueError(f"expected a value in the set of '{key} {operator}', found {value!r}")
                    values.append(_label_value(value))
                    after = take(f"',' or ')' in the set of '{key} {operator}'")
                    if after == ")":
                        break
                    if after != ",":
                        raise ValueError(f"expected ',' or ')' in the set of '{key} {operator}', found {after!r}")
                requirements.append(LabelRequirement(key, operator, tuple(values)))
            elif operator in ("<", ">"):
                raise ValueError(f"the operator {operator!r} is not supported; valid: {SELECTOR_GRAMMAR}")
            else:
                raise ValueError(f"expected an operator or ',' after {key!r}, found {operator!r}")
        separator = peek()
        if separator is None:
            return tuple(requirements)
        if separator != ",":
            raise ValueError(f"expected ',' or the end after '{requirements[-1]}', found {separator!r}")
        at += 1


@dataclass(frozen=True)
class NodeAction:
    """One action on this Kubernetes node, with its options (those of other kinds keep their defaults)."""

    kind: str                                  # one of NODE_ACTIONS
    key: str = DEFAULT_NODE_KEY                # taint, label
    value: str | None = None                   # taint, label; None: the event type
    effect: str = "NoSchedule"                 # taint
    condition_type: str = DEFAULT_CONDITION    # condition
    reason: str = "ScheduledEvent"             # event
    event_type: str = "Warning"                # event: Normal or Warning
    timeout: float = DEFAULT_DRAIN_TIMEOUT     # drain: the longest it may take
    margin: float = DEFAULT_DRAIN_MARGIN       # drain: done this long before NotBefore
    grace: int | None = None                   # drain: the longest grace period a pod gets
    delete_local_data: bool = False            # drain: evict pods with emptyDir volumes too
    max_nodes: int = 1                         # drain: nodes draining at once, cluster-wide
    lease_namespace: str | None = None         # drain: where the Leases of that cap live
    selector: tuple[LabelRequirement, ...] = ()  # drain: only the pods matching all of these; () every pod
    order: str = "priority"                    # drain: priority (lowest first, tier by tier) or none (all at once)
    last: tuple[str, ...] = CRITICAL_CLASSES   # drain: PriorityClasses evicted after every other pod
    stop_daemonsets: bool = False              # drain: then a NoExecute taint stops the DaemonSet pods
    at_deadline: str = "report"                # drain: report (fail, naming the pods left) or delete them

    @property
    def selector_text(self) -> str:
        """The drain's label selector as the API takes it ('' for a drain of every pod)."""
        return ",".join(map(str, self.selector))

    @property
    def order_text(self) -> str:
        """The drain's eviction order in words (policy explain, the docs)."""
        if self.order == "none":
            return "every pod at once"
        last = f"; {', '.join(self.last)} last" if self.last else ""
        return f"by pod priority, lowest first, each tier waited for{last}"

    def describe(self) -> str:
        """The action as `policy explain` shows it."""
        if self.kind == "taint":
            return f"taint {self.key}={self.value or '<event type>'}:{self.effect}"
        if self.kind == "label":
            return f"label {self.key}={self.value or '<event type>'}"
        if self.kind == "condition":
            return f"condition {self.condition_type}"
        if self.kind == "event":
            return f"event {self.event_type} {self.reason}"
        if self.kind == "drain":
            extra = f", grace at most {self.grace} s" if self.grace else ""
            local = ", evicting pods with local storage" if self.delete_local_data else ""
            pods = f" pods matching {self.selector_text}" if self.selector else ""
            return (f"drain{pods} (within {self.timeout:g} s, done {self.margin:g} s before NotBefore{extra}{local}; "
                    f"at most {self.max_nodes} node(s) draining at once; {self.order_text}; at the deadline: "
                    + ("delete the pods left with the grace that is left" if self.at_deadline == "delete" else
                       "report the pods left and fail")
                    + (f"; then taint {STOP_TAINT}:NoExecute so DaemonSet pods stop" if self.stop_daemonsets else "")
                    + ")")
        return self.kind


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
    # forewarn fleet only: where the event is (names compared in lower case)
    subscriptions: frozenset[str] | None = None
    resource_groups: tuple[str, ...] = ()
    scale_sets: tuple[str, ...] = ()
    vms: tuple[str, ...] = ()

    @property
    def uses_place(self) -> bool:
        return bool(self.subscriptions or self.resource_groups or self.scale_sets or self.vms)


@dataclass(frozen=True)
class Place:
    """Where an event of the fleet is (forewarn fleet): what the fleet match keys compare."""

    subscription_id: str
    resource_group: str
    scale_set: str = ""           # the scale set the event names, or ""
    vms: tuple[str, ...] = ()     # the VMs in its Resources


@dataclass(frozen=True)
class Rule:
    name: str
    action: str
    match: Match = field(default_factory=Match)
    prepare: tuple[Hook, ...] = ()
    on_hook_failure: str = "hold"
    delay: float = 0.0
    approve_within: float | None = None
    node: tuple[NodeAction, ...] = ()
    on_failure: str = "hold"                   # when a node action fails: hold, or approve all the same
    after_eviction: str | None = None          # fleet: out_of_service or delete_node once a Preempt/Terminate completed


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
class Rollout:
    """forewarn fleet's limits: events in progress (node actions begun, or approved, and not ended) fleet-wide
    and per scale set or availability set, and the least time between two approvals."""

    max_in_progress: int | None = None
    max_in_progress_per_group: int | None = None
    stagger: float = 0.0


@dataclass(frozen=True)
class Policy:
    rules: tuple[Rule, ...]
    dry_run: bool = False
    leader_mode: str = "any"
    stagger: float = DEFAULT_STAGGER
    max_approvals_per_hour: int | None = None
    rollout: Rollout | None = None               # forewarn fleet: limits on events in progress
    windows: tuple[Window, ...] = ()
    impactful_types: frozenset[str] = frozenset(DEFAULT_IMPACTFUL)
    recover: tuple[Hook, ...] = ()
    source: str = "<policy>"

    @property
    def uses_node_actions(self) -> bool:
        """Whether any rule acts on the Kubernetes node (only then is a Kubernetes client needed)."""
        return any(rule.node or rule.after_eviction for rule in self.rules)

    @property
    def uses_hooks(self) -> bool:
        """Whether any hook may run: a rule's prepare hooks or the recover hooks."""
        return bool(self.recover) or any(rule.prepare for rule in self.rules)


@dataclass(frozen=True)
class Decision:
    """What the policy says about one event at one moment.

    `action` is `approve` (send it, from `earliest` on, once hooks passed), `hold` (a rule or a safety
    rule says no) or `wait` (approve later: outside a maintenance window). `rule` is the rule that
    matched (None when none did), whatever the action: the approver runs its prepare hooks and names it
    in the `approved` record, and `policy explain` prints it, so both show the same rule. `skipped` says
    why each earlier rule did not match.
    """

    action: str
    rule: Rule | None
    reason: str
    earliest: float | None = None
    skipped: tuple[str, ...] = ()


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


def _within_hook(error: jsonschema.ValidationError) -> jsonschema.ValidationError:
    """For a hook that fits neither shape, the problem inside the shape its key chose (`command` or
    `webhook`), e.g. its timeout, rather than "needs either command or webhook"."""
    if error.validator != "oneOf" or not isinstance(error.instance, dict) or not error.context:
        return error
    branches = error.validator_value if isinstance(error.validator_value, list) else []
    chosen = [index for index, branch in enumerate(branches) if set(branch.get("required", ())) <= set(error.instance)]
    if len(chosen) != 1:
        return error
    inside = [e for e in error.context if e.relative_schema_path and e.relative_schema_path[0] == chosen[0]]
    return jsonschema.exceptions.best_match(inside) if inside else error


def _describe(error: jsonschema.ValidationError) -> str:
    schema = error.schema if isinstance(error.schema, Mapping) else {}
    where = list(error.absolute_path)
    if not where and error.validator == "type":
        return "expected a mapping with 'rules', e.g. rules: [...]"
    if where[-1:] == ["webhook"]:
        return "must be an http:// or https:// URL (the value is not shown: it may hold a token)"
    if where[-2:-1] == ["env"] and error.validator == "pattern":
        return f"{error.instance!r} is not a variable name; valid: letters, digits and _, not starting with a digit"
    if error.validator == "additionalProperties":
        allowed = sorted(schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed)) if isinstance(error.instance, dict) else []
        return f"unknown field {extra[0]!r}; valid: {', '.join(allowed)}" if extra else error.message
    if error.validator == "enum":
        values = error.validator_value if isinstance(error.validator_value, list) else []
        return f"{error.instance!r} is not valid; valid: {', '.join(map(str, values))}"
    if error.validator == "required":
        return error.message.replace("is a required property", "is required")
    if error.validator == "pattern" and where[-2:] == ["condition", "type"]:
        return (f"{error.instance!r} must start with Forewarn: forewarn writes only its own condition, never "
                "another component's (such as VMEventScheduled)")
    if error.validator == "pattern" and where[-1:] in (["key"], ["value"]) and "node" in where:
        return (f"{error.instance!r} is not a valid Kubernetes {where[-1]}; valid: letters, digits, '-', '_', '.' "
                "(at most 63, starting and ending with a letter or digit), a key optionally prefixed by a DNS name "
                "and '/'")
    if error.validator == "pattern" and where[-2:-1] == ["last"]:
        return (f"{error.instance!r} is not a PriorityClass name; valid: lower-case letters, digits, '-' and '.', "
                "starting and ending with a letter or digit, e.g. system-cluster-critical")
    if error.validator == "pattern" and where[-1:] == ["reason"]:
        return f"{error.instance!r} is not a valid reason; valid: CamelCase letters and digits, e.g. NodeDraining"
    if error.validator == "oneOf" and "node" in where:
        return (f"{error.instance!r} is not a node action; valid: {', '.join(NODE_ACTIONS)}, alone or as a "
                "mapping of the name to its options, e.g. {drain: {timeout: 300}}")
    if error.validator == "oneOf" and isinstance(error.instance, dict):
        return "a hook needs either 'command' (a list of arguments) or 'webhook' (an http(s) URL), with " \
               "optional 'name' and 'timeout'; a command may also list 'env' (names of variables to pass)"
    if error.validator in ("maximum", "minimum", "exclusiveMinimum", "exclusiveMaximum"):
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        above = "more than" if "exclusiveMinimum" in schema else "from"
        return f"{error.instance!r} is out of range; valid: {above} {low} to {schema.get('maximum')}"
    if error.validator == "type" and list(error.absolute_path)[-1:] == ["command"]:
        return (f"{error.instance!r} must be a list of arguments, run without a shell, "
                f"e.g. [\"/usr/bin/drain\", \"--now\"]")
    if error.validator == "pattern" and str(error.validator_value).startswith("^([01]"):
        return f"{error.instance!r} is not a time; use HH:MM (UTC)"
    return error.message


def load_policy(path: str | Path, check_commands: bool = True, fleet: bool = False) -> Policy:
    """Read, validate and compile a policy file; raises PolicyError naming file, line and field.

    `check_commands`: every hook command must be found (on PATH, or at its path) and be executable now,
    so a policy whose drain script is missing stops start-up instead of holding every event later.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PolicyError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError(f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                          "save the policy as UTF-8") from None
    return parse_policy(text, str(path), check_commands=check_commands, fleet=fleet)


def _not_finite(data: Any, path: list[str | int]) -> list[str | int] | None:
    """The path of the first NaN or infinity in `data`: JSON Schema compares NaN false with every bound,
    so `stagger: .nan` would pass `exclusiveMinimum` and then defeat the stagger."""
    if isinstance(data, float) and not math.isfinite(data):
        return path
    items: Any = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        found = _not_finite(value, [*path, key])
        if found is not None:
            return found
    return None


def _webhooks(data: Any) -> list[str]:
    """Every string under a `webhook` key, wherever it sits, to keep them out of error messages."""
    if isinstance(data, dict):
        found = [v for k, v in data.items() if k == "webhook" and isinstance(v, str)]
        return found + [w for v in data.values() for w in _webhooks(v)]
    if isinstance(data, list):
        return [w for v in data for w in _webhooks(v)]
    return []


def parse_policy(text: str, source: str = "<policy>", check_commands: bool = False, fleet: bool = False) -> Policy:
    """Compile policy text. `check_commands` as in `load_policy` (off here: tests and the Kubernetes
    manifests parse policies for machines whose hook programs this one does not have). `fleet`: for
    `forewarn fleet`, which decides for the whole fleet (see `_check_mode`)."""
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        line, _, problem = yaml_problem(exc)
        raise PolicyError(f"{source}{f':{line}' if line else ''}: not valid YAML ({problem})") from None
    if data is None:
        raise PolicyError(f"{source}: the policy is empty; expected a mapping with 'rules'")
    webhooks = _webhooks(data)

    def fail(path: Sequence[str | int], message: str, subject: str | None = None) -> PolicyError:
        """`FILE:LINE: field: message` (or `subject` in place of the field), with no webhook URL in it."""
        line = _line_of(root, path)
        text = f"{source}{f':{line}' if line else ''}: {subject or _field(path)}: {message}"
        return PolicyError(_hide_urls(text, webhooks))

    infinite = _not_finite(data, [])
    if infinite is not None:
        raise fail(infinite, f"{_lookup(data, infinite)!r} is not a finite number")
    validator = jsonschema.Draft202012Validator(_schema())
    errors = sorted(validator.iter_errors(data), key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    if errors:
        error = _within_hook(jsonschema.exceptions.best_match(errors))
        raise fail(list(error.absolute_path), _describe(error))

    _check_mode(data, fleet, fail)
    names: set[str] = set()
    rules = []
    for index, raw in enumerate(data["rules"]):
        if raw["name"] in names:
            raise fail(["rules", index, "name"], f"rule name {raw['name']!r} is used twice")
        names.add(raw["name"])
        rules.append(_compile_rule(raw, index, fail, check_commands))
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
        rollout=Rollout(data["rollout"].get("max_in_progress"), data["rollout"].get("max_in_progress_per_group"),
                        float(data["rollout"].get("stagger", 0))) if "rollout" in data else None,
        windows=tuple(windows),
        impactful_types=frozenset(data.get("impactful_types", DEFAULT_IMPACTFUL)),
        recover=_hooks(data.get("hooks", {}).get("recover", []), "recover", ["hooks", "recover"], fail,
                       check_commands),
        source=source,
    )


FLEET_KEYS = ("subscription", "resource_group", "scale_set", "vm")


def _check_mode(data: Mapping[str, Any], fleet: bool, fail: Any) -> None:
    """What only one mode can mean. `forewarn fleet` is no VM of the event, so `affects_this_vm` and the
    leader among affected VMs mean nothing there (its node actions act on the node of every VM the event
    names); the per-VM agent knows only its own VM, so the fleet's place keys mean nothing to it."""
    if not fleet and "rollout" in data:
        raise fail(["rollout"], "applies only in forewarn fleet (the agent on a VM decides for its own VM; "
                   "max_approvals_per_hour and the leader mode pace a fleet of agents)")
    if fleet and "leader" in data:
        raise fail(["leader"], "forewarn fleet approves for every VM of an event at once: there is no leader "
                   "among them (remove leader)")
    for index, rule in enumerate(data["rules"]):
        match = rule.get("match", {})
        if fleet and "affects_this_vm" in match:
            raise fail(["rules", index, "match", "affects_this_vm"], "forewarn fleet is none of the VMs; match "
                       "them with vm, scale_set, resource_group or subscription")
        if not fleet and "after_eviction" in rule:
            raise fail(["rules", index, "after_eviction"], "applies only in forewarn fleet (the agent on a VM is "
                       "gone with it)")
        for key in FLEET_KEYS:
            if not fleet and key in match:
                raise fail(["rules", index, "match", key], "matches only in forewarn fleet (the agent on a VM "
                           "knows only its own VM; use affects_this_vm or resources)")


def _lookup(data: Any, path: Sequence[str | int]) -> Any:
    for step in path:
        data = data[step]
    return data


def _minutes(text: str) -> int:
    hours, minutes = text.split(":")
    return int(hours) * 60 + int(minutes)


def _hooks(raw: list[dict[str, Any]], prefix: str, at: list[str | int], fail: Any,
           check_commands: bool) -> tuple[Hook, ...]:
    hooks = []
    for index, item in enumerate(raw):
        name = item.get("name") or f"{prefix}[{index}]"
        command = tuple(item.get("command", ()))
        for position, argument in enumerate(command):
            if "\0" in argument:
                raise fail([*at, index, "command", position], "contains a NUL character, which no program "
                           "argument can hold")
        if command and check_commands:
            problem = _unrunnable(command[0])
            if problem:
                raise fail([*at, index, "command"], problem, subject=f"hook {name}")
        hooks.append(Hook(name=name, command=command, webhook=item.get("webhook"),
                          timeout=float(item.get("timeout", DEFAULT_HOOK_TIMEOUT)), env=tuple(item.get("env", ()))))
    return tuple(hooks)


def _unrunnable(program: str) -> str | None:
    """Why `program` cannot be started as a hook's first argument, or None. A name without a slash is
    looked up on PATH, as the hook's own start will (its PATH is forewarn's)."""
    if os.sep not in program:
        return None if shutil.which(program) else f"command {program!r} not found on PATH"
    if not os.path.exists(program):
        return f"command {program!r} not found"
    if not os.path.isfile(program) or not os.access(program, os.X_OK):
        return f"command {program!r} is not executable"
    return None


def _compile_rule(raw: Mapping[str, Any], index: int, fail: Any, check_commands: bool) -> Rule:
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
    if "on_failure" in raw and not raw.get("node"):
        raise fail(["rules", index, "on_failure"], "on_failure applies to the rule's node actions; this rule has none")
    if raw["action"] == "hold" and raw.get("on_failure") == "approve":
        raise fail(["rules", index, "on_failure"], "a hold rule never approves; on_failure: approve needs action: "
                   "approve")
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
            subscriptions=frozenset(s.lower() for s in match["subscription"]) if "subscription" in match else None,
            resource_groups=tuple(p.lower() for p in match.get("resource_group", ())),
            scale_sets=tuple(p.lower() for p in match.get("scale_set", ())),
            vms=tuple(p.lower() for p in match.get("vm", ())),
        ),
        prepare=_hooks(raw.get("prepare", []), f"{raw['name']}.prepare", ["rules", index, "prepare"], fail,
                       check_commands),
        on_hook_failure=raw.get("on_hook_failure", "hold"),
        delay=float(raw.get("delay", 0)),
        approve_within=raw.get("approve_within"),
        node=tuple(_node_action(item, ["rules", index, "node", position], raw["name"], fail)
                   for position, item in enumerate(raw.get("node", []))),
        on_failure=raw.get("on_failure", "hold"),
        after_eviction=raw.get("after_eviction"),
    )


def _node_action(raw: str | Mapping[str, Any], at: list[str | int], rule: str, fail: Any) -> NodeAction:
    """A node action from its policy form (checked by the schema): a name, or {name: {options}}."""
    if isinstance(raw, str):
        return NodeAction(kind=raw)
    kind, options = next(iter(raw.items()))
    names = {"type": "condition_type" if kind == "condition" else "event_type"}
    values = {names.get(key, key): value for key, value in (options or {}).items()}
    if "last" in values:
        values["last"] = tuple(values["last"])
    if values.get("stop_daemonsets") and "selector" in values:
        where = [*at, kind, "stop_daemonsets"]
        raise fail(where, "stop_daemonsets taints the whole node NoExecute, which would also stop the pods the "
                   "selector leaves; use it only in a drain of every pod", subject=f"rule {rule}: {_field(where)}")
    if "timeout" in values or "margin" in values:
        values.update({k: float(values[k]) for k in ("timeout", "margin") if k in values})
    if "selector" in values:
        where = [*at, kind, "selector"]
        try:
            values["selector"] = parse_label_selector(values["selector"])
        except ValueError as exc:
            raise fail(where, f"{values['selector']!r} is not a valid label selector: {exc}; valid: "
                       f"{SELECTOR_GRAMMAR}", subject=f"rule {rule}: {_field(where)}") from None
    return NodeAction(kind=kind, **values)


# --- deciding ---------------------------------------------------------------------------------

def mismatch(match: Match, event: Event, vm_name: str | None, now: float, place: Place | None = None) -> str | None:
    """Why `match` does not fit `event` (None when it does); `place` says where it is in fleet mode."""
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
    if match.uses_place:
        return _misplaced(match, place)
    return None


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name.lower(), pattern) for pattern in patterns)


def _misplaced(match: Match, place: Place | None) -> str | None:
    """Why the fleet keys of `match` do not fit `place` (None when they do)."""
    if place is None:
        return "subscription, resource_group, scale_set and vm match only in forewarn fleet"
    if match.subscriptions is not None and place.subscription_id.lower() not in match.subscriptions:
        return f"subscription {place.subscription_id} not in the rule's"
    if match.resource_groups and not _matches(place.resource_group, match.resource_groups):
        return f"resource group {place.resource_group} matches none of {list(match.resource_groups)}"
    if match.scale_sets and not (place.scale_set and _matches(place.scale_set, match.scale_sets)):
        return (f"scale set {place.scale_set} matches none of {list(match.scale_sets)}" if place.scale_set
                else "not a scale set's event")
    if match.vms:
        others = [vm for vm in place.vms if not _matches(vm, match.vms)] if place.vms else ["(no VM)"]
        if others:
            return f"VM {others[0]} in Resources matches none of {list(match.vms)} (an approval releases them all)"
    return None


def first_match(policy: Policy, event: Event, vm_name: str | None, now: float,
                place: Place | None = None) -> tuple[Rule | None, list[str]]:
    """The first rule that fits, and why each earlier rule did not."""
    misses: list[str] = []
    for rule in policy.rules:
        why = mismatch(rule.match, event, vm_name, now, place)
        if why is None:
            return rule, misses
        misses.append(f"{rule.name}: {why}")
    return None, misses


def in_window(policy: Policy, event_type: str, now: float) -> bool:
    if not policy.windows or event_type not in policy.impactful_types:
        return True
    moment = datetime.fromtimestamp(now, tz=timezone.utc)
    return any(window.contains(moment) for window in policy.windows)


def decide(policy: Policy, event: Event, vm_name: str | None, now: float, first_seen: float,
           place: Place | None = None) -> Decision:
    """What to do with `event` at `now`, seen first at `first_seen`, as the VM `vm_name`; in fleet mode, for
    the event at `place` (the fleet approves for every VM in Resources at once: no leader among them)."""
    rule, misses = first_match(policy, event, vm_name, now, place)
    skipped = tuple(misses)
    if rule is None:
        return Decision("hold", None, "no rule matched (events no rule matches are held)", skipped=skipped)
    if rule.action == "hold":
        return Decision("hold", rule, f"rule {rule.name} holds it", skipped=skipped)
    if event.status != "Scheduled":
        return Decision("hold", rule, f"already {event.status}: only Scheduled events can be approved",
                        skipped=skipped)
    if place is None and not event.affects(vm_name):
        return Decision("hold", rule, "this VM is not in Resources; only an affected VM approves, since "
                        "an approval releases the event for every VM it lists", skipped=skipped)
    earliest = first_seen + rule.delay
    position = event.resources.index(vm_name) if place is None and vm_name in event.resources else 0
    if policy.leader_mode == "first" and position != 0:
        return Decision("hold", rule, f"leader mode first: {event.resources[0]} approves", skipped=skipped)
    if policy.leader_mode == "staggered" and position:
        earliest = max(earliest, first_seen + position * policy.stagger)
    if rule.approve_within is not None and event.not_before is not None:
        earliest = max(earliest, event.not_before.timestamp() - rule.approve_within)
    if not in_window(policy, event.event_type, now):
        return Decision("wait", rule, "outside the maintenance windows", earliest, skipped)
    reason = f"rule {rule.name} approves"
    if policy.leader_mode == "staggered" and position:
        wait = position * policy.stagger
        reason += f" (position {position} in Resources: if still Scheduled {wait:g} s after it appeared)"
    return Decision("approve", rule, reason, earliest, skipped)
