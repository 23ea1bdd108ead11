"""The Azure Monitor alert templates (scripts/azure_monitor.py): generated from their one source with no drift, every
resource valid against Azure's REST API specification (tests/azure-rest-api-specs), the Prometheus rule groups
still passing promtool's unit tests when turned back into a rules file, and the log alerts' KQL the same as
forewarn-queries.kql's, on the columns of the table forewarn-logs.json declares."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from conftest import load_script, require_promtool

ROOT = Path(__file__).parent.parent
SPECS = Path(__file__).parent / "azure-rest-api-specs"
AZURE_MONITOR = ROOT / "deploy" / "azure-monitor"
PROMETHEUS = ROOT / "deploy" / "prometheus"


gen = load_script("azure_monitor")

SUBSCRIPTION = "/subscriptions/00000000-0000-0000-0000-000000000000"
WORKSPACE = ("/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/monitoring/providers/"
             "microsoft.monitor/accounts/amw")
ACTION_GROUPS = [f"/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/monitoring/providers/"
                 f"microsoft.insights/actionGroups/{name}" for name in ("oncall", "teams")]


# --- a template as Azure Resource Manager evaluates it (the expressions the generator writes, nothing more) ------

_TOKEN = re.compile(r"\s*(?:(?P<string>'(?:[^']|'')*')|(?P<number>-?\d+)|(?P<name>[A-Za-z_]\w*)|(?P<punct>[()\[\],.]))")


class Deployment:
    """Evaluates an ARM template's expressions for given parameter values: parameters, variables (with copy),
    concat, format, string, length, not, empty, guid, copyIndex, resourceGroup, resourceId and
    subscriptionResourceId; a resource whose `condition` is false is left out. Anything else fails the test."""

    def __init__(self, template: dict[str, Any], parameters: dict[str, Any]) -> None:
        self.template = template
        self.copy_index: dict[str, int] = {}
        declared = template["parameters"]
        assert set(parameters) <= set(declared), f"unknown parameters {set(parameters) - set(declared)}"
        self.parameters: dict[str, Any] = {}
        for name, spec in declared.items():
            value = parameters[name] if name in parameters else self.value(spec["defaultValue"])
            assert isinstance(value, {"string": str, "int": int, "array": list}[spec["type"]]), name
            assert "minValue" not in spec or value >= spec["minValue"], name
            self.parameters[name] = value
        self.variables: dict[str, Any] = {}
        for name, value in template.get("variables", {}).items():
            if name != "copy":
                self.variables[name] = self.value(value)
        for loop in template.get("variables", {}).get("copy", []):
            items = []
            for index in range(self.value(loop["count"])):
                self.copy_index[loop["name"]] = index
                items.append(self.value(loop["input"]))
            self.variables[loop["name"]] = items

    def resources(self) -> list[dict[str, Any]]:
        return [self.value(resource) for resource in self.template["resources"]
                if self.value(resource.get("condition", True)) is True]

    def value(self, node: Any) -> Any:
        if isinstance(node, dict):
            return {key: self.value(item) for key, item in node.items()}
        if isinstance(node, list):
            return [self.value(item) for item in node]
        if isinstance(node, str) and node.startswith("[[") and node.endswith("]"):
            return node[1:]
        if isinstance(node, str) and node.startswith("[") and node.endswith("]"):
            tokens = self._tokens(node[1:-1])
            result = self._expression(tokens)
            assert not tokens, f"{node}: left over {tokens}"
            return result
        return node

    @staticmethod
    def _tokens(text: str) -> list[tuple[str, str]]:
        tokens, position = [], 0
        while text[position:].strip():
            match = _TOKEN.match(text, position)
            assert match is not None, f"cannot read {text[position:]!r}"
            kind = match.lastgroup
            assert kind is not None
            tokens.append((kind, match.group(kind)))
            position = match.end()
        return tokens

    def _expression(self, tokens: list[tuple[str, str]]) -> Any:
        kind, text = tokens.pop(0)
        if kind == "string":
            value: Any = text[1:-1].replace("''", "'")
        elif kind == "number":
            value = int(text)
        else:
            assert kind == "name" and tokens.pop(0) == ("punct", "("), text
            args = []
            while tokens[0] != ("punct", ")"):
                args.append(self._expression(tokens))
                if tokens[0] == ("punct", ","):
                    tokens.pop(0)
            tokens.pop(0)
            value = self._call(text, args)
        while tokens and tokens[0] in (("punct", "["), ("punct", ".")):
            if tokens.pop(0) == ("punct", "["):
                value = value[self._expression(tokens)]
                assert tokens.pop(0) == ("punct", "]")
            else:
                value = value[tokens.pop(0)[1]]
        return value

    def _call(self, name: str, args: list[Any]) -> Any:
        if name == "parameters":
            return self.parameters[args[0]]
        if name == "variables":
            return self.variables[args[0]]
        if name == "concat":
            return "".join(args)
        if name == "format":
            return re.sub(r"\{(\d+)\}", lambda match: str(args[1 + int(match.group(1))]), args[0])
        if name == "string":
            return str(args[0])
        if name == "length":
            return len(args[0])
        if name == "copyIndex":
            return self.copy_index[args[0]]
        if name == "not":
            assert isinstance(args[0], bool)
            return not args[0]
        if name == "empty":
            return len(args[0]) == 0
        if name == "guid":
            return str(uuid.uuid5(uuid.NAMESPACE_URL, "/".join(args)))
        if name == "resourceGroup":
            return {"location": "westeurope", "name": "monitoring", "id": f"{SUBSCRIPTION}/resourceGroups/monitoring"}
        if name in ("resourceId", "subscriptionResourceId"):
            namespace, *types = args[0].split("/")
            assert len(types) == len(args) - 1, f"{name}{tuple(args)}: one name per type segment"
            path = "/".join(f"{kind}/{value}" for kind, value in zip(types, args[1:], strict=True))
            scope = SUBSCRIPTION + ("/resourceGroups/monitoring" if name == "resourceId" else "")
            return f"{scope}/providers/{namespace}/{path}"
        raise AssertionError(f"ARM function {name} is not one the generator should write")


# --- the REST API specification as JSON Schema -------------------------------------------------------------------

#: Where the swagger files' relative $refs lead, among the files kept in tests/azure-rest-api-specs.
REFERENCED = {"../../../../../../common-types/resource-management/v3/types.json": "common-types-v3-types.json"}


def _iso8601_duration(value: object) -> bool:
    return not isinstance(value, str) or re.fullmatch(
        r"P(?=\d|T\d)(\d+Y)?(\d+M)?(\d+W)?(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+(\.\d+)?S)?)?", value) is not None


class Specification:
    """A swagger 2.0 document's definitions as strict JSON Schema (draft 4): $refs resolved, allOf merged, read-only
    properties forbidden in a request, objects closed to properties the specification does not name."""

    FORBIDDEN: dict[str, Any] = {"not": {}}

    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.documents = {name: json.loads((SPECS / name).read_text()) for name in [filename, *REFERENCED.values()]}

    @property
    def api_version(self) -> str:
        return str(self.documents[self.filename]["info"]["version"])

    def validator(self, definition: str) -> jsonschema.Draft4Validator:
        schema = self._convert(self.filename, self.documents[self.filename]["definitions"][definition])
        checker = jsonschema.FormatChecker(formats=())
        checker.checks("duration")(_iso8601_duration)
        return jsonschema.Draft4Validator(schema, format_checker=checker)

    def _resolve(self, document: str, ref: str) -> tuple[str, dict[str, Any]]:
        path, _, pointer = ref.partition("#/definitions/")
        target = REFERENCED[path] if path else document
        return target, self.documents[target]["definitions"][pointer]

    def _convert(self, document: str, node: dict[str, Any]) -> dict[str, Any]:
        if node.get("readOnly"):
            return self.FORBIDDEN
        if "$ref" in node:
            schema = self._convert(*self._resolve(document, node["$ref"]))
            siblings = {key: value for key, value in node.items()
                        if key not in ("$ref", "description") and not key.startswith("x-ms-")}
            return {"allOf": [schema, self._convert(document, siblings)]} if siblings else schema
        out: dict[str, Any] = {}
        properties: dict[str, Any] = {}
        required: set[str] = set()
        for member in node.get("allOf", []):
            merged = self._convert(document, member)
            properties.update(merged.get("properties", {}))
            required.update(merged.get("required", []))
        for key, value in node.items():
            if key.startswith("x-ms-") or key in ("description", "allOf", "default"):
                continue
            if key == "properties":
                properties.update({name: self._convert(document, schema) for name, schema in value.items()})
            elif key == "required":
                required.update(value)
            elif key in ("items", "additionalProperties") and isinstance(value, dict):
                out[key] = self._convert(document, value)
            elif key != "format" or value == "duration":
                out[key] = value
        if properties:
            out.update(type="object", properties=properties)
            out.setdefault("additionalProperties", False)
        if required:
            out["required"] = sorted(required)
        return out


PROMETHEUS_SPEC = Specification("PrometheusRuleGroups.json")
LOG_ALERTS_SPEC = Specification("scheduledQueryRule_API.json")


def request_body(resource: dict[str, Any]) -> dict[str, Any]:
    """What ARM sends as the PUT body: the resource without the members that go in the URL or steer ARM."""
    return {key: value for key, value in resource.items() if key not in ("type", "apiVersion", "name", "dependsOn")}


def errors(validator: jsonschema.Draft4Validator, body: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(map(str, error.absolute_path))}: {error.message}" for error in validator.iter_errors(body)]


def template(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


def prometheus_resources(action_groups: list[str]) -> list[dict[str, Any]]:
    deployment = Deployment(template(gen.PROMETHEUS_TEMPLATE), {
        "azureMonitorWorkspaceId": WORKSPACE, "clusterName": "aks-prod", "actionGroupIds": action_groups})
    return deployment.resources()


def log_alert_resources(**parameters: Any) -> list[dict[str, Any]]:
    return Deployment(template(gen.LOG_ALERTS_TEMPLATE), {"workspaceName": "logs", **parameters}).resources()


# --- tests ----------------------------------------------------------------------------------------------------------


def test_committed_templates_are_what_the_sources_give() -> None:
    for path, text in gen.generated().items():
        assert path.read_text() == text, f"{path.name} drifted: run scripts/azure_monitor.py"
    assert gen.main(["--check"]) == 0


@pytest.mark.parametrize("action_groups", [[], ACTION_GROUPS])
def test_every_rule_group_is_valid_against_the_specification(action_groups: list[str]) -> None:
    validator = PROMETHEUS_SPEC.validator("PrometheusRuleGroupResource")
    resources = prometheus_resources(action_groups)
    assert resources
    for resource in resources:
        assert resource["type"] == "Microsoft.AlertsManagement/prometheusRuleGroups"
        assert resource["apiVersion"] == PROMETHEUS_SPEC.api_version
        assert resource["name"].endswith("-aks-prod")
        assert errors(validator, request_body(resource)) == [], resource["name"]
        properties = resource["properties"]
        assert properties["scopes"] == [WORKSPACE] and properties["clusterName"] == "aks-prod"
        for rule in properties["rules"]:
            if "alert" in rule:
                assert rule["actions"] == [{"actionGroupId": group} for group in action_groups]
                assert 0 <= rule["severity"] <= 4


def test_every_log_alert_is_valid_against_the_specification() -> None:
    validator = LOG_ALERTS_SPEC.validator("ScheduledQueryRuleResource")
    resources = log_alert_resources(actionGroupIds=ACTION_GROUPS)
    assert {resource["properties"]["displayName"] for resource in resources} == set(gen.LOG_ALERTS)
    for resource in resources:
        assert resource["type"] == "Microsoft.Insights/scheduledQueryRules"
        assert resource["apiVersion"] == LOG_ALERTS_SPEC.api_version
        assert errors(validator, request_body(resource)) == [], resource["name"]
        assert resource["properties"]["actions"] == {"actionGroups": ACTION_GROUPS}
        assert resource["properties"]["scopes"][0].endswith("/Microsoft.OperationalInsights/workspaces/logs")


@pytest.mark.parametrize(("spec", "resource_of", "change", "expected"), [
    ("prometheus", 0, lambda body: body["properties"]["rules"][0].update(expr="up"), "'expr' was unexpected"),
    ("prometheus", 0, lambda body: body["properties"]["rules"][1].update({"for": "1m"}), "is not a 'duration'"),
    ("prometheus", 0, lambda body: body["properties"]["rules"][0].update(severity="warning"), "not of type 'integer'"),
    ("prometheus", 0, lambda body: body["properties"].pop("scopes"), "'scopes' is a required property"),
    ("prometheus", 0, lambda body: body.update(id="/subscriptions/x"), "should not be valid"),
    ("prometheus", 0, lambda body: body.pop("location"), "'location' is a required property"),
    ("logs", 0, lambda body: body["properties"].update(severity=5), "is not one of"),
    ("logs", 0, lambda body: body["properties"].pop("criteria"), "'criteria' is a required property"),
    ("logs", 0, lambda body: body["properties"]["criteria"]["allOf"][0].update(operator="Above"), "is not one of"),
    ("logs", 0, lambda body: body["properties"].update(windowSize="5m"), "is not a 'duration'"),
])
def test_the_validation_rejects_what_the_specification_does_not_allow(spec: str, resource_of: int, change: Any,
                                                                       expected: str) -> None:
    if spec == "prometheus":
        validator, resource = PROMETHEUS_SPEC.validator("PrometheusRuleGroupResource"), prometheus_resources([])
    else:
        validator, resource = LOG_ALERTS_SPEC.validator("ScheduledQueryRuleResource"), log_alert_resources()
    body = request_body(resource[resource_of])
    change(body)
    assert any(expected in error for error in errors(validator, body)), errors(validator, body)


def source_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((PROMETHEUS / "forewarn-alerts.yaml").read_text())["groups"]
    for group in groups:
        for rule in group["rules"]:
            rule["expr"] = rule["expr"].strip()
    return list(groups)


def test_the_rule_groups_carry_every_rule_unchanged() -> None:
    rules = template(gen.PROMETHEUS_TEMPLATE)
    assert gen.prometheus_rules(rules)["groups"] == source_rules()
    alerts = [rule for resource in rules["resources"] for rule in resource["properties"]["rules"] if "alert" in rule]
    assert alerts and all(rule["severity"] == gen.SEVERITIES[rule["labels"]["severity"]] for rule in alerts)


def test_promtool_unit_tests_pass_on_the_rule_groups_turned_back_into_rules(tmp_path: Path) -> None:
    rules = gen.prometheus_rules(template(gen.PROMETHEUS_TEMPLATE))
    (tmp_path / "forewarn-alerts.yaml").write_text(yaml.safe_dump(rules, sort_keys=False, width=1000))
    (tmp_path / "tests").mkdir()
    unit_tests = shutil.copy(PROMETHEUS / "tests" / "forewarn-alerts.test.yaml", tmp_path / "tests")
    result = subprocess.run([require_promtool(), "test", "rules", str(unit_tests)], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path / "tests")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


@pytest.mark.parametrize(("prometheus", "iso"), [
    ("1m", "PT1M"), ("90s", "PT1M30S"), ("1h30m", "PT1H30M"), ("2d", "P2D"), ("1w", "P7D"), ("1d12h", "P1DT12H"),
    ("0s", "PT0S"),
])
def test_durations_convert_both_ways(prometheus: str, iso: str) -> None:
    assert gen.iso8601_duration(prometheus, "here") == iso
    assert gen.iso8601_duration(gen.prometheus_duration(iso), "here") == iso


@pytest.mark.parametrize(("rules", "message"), [
    ("groups: [{name: g, rules: [{alert: A, expr: up, for: 500ms, labels: {severity: info}}]}]",
     "group g, rule A: for: '500ms' is not a Prometheus duration"),
    ("groups: [{name: g, rules: [{alert: A, expr: up, labels: {severity: page}}]}]",
     "the label `severity` is 'page'; expected one of critical, error, warning, info, verbose"),
    ("groups: [{name: g, rules: [{alert: A, expr: up, keep_firing_for: 5m, labels: {severity: info}}]}]",
     "keep_firing_for has no counterpart"),
    ("groups: [{name: 'a/b', rules: []}]", "group name 'a/b' is not a valid rule group name"),
    ("groups: [{name: g, rules: [" + ", ".join(f"{{record: r{n}, expr: up}}" for n in range(21)) + "]}]",
     "group g has 21 rules; an Azure rule group holds 1 to 20 (split the group)"),
])
def test_rules_azure_cannot_carry_are_refused_by_name(rules: str, message: str) -> None:
    with pytest.raises(gen.SourceError, match=re.escape(message)):
        gen.rule_groups_template(rules)


def test_log_alert_queries_are_the_kql_files_with_the_parameter_in_place() -> None:
    blocks = gen.alert_queries(gen.QUERIES.read_text())
    assert set(blocks) == set(gen.LOG_ALERTS)
    for minutes, resources in ((None, log_alert_resources()), (7, log_alert_resources(imminentMinutes=7,
                                                                                      startedMarginMinutes=7))):
        for resource in resources:
            name = resource["properties"]["displayName"]
            first, _, rest = blocks[name].partition("\n")
            if minutes is not None:
                first = re.sub(r"= \d+m;", f"= {minutes}m;", first)
            assert resource["properties"]["criteria"]["allOf"][0]["query"] == f"{first} {rest}"


def kql_queries() -> Iterator[str]:
    """Every query of forewarn-queries.kql: its blocks between blank lines, comment lines left out."""
    for block in re.split(r"\n\s*\n", gen.QUERIES.read_text()):
        query = "\n".join(line for line in block.splitlines() if not line.lstrip().startswith("//"))
        if query.strip():
            yield query


def unknown_columns(query: str, columns: set[str]) -> set[str]:
    """Capitalised names a query uses that are neither a column of the table nor a name it binds itself."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', query)
    bound = set(re.findall(r"\blet\s+(\w+)", text)) | set(re.findall(r"\b(\w+)\s*=(?!=)", text))
    return set(re.findall(r"\b[A-Z]\w*", text)) - bound - columns - {"ForewarnEvents_CL"}


def test_every_query_uses_only_columns_the_table_declares() -> None:
    logs = template(AZURE_MONITOR / "forewarn-logs.json")
    table = next(resource for resource in logs["resources"]
                 if resource["type"] == "Microsoft.OperationalInsights/workspaces/tables")
    columns = {column["name"] for column in table["properties"]["schema"]["columns"]}
    queries = list(kql_queries())
    assert len(queries) >= 5
    for query in queries:
        assert unknown_columns(query, columns) == set(), query
    assert unknown_columns(queries[-1].replace("VmName", "VmNmae"), columns) == {"VmNmae"}


def test_started_too_long_leaves_out_events_that_end_with_the_vm_gone() -> None:
    # A Terminate or a Spot eviction (Preempt) ends with the VM deleted or stopped: no `removed` record can follow,
    # so its last row stays Started. The query must filter those types out before it reports anything.
    (resource,) = [resource for resource in log_alert_resources()
                   if resource["properties"]["displayName"] == "ForewarnEventStartedTooLong"]
    query = resource["properties"]["criteria"]["allOf"][0]["query"]
    excluded = re.findall(r'^\| where EventType !in \(((?:"\w+"(?:, )?)+)\)$', query, re.MULTILINE)
    assert [set(re.findall(r'"(\w+)"', found)) for found in excluded] == [{"Terminate", "Preempt"}], query
    # the outer query keeps Reboot, Redeploy and Freeze (after a reboot forewarn reports the event removed)
    assert not re.search(r"EventType (==|in) ", query)
    imminent = gen.alert_queries(gen.QUERIES.read_text())["ForewarnRebootImminent"]
    assert '"Terminate", "Preempt"' in imminent and "!in" not in imminent


def test_runbook_links_are_absolute_in_azure_and_unchanged_in_the_round_trip() -> None:
    sources = {rule["alert"]: rule["annotations"]["runbook_url"]
               for group in source_rules() for rule in group["rules"] if "alert" in rule}
    assert sources and all(url.startswith("docs/runbook.md#") for url in sources.values())
    for base in (gen.RUNBOOK_BASE_URL, "https://docs.example.org/forewarn/"):
        deployment = Deployment(template(gen.PROMETHEUS_TEMPLATE), {
            "azureMonitorWorkspaceId": WORKSPACE, "clusterName": "aks-prod", "runbookBaseUrl": base})
        deployed = {rule["alert"]: rule["annotations"]["runbook_url"]
                    for resource in deployment.resources() for rule in resource["properties"]["rules"]
                    if "alert" in rule}
        assert deployed == {alert: base + url for alert, url in sources.items()}
    assert gen.RUNBOOK_BASE_URL.startswith(yaml.safe_load((ROOT / "deploy/helm/forewarn/Chart.yaml").read_text())
                                           ["home"] + "/")
    # an absolute link, a quote and a value that looks like an ARM expression survive as they are
    odd = ("groups: [{name: g, rules: [{alert: A, expr: up, labels: {severity: info}, annotations: "
           "{runbook_url: 'https://wiki.example/a', summary: '[x] it''s down'}}, {alert: B, expr: up, "
           "labels: {severity: info}, annotations: {runbook_url: \"docs/it's.md\", summary: '[a] and [b]'}}]}]")
    back = gen.prometheus_rules(json.loads(gen.render(gen.rule_groups_template(odd))))
    assert back == yaml.safe_load(odd)
    resources = Deployment(gen.rule_groups_template(odd), {"azureMonitorWorkspaceId": WORKSPACE,
                                                          "clusterName": "c"}).resources()
    annotations = [rule["annotations"] for rule in resources[0]["properties"]["rules"]]
    assert annotations == [{"runbook_url": "https://wiki.example/a", "summary": "[x] it's down"},
                           {"runbook_url": gen.RUNBOOK_BASE_URL + "docs/it's.md", "summary": "[a] and [b]"}]
    assert resources[0]["properties"]["rules"][1]["annotations"]["summary"] == "[a] and [b]"


#: A rules file with what forewarn's own lacks: a recording rule, and a group-level interval.
RECORDING_RULES = """\
groups:
  - name: forewarn-recording
    interval: 2m
    rules:
      - record: job:azure_scheduled_events_open:sum
        expr: sum by (job) (azure_scheduled_events_open)
        labels:
          source: forewarn
      - alert: ForewarnEventsOpen
        expr: job:azure_scheduled_events_open:sum > 0
        for: 4m
        labels:
          severity: info
"""
RECORDING_RULES_TEST = """\
rule_files: [rules.yaml]
evaluation_interval: 2m
tests:
  - interval: 2m
    input_series:
      - series: 'azure_scheduled_events_open{job="forewarn", instance="a"}'
        values: '1x10'
      - series: 'azure_scheduled_events_open{job="forewarn", instance="b"}'
        values: '2x10'
    promql_expr_test:
      - expr: job:azure_scheduled_events_open:sum
        eval_time: 10m
        exp_samples:
          - labels: 'job:azure_scheduled_events_open:sum{job="forewarn", source="forewarn"}'
            value: 3
    alert_rule_test:
      - alertname: ForewarnEventsOpen
        eval_time: 10m
        exp_alerts:
          - exp_labels: {job: forewarn, source: forewarn, severity: info}
"""


def test_a_recording_rule_and_a_group_interval_are_carried_valid_and_round_trip(tmp_path: Path) -> None:
    generated = json.loads(gen.render(gen.rule_groups_template(RECORDING_RULES, "rules.yaml")))
    (resource,) = Deployment(generated, {"azureMonitorWorkspaceId": WORKSPACE, "clusterName": "aks-prod",
                                         "actionGroupIds": ACTION_GROUPS}).resources()
    assert errors(PROMETHEUS_SPEC.validator("PrometheusRuleGroupResource"), request_body(resource)) == []
    properties = resource["properties"]
    assert properties["interval"] == "PT2M"
    record, alert = properties["rules"]
    assert record == {"record": "job:azure_scheduled_events_open:sum",
                      "expression": "sum by (job) (azure_scheduled_events_open)", "labels": {"source": "forewarn"}}
    assert (alert["for"], alert["severity"], len(alert["actions"])) == ("PT4M", 3, 2)

    rules = gen.prometheus_rules(generated)
    assert rules == yaml.safe_load(RECORDING_RULES)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
    (tmp_path / "test.yaml").write_text(RECORDING_RULES_TEST)
    result = subprocess.run([require_promtool(), "test", "rules", "test.yaml"], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert result.returncode == 0 and "SUCCESS" in result.stdout + result.stderr, result.stdout + result.stderr


@pytest.mark.parametrize(("interval", "iso"), [("1m", "PT1M"), ("90s", "PT1M30S"), ("15m", "PT15M")])
def test_a_group_interval_within_azures_range_is_kept(interval: str, iso: str) -> None:
    rules = RECORDING_RULES.replace("interval: 2m", f"interval: {interval}")
    (resource,) = gen.rule_groups_template(rules)["resources"]
    assert resource["properties"]["interval"] == iso


@pytest.mark.parametrize("interval", ["59s", "30s", "15m1s", "1h", "1d"])
def test_a_group_interval_outside_azures_range_is_refused_by_name(interval: str) -> None:
    rules = RECORDING_RULES.replace("interval: 2m", f"interval: {interval}")
    with pytest.raises(gen.SourceError, match=re.escape(
            f"rules.yaml: group forewarn-recording: interval '{interval}' is outside the 1 to 15 minutes an Azure "
            "rule group is evaluated at")):
        gen.rule_groups_template(rules, "rules.yaml")


# --- forewarn-logs.json (hand-written) against the deployment template schemas -----------------------------------

TEMPLATE_SCHEMAS = Path(__file__).parent / "azure-resource-manager-schemas"
#: The one reference out of these files: ARM's expression syntax, which an evaluated template no longer holds.
EXPRESSION = "https://schema.management.azure.com/schemas/common/definitions.json#/definitions/expression"
#: forewarn-logs.json's resource types -> (schema file, its resource definition).
LOGS_SCHEMAS = {
    "Microsoft.OperationalInsights/workspaces/tables": ("2022-10-01_Microsoft.OperationalInsights.json",
                                                        "workspaces_tables"),
    "Microsoft.Insights/dataCollectionEndpoints": ("2022-06-01_Microsoft.Insights.json", "dataCollectionEndpoints"),
    "Microsoft.Insights/dataCollectionRules": ("2022-06-01_Microsoft.Insights.json", "dataCollectionRules"),
    "Microsoft.Authorization/roleAssignments": ("2022-04-01_Microsoft.Authorization.json", "roleAssignments"),
}
#: Enums the REST specification marks extensible (x-ms-enum modelAsString: true) but the generated schema closes:
#: definition -> property whose items take any string. A data flow's streams are the known Microsoft-* ones or
#: a stream the rule declares itself, Custom-<name> (dataCollectionRules_API.json 2022-06-01, KnownDataFlowStreams).
EXTENSIBLE = {"DataFlow": "streams"}
#: Members of a template's resource that steer ARM and are not part of the resource the provider receives.
ARM_ONLY = ("dependsOn", "condition", "scope", "copy", "comments")


def template_schema_validator(filename: str, definition: str) -> jsonschema.Draft4Validator:
    """A resource definition of a deployment template schema, made strict: ARM expressions refused (the template
    is evaluated first, so every value must be a real one) and objects closed to properties the schema does not
    name (the generated schemas leave them open)."""
    document = json.loads((TEMPLATE_SCHEMAS / filename).read_text())

    def strict(node: Any) -> Any:
        if isinstance(node, list):
            return [strict(item) for item in node]
        if not isinstance(node, dict):
            return node
        if node.get("$ref") == EXPRESSION:
            return {"not": {}}
        out = {key: strict(value) if key not in ("enum", "required") else value for key, value in node.items()}
        if "properties" in out and "additionalProperties" not in out and isinstance(out["properties"], dict):
            out["additionalProperties"] = False
        return out

    definitions = strict(document["definitions"])
    for name, member in EXTENSIBLE.items():
        if name in definitions:
            (listed, expression) = definitions[name]["properties"][member]["oneOf"]
            assert listed["items"]["enum"] and expression == {"not": {}}, f"{name}.{member} changed shape"
            listed["items"] = {"type": "string"}
    schema = {**strict(document["resourceDefinitions"][definition]), "definitions": definitions}
    return jsonschema.Draft4Validator(schema)


def schema_errors(validator: jsonschema.Draft4Validator, body: dict[str, Any]) -> list[str]:
    """Every error, and inside a failed oneOf the errors of each branch ("path: message"), so that a test can name
    the member at fault rather than the whole `properties` object."""
    def walk(error: jsonschema.ValidationError) -> Iterator[str]:
        yield f"{'/'.join(map(str, error.absolute_path))}: {error.message}"
        for inner in error.context or []:
            yield from walk(inner)
    return [line for error in validator.iter_errors(body) for line in walk(error)]


def logs_resources(**parameters: Any) -> list[dict[str, Any]]:
    deployment = Deployment(template(AZURE_MONITOR / "forewarn-logs.json"), {"workspaceName": "logs", **parameters})
    return deployment.resources()


@pytest.mark.parametrize("principal", ["", "11111111-2222-3333-4444-555555555555"])
def test_every_resource_of_forewarn_logs_is_valid_against_its_template_schema(principal: str) -> None:
    resources = logs_resources(principalId=principal)
    kinds = [resource["type"] for resource in resources]
    expected = [kind for kind in LOGS_SCHEMAS if principal or kind != "Microsoft.Authorization/roleAssignments"]
    assert kinds == expected
    for resource in resources:
        filename, definition = LOGS_SCHEMAS[resource["type"]]
        assert resource["apiVersion"] in filename
        body = {key: value for key, value in resource.items() if key not in ARM_ONLY}
        assert errors(template_schema_validator(filename, definition), body) == [], resource["type"]
    if principal:
        (assignment,) = [resource for resource in resources if resource["type"].endswith("roleAssignments")]
        assert assignment["properties"]["principalId"] == principal
        assert assignment["properties"]["roleDefinitionId"].endswith(
            "/providers/Microsoft.Authorization/roleDefinitions/3913510d-42f4-4e42-8a64-420c390055eb")
        assert assignment["scope"] == "Microsoft.Insights/dataCollectionRules/forewarn-dcr"


@pytest.mark.parametrize(("kind", "change", "expected"), [
    ("tables", lambda body: body["properties"]["schema"]["columns"][0].update(type="text"),
     "properties/schema/columns/0/type: 'text' is not one of"),
    ("tables", lambda body: body["properties"].update(retentionInDays="[parameters('x')]"),
     "properties/retentionInDays: \"[parameters('x')]\" is not valid under any of the given schemas"),
    ("tables", lambda body: body["properties"]["schema"].update(colums=[]),
     "properties/schema: Additional properties are not allowed ('colums' was unexpected)"),
    ("dataCollectionRules", lambda body: body["properties"]["streamDeclarations"]["Custom-ForewarnEvents"][
        "columns"][0].update(type="dateTime"),
     "properties/streamDeclarations/Custom-ForewarnEvents/columns/0/type: 'dateTime' is not one of"),
    ("dataCollectionRules", lambda body: body["properties"]["dataFlows"][0].update(streams="Custom-ForewarnEvents"),
     "properties/dataFlows/0/streams: 'Custom-ForewarnEvents' is not of type 'array'"),
    ("dataCollectionRules", lambda body: body["properties"]["destinations"].update(logAnalytics={}),
     "properties/destinations/logAnalytics: {} is not of type 'array'"),
    ("dataCollectionEndpoints", lambda body: body["properties"]["networkAcls"].update(publicNetworkAccess="Open"),
     "properties/networkAcls/publicNetworkAccess: 'Open' is not one of"),
    ("roleAssignments", lambda body: body["properties"].update(principalType="Robot"),
     "properties/principalType: 'Robot' is not one of"),
])
def test_the_template_schema_check_refuses_what_the_schema_does_not_allow(kind: str, change: Any,
                                                                          expected: str) -> None:
    (resource,) = [resource for resource in logs_resources(principalId="11111111-2222-3333-4444-555555555555")
                   if resource["type"].endswith("/" + kind)]
    body = {key: value for key, value in resource.items() if key not in ARM_ONLY}
    change(body)
    filename, definition = LOGS_SCHEMAS[resource["type"]]
    found = schema_errors(template_schema_validator(filename, definition), body)
    assert any(expected in error for error in found), found
