#!/usr/bin/env python3
"""Azure Monitor alert templates, generated from the one source of each rule.

- deploy/azure-monitor/forewarn-prometheus-rules.json: one `Microsoft.AlertsManagement/prometheusRuleGroups`
  resource per group of deploy/prometheus/forewarn-alerts.yaml, for Azure Monitor managed service for Prometheus.
- deploy/azure-monitor/forewarn-log-alerts.json: `Microsoft.Insights/scheduledQueryRules` log search alerts over
  the logs-ingestion table ForewarnEvents_CL, their KQL taken from the `// alert: Name` blocks of
  deploy/azure-monitor/forewarn-queries.kql.

    scripts/azure_monitor.py          # write both templates
    scripts/azure_monitor.py --check  # exit 1 if a committed template differs from what the sources give

Edit the sources, never the templates; tests/test_azure_monitor.py fails on any drift.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "forewarn-alerts.yaml"
QUERIES = ROOT / "deploy" / "azure-monitor" / "forewarn-queries.kql"
PROMETHEUS_TEMPLATE = ROOT / "deploy" / "azure-monitor" / "forewarn-prometheus-rules.json"
LOG_ALERTS_TEMPLATE = ROOT / "deploy" / "azure-monitor" / "forewarn-log-alerts.json"

SCHEMA = "https://schema.management.azure.com/schemas/2019-04-01/deploymentTemplate.json#"
#: The only stable api-version of prometheusRuleGroups in Azure/azure-rest-api-specs.
PROMETHEUS_API_VERSION = "2023-03-01"
#: The newest stable api-version of scheduledQueryRules in Azure/azure-rest-api-specs.
LOG_ALERTS_API_VERSION = "2026-03-01"

#: A rule's `severity` label -> Azure Monitor alert severity (0 Critical, 1 Error, 2 Warning, 3 Informational,
#: 4 Verbose). An alert without one of these labels is an error: every forewarn alert names its severity.
SEVERITIES: dict[str, int] = {"critical": 0, "error": 1, "warning": 2, "info": 3, "verbose": 4}

RULE_KEYS = {"alert", "record", "expr", "for", "labels", "annotations"}
#: Microsoft's page on rule groups (learn.microsoft.com, azure-monitor/metrics/prometheus-rule-groups) limits a
#: group to 20 rules.
MAX_RULES = 20
GROUP_KEYS = {"name", "rules", "interval"}
#: A rule group's evaluation interval: "between 1 and 15 minutes", says the `interval` property of
#: PrometheusRuleGroups.json (tests/azure-rest-api-specs), in seconds.
INTERVAL_RANGE = (60, 15 * 60)

#: The annotation holding a runbook link. forewarn's are repository-relative (docs/runbook.md#...), which an Azure
#: alert shows as dead text: the template prefixes the parameter runbookBaseUrl to a relative one.
RUNBOOK_ANNOTATION = "runbook_url"
#: Where the repository-relative paths resolve: the project's GitHub repository (deploy/helm/forewarn/Chart.yaml's
#: home), main branch.
RUNBOOK_BASE_URL = "https://github.com/forewarn/forewarn/blob/main/"
_RUNBOOK_EXPRESSION = re.compile(r"\[concat\(parameters\('runbookBaseUrl'\), '((?:[^']|'')*)'\)\]")

#: Prometheus duration units (https://prometheus.io/docs/prometheus/latest/configuration/configuration/#duration)
#: in seconds; ms is left out because ISO 8601 durations in Azure rule groups count whole seconds here.
_UNITS = {"y": 365 * 86400, "w": 7 * 86400, "d": 86400, "h": 3600, "m": 60, "s": 1}
_PROMETHEUS_DURATION = re.compile(r"(?:(\d+)y)?(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")
_ISO_DURATION = re.compile(r"P(?:(\d+)D)?(?:T(?:(\d+)H)?(?:(\d+)M)?(?:(\d+)S)?)?")


class SourceError(ValueError):
    """A rule or query the templates cannot carry; the message names the file and the rule."""


def iso8601_duration(text: str, where: str) -> str:
    """A Prometheus duration ("1m", "1h30m", "2d") as an ISO 8601 one ("PT1M", "PT1H30M", "P2D")."""
    match = _PROMETHEUS_DURATION.fullmatch(text)
    if not text or match is None:
        raise SourceError(f"{where}: {text!r} is not a Prometheus duration in whole seconds "
                          "(units y, w, d, h, m, s, largest first)")
    seconds = sum(int(value) * unit for value, unit in zip(match.groups(), _UNITS.values(), strict=True) if value)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    time = "".join(f"{value}{unit}" for value, unit in ((hours, "H"), (minutes, "M"), (secs, "S")) if value)
    if not days and not time:
        return "PT0S"
    return "P" + (f"{days}D" if days else "") + (f"T{time}" if time else "")


def prometheus_duration(text: str) -> str:
    """The inverse of iso8601_duration for the durations it writes."""
    match = _ISO_DURATION.fullmatch(text)
    if match is None or text in ("P", "PT"):
        raise SourceError(f"{text!r} is not an ISO 8601 duration of days, hours, minutes and seconds")
    parts = [f"{value}{unit}" for value, unit in zip(match.groups(), "dhms", strict=True) if value and int(value)]
    return "".join(parts) or "0s"


def _seconds(iso: str) -> int:
    match = _ISO_DURATION.fullmatch(iso)
    assert match is not None, iso
    return sum(int(value) * unit for value, unit in zip(match.groups(), (86400, 3600, 60, 1), strict=True) if value)


def _annotation(key: str, value: str) -> str:
    """An annotation's value as the template holds it: a relative runbook link prefixed with runbookBaseUrl; any
    other value a literal (ARM reads a string that starts with "[" and ends with "]" as an expression, unless it
    starts with "[[", which stands for one literal "[")."""
    if key == RUNBOOK_ANNOTATION and value and "://" not in value:
        return f"[concat(parameters('runbookBaseUrl'), {_arm_literal(value)})]"
    return "[" + value if value.startswith("[") and value.endswith("]") else value


def _source_annotation(value: str) -> str:
    """The inverse of _annotation."""
    match = _RUNBOOK_EXPRESSION.fullmatch(value)
    if match is not None:
        return match.group(1).replace("''", "'")
    return value[1:] if value.startswith("[[") and value.endswith("]") else value


def _rule(rule: Mapping[str, Any], where: str) -> dict[str, Any]:
    unknown = set(rule) - RULE_KEYS
    if unknown:
        raise SourceError(f"{where}: {', '.join(sorted(unknown))} has no counterpart in a Prometheus rule group "
                          f"(expected keys: {', '.join(sorted(RULE_KEYS))})")
    if ("alert" in rule) == ("record" in rule):
        raise SourceError(f"{where}: a rule has exactly one of `alert` and `record`")
    if not isinstance(rule.get("expr"), str) or not rule["expr"].strip():
        raise SourceError(f"{where}: `expr` must be a non-empty PromQL expression")
    labels = {str(key): str(value) for key, value in (rule.get("labels") or {}).items()}
    out: dict[str, Any] = {"alert": rule["alert"]} if "alert" in rule else {"record": rule["record"]}
    out["expression"] = rule["expr"].strip()
    if "for" in rule:
        out["for"] = iso8601_duration(str(rule["for"]), f"{where}: for")
    if "alert" in rule:
        severity = labels.get("severity")
        if severity not in SEVERITIES:
            raise SourceError(f"{where}: the label `severity` is {severity!r}; expected one of "
                              f"{', '.join(SEVERITIES)} (mapped to Azure severities 0-4)")
        out["severity"] = SEVERITIES[severity]
    if labels:
        out["labels"] = labels
    if rule.get("annotations"):
        out["annotations"] = {str(key): _annotation(str(key), str(value)) for key, value in rule["annotations"].items()}
    if "alert" in rule:
        out["actions"] = "[variables('actions')]"
    return out


def rule_groups_template(rules_yaml: str, source: str = "deploy/prometheus/forewarn-alerts.yaml") -> dict[str, Any]:
    """The ARM template of one prometheusRuleGroups resource per group of a Prometheus rules file."""
    groups = (yaml.safe_load(rules_yaml) or {}).get("groups")
    if not isinstance(groups, list) or not groups:
        raise SourceError(f"{source}: expected a `groups` list")
    resources = []
    for group in groups:
        name = group.get("name")
        unknown = set(group) - GROUP_KEYS
        if unknown:
            raise SourceError(f"{source}: group {name}: {', '.join(sorted(unknown))} has no counterpart in a "
                              "Prometheus rule group")
        if not isinstance(name, str) or not re.fullmatch(r"[^:@/#{}%&+*<>?]+", name):
            raise SourceError(f"{source}: group name {name!r} is not a valid rule group name "
                              "(none of : @ / # { } % & + * < > ?)")
        rules = [_rule(rule, f"{source}: group {name}, rule {rule.get('alert') or rule.get('record')}")
                 for rule in group.get("rules") or []]
        if not rules or len(rules) > MAX_RULES:
            raise SourceError(f"{source}: group {name} has {len(rules)} rules; an Azure rule group holds 1 to "
                              f"{MAX_RULES} (split the group)")
        interval = "[parameters('interval')]"
        if "interval" in group:
            interval = iso8601_duration(str(group["interval"]), f"{source}: group {name}: interval")
            if not INTERVAL_RANGE[0] <= _seconds(interval) <= INTERVAL_RANGE[1]:
                raise SourceError(f"{source}: group {name}: interval {group['interval']!r} is outside the 1 to 15 "
                                  "minutes an Azure rule group is evaluated at (1m to 15m; or leave it out for the "
                                  "template's parameter `interval`)")
        resources.append({
            "type": "Microsoft.AlertsManagement/prometheusRuleGroups",
            "apiVersion": PROMETHEUS_API_VERSION,
            "name": f"[format('{name}-{{0}}', parameters('clusterName'))]",
            "location": "[parameters('location')]",
            "properties": {
                "description": f"forewarn's rule group {name}, generated from {source}",
                "enabled": True,
                "clusterName": "[parameters('clusterName')]",
                "scopes": ["[parameters('azureMonitorWorkspaceId')]"],
                "interval": interval,
                "rules": rules,
            },
        })
    return {
        "$schema": SCHEMA,
        "contentVersion": "1.0.0.0",
        "metadata": {
            "description": "forewarn's Prometheus alert and recording rules as Azure Monitor managed Prometheus rule "
                           "groups, one per group. Generated by scripts/azure_monitor.py from " + source
                           + "; edit that file, not this one. Rule severities: " + ", ".join(
                               f"{label} -> {value}" for label, value in SEVERITIES.items()) + ".",
        },
        "parameters": {
            "azureMonitorWorkspaceId": {"type": "string", "metadata": {
                "description": "resource id of the Azure Monitor workspace the cluster's metrics go to"}},
            "clusterName": {"type": "string", "metadata": {
                "description": "the `cluster` label managed Prometheus gives the cluster's metrics (by default the AKS "
                               "cluster's resource name); the rules read only that cluster's series, and each "
                               "group's name ends with it"}},
            "actionGroupIds": {"type": "array", "defaultValue": [], "metadata": {
                "description": "resource ids of the action groups every alert notifies (none: alerts only show in "
                               "Azure Monitor)"}},
            "interval": {"type": "string", "defaultValue": "PT1M", "metadata": {
                "description": "how often each group is evaluated, an ISO 8601 duration of 1 to 15 minutes"}},
            "runbookBaseUrl": {"type": "string", "defaultValue": RUNBOOK_BASE_URL, "metadata": {
                "description": "prefixed to each alert's repository-relative runbook_url annotation "
                               "(docs/runbook.md#...), so that the alert links to the page: forewarn's repository "
                               "by default, or where you host a copy of its docs/ (ending in the folder that holds "
                               "docs/, with a slash)"}},
            "location": {"type": "string", "defaultValue": "[resourceGroup().location]", "metadata": {
                "description": "region of the rule groups: the Azure Monitor workspace's"}},
        },
        "variables": {
            "copy": [{
                "name": "actions",
                "count": "[length(parameters('actionGroupIds'))]",
                "input": {"actionGroupId": "[parameters('actionGroupIds')[copyIndex('actions')]]"},
            }],
        },
        "resources": resources,
    }


def _group_name(resource: Mapping[str, Any]) -> str:
    match = re.fullmatch(r"\[format\('(.+)-\{0\}', parameters\('clusterName'\)\)\]", resource["name"])
    if match is None:
        raise SourceError(f"resource name {resource['name']!r} is not one this script writes")
    return match.group(1)


def prometheus_rules(template: Mapping[str, Any]) -> dict[str, Any]:
    """The Prometheus rules file a rule-groups template stands for (what Azure evaluates, before its own
    per-rule severity and actions), to run promtool's unit tests on."""
    groups = []
    for resource in template["resources"]:
        props = resource["properties"]
        group: dict[str, Any] = {"name": _group_name(resource)}
        if not props["interval"].startswith("["):
            group["interval"] = prometheus_duration(props["interval"])
        rules = []
        for rule in props["rules"]:
            out: dict[str, Any] = {"alert": rule["alert"]} if "alert" in rule else {"record": rule["record"]}
            out["expr"] = rule["expression"]
            if "for" in rule:
                out["for"] = prometheus_duration(rule["for"])
            if "labels" in rule:
                out["labels"] = dict(rule["labels"])
            if "annotations" in rule:
                out["annotations"] = {key: _source_annotation(value) for key, value in rule["annotations"].items()}
            rules.append(out)
        group["rules"] = rules
        groups.append(group)
    return {"groups": groups}


# --- log search alerts ---------------------------------------------------------------------------------------

#: What each `// alert:` block of forewarn-queries.kql becomes. `parameter` names the block's first `let` and the
#: template parameter (whole minutes) that replaces its value; its default is the value in the .kql file.
LOG_ALERTS: dict[str, dict[str, Any]] = {
    "ForewarnRebootImminent": {
        "resource": "reboot-imminent",
        "description": "A Reboot, Redeploy, Terminate or Preempt affecting a VM is Scheduled and its NotBefore is "
                       "less than imminentMinutes away (forewarn records in ForewarnEvents_CL).",
        "severity": SEVERITIES["warning"],
        "parameter": ("ImminentWithin", "imminentMinutes",
                      "alert when NotBefore of a reboot-class event is less than this many minutes away"),
    },
    "ForewarnEventStartedTooLong": {
        "resource": "event-started-too-long",
        "description": "A scheduled event has been Started for longer than its announced duration plus "
                       "startedMarginMinutes and has not been reported removed.",
        "severity": SEVERITIES["warning"],
        "parameter": ("StartedMargin", "startedMarginMinutes",
                      "alert when an event stays Started this many minutes beyond its announced duration"),
    },
}
#: The dimensions each alert is split by: one alert per event and VM.
DIMENSIONS = ("VmName", "EventId", "EventType")
#: Records arrive on changes only, so the query must see back to when an event was announced or started. Two days
#: is the longest query time range a log search alert takes; an event announced earlier than that is not seen.
QUERY_TIME_RANGE = "P2D"
EVALUATION_FREQUENCY = "PT5M"


def alert_queries(kql: str, source: str = "deploy/azure-monitor/forewarn-queries.kql") -> dict[str, str]:
    """The `// alert: Name` blocks of a .kql file: name -> query (its non-comment lines, up to a blank line)."""
    queries: dict[str, str] = {}
    lines = kql.splitlines()
    for number, line in enumerate(lines):
        match = re.fullmatch(r"// alert: (\w+)", line.strip())
        if match is None:
            continue
        name = match.group(1)
        if name in queries:
            raise SourceError(f"{source}:{number + 1}: a second `// alert: {name}` block")
        body = []
        for following in lines[number + 1:]:
            if not following.strip():
                break
            if not following.lstrip().startswith("//"):
                body.append(following.rstrip())
        if not body:
            raise SourceError(f"{source}:{number + 1}: alert {name} has no query")
        queries[name] = "\n".join(body)
    return queries


def _arm_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def log_alerts_template(kql: str, source: str = "deploy/azure-monitor/forewarn-queries.kql") -> dict[str, Any]:
    """The ARM template of one scheduledQueryRules log search alert per alert query of the .kql file."""
    queries = alert_queries(kql, source)
    if set(queries) != set(LOG_ALERTS):
        raise SourceError(f"{source}: alert blocks {sorted(queries)}; scripts/azure_monitor.py knows "
                          f"{sorted(LOG_ALERTS)} (add a new one to LOG_ALERTS)")
    parameters: dict[str, Any] = {
        "workspaceName": {"type": "string", "metadata": {
            "description": "the Log Analytics workspace holding ForewarnEvents_CL (deploy/azure-monitor/"
                           "forewarn-logs.json), in this resource group"}},
        "actionGroupIds": {"type": "array", "defaultValue": [], "metadata": {
            "description": "resource ids of the action groups every alert notifies"}},
        "namePrefix": {"type": "string", "defaultValue": "forewarn"},
        "location": {"type": "string", "defaultValue": "[resourceGroup().location]"},
    }
    variables: dict[str, Any] = {}
    resources = []
    for name, spec in LOG_ALERTS.items():
        let_name, parameter, parameter_description = spec["parameter"]
        first, _, rest = queries[name].partition("\n")
        match = re.fullmatch(rf"let {let_name} = (\d+)m;", first)
        if match is None or not rest:
            raise SourceError(f"{source}: alert {name} must start with `let {let_name} = <minutes>m;`")
        parameters[parameter] = {"type": "int", "defaultValue": int(match.group(1)), "minValue": 1,
                                 "metadata": {"description": parameter_description}}
        variable = name[0].lower() + name[1:] + "Query"
        # The query goes in a variable, a plain string: a value starting with "[" would be an ARM expression, and
        # none of these queries does. The rule's query is `let <name> = <parameter>m; ` and that variable.
        variables[variable] = rest
        resources.append({
            "type": "Microsoft.Insights/scheduledQueryRules",
            "apiVersion": LOG_ALERTS_API_VERSION,
            "name": f"[format('{{0}}-{spec['resource']}', parameters('namePrefix'))]",
            "location": "[parameters('location')]",
            "kind": "LogAlert",
            "properties": {
                "displayName": name,
                "description": spec["description"],
                "severity": spec["severity"],
                "enabled": True,
                "scopes": ["[resourceId('Microsoft.OperationalInsights/workspaces', parameters('workspaceName'))]"],
                "evaluationFrequency": EVALUATION_FREQUENCY,
                "windowSize": EVALUATION_FREQUENCY,
                "overrideQueryTimeRange": QUERY_TIME_RANGE,
                "criteria": {"allOf": [{
                    "query": f"[concat({_arm_literal(f'let {let_name} = ')}, string(parameters('{parameter}')), "
                             f"'m; ', variables('{variable}'))]",
                    "timeAggregation": "Count",
                    "dimensions": [{"name": column, "operator": "Include", "values": ["*"]}
                                   for column in DIMENSIONS],
                    "operator": "GreaterThan",
                    "threshold": 0,
                    "failingPeriods": {"numberOfEvaluationPeriods": 1, "minFailingPeriodsToAlert": 1},
                }]},
                "autoMitigate": True,
                "actions": {"actionGroups": "[parameters('actionGroupIds')]"},
            },
        })
    return {
        "$schema": SCHEMA,
        "contentVersion": "1.0.0.0",
        "metadata": {
            "description": "Log search alerts on forewarn's records in ForewarnEvents_CL, for VMs without "
                           "Prometheus. Generated by scripts/azure_monitor.py from " + source
                           + " (the `// alert:` blocks); edit that file, not this one.",
        },
        "parameters": parameters,
        "variables": variables,
        "resources": resources,
    }


def render(template: Mapping[str, Any]) -> str:
    return json.dumps(template, indent=2, ensure_ascii=False) + "\n"


def generated() -> dict[Path, str]:
    return {
        PROMETHEUS_TEMPLATE: render(rule_groups_template(RULES.read_text())),
        LOG_ALERTS_TEMPLATE: render(log_alerts_template(QUERIES.read_text())),
    }


def main(argv: list[str]) -> int:
    if argv not in ([], ["--check"]):
        print("usage: scripts/azure_monitor.py [--check]", file=sys.stderr)
        return 2
    try:
        outputs = generated()
    except SourceError as error:
        print(f"azure_monitor.py: {error}", file=sys.stderr)
        return 1
    stale = [path for path, text in outputs.items() if not path.exists() or path.read_text() != text]
    if argv == ["--check"]:
        for path in stale:
            print(f"{path.relative_to(ROOT)} differs from its sources: run scripts/azure_monitor.py",
                  file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(outputs[path])
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
