"""The Kubernetes deploy files: kustomize builds, strict schema validation, and the security settings."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import require_promtool, require_tool

ROOT = Path(__file__).parent.parent
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.32.0"


def build(target: str) -> list[dict[str, Any]]:
    kubectl = require_tool("kubectl", "Debian package kubectl")
    result = subprocess.run([kubectl, "kustomize", str(KUSTOMIZE / target)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


NODE_ACTIONS = ["ClusterRole", "ClusterRoleBinding", "NetworkPolicy"]  # components/node-actions


@pytest.mark.parametrize(("target", "extra"), [("base", []), ("overlays/aks", NODE_ACTIONS)])
def test_every_object_is_a_core_one_that_validates_strictly(target: str, extra: list[str]) -> None:
    # `kubectl apply -k` of the base or an overlay works on a cluster without any CRD: the Prometheus Operator's
    # objects are the opt-in component prometheus-operator, as they are opt-in values of the Helm chart
    import kubernetes_validate

    docs = build(target)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["Namespace", "ServiceAccount", "ConfigMap", "Service", "PriorityClass", "DaemonSet",
                            "NetworkPolicy", *extra])
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_core_check_refuses_a_crd_backed_kind(tmp_path: Path) -> None:
    import kubernetes_validate

    monitor = by_kind(build(with_operator(tmp_path, "base")), "ServiceMonitor")
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(monitor, K8S_VERSION, strict=True)


CRD_VALIDATOR = Path(__file__).parent / "crd" / "validate.mjs"


def validate_crds(manifests: str) -> subprocess.CompletedProcess[str]:
    """Run the Prometheus Operator CRD schema check (tests/crd, installed by scripts/test with npm)."""
    node = require_tool("node", "Node.js, with `npm ci --prefix tests/crd`")
    if not (CRD_VALIDATOR.parent / "node_modules" / "@kubernetes-models" / "prometheus-operator").is_dir():
        pytest.skip("CRD schemas not installed: npm ci --prefix tests/crd")
    return subprocess.run([node, str(CRD_VALIDATOR)], input=manifests, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("target", ["base", "overlays/aks", "overlays/fleet"])
def test_monitoring_objects_validate_against_the_prometheus_operator_crds(target: str, tmp_path: Path) -> None:
    docs = build(with_operator(tmp_path, target))
    result = validate_crds(yaml.safe_dump_all(docs))
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(result.stdout.split("\n")[:-1]) == ["ok PrometheusRule forewarn", "ok ServiceMonitor forewarn"]


def test_the_crd_check_rejects_what_the_operator_would(tmp_path: Path) -> None:
    docs = build(with_operator(tmp_path, "base"))
    monitor, rule = by_kind(docs, "ServiceMonitor"), by_kind(docs, "PrometheusRule")
    monitor["spec"]["endpoints"][0]["port"] = 9465                     # a port name is a string
    del rule["spec"]["groups"][0]["rules"][0]["expr"]                  # every rule needs an expression
    result = validate_crds(yaml.safe_dump_all([monitor, rule]))
    assert result.returncode == 1
    assert "invalid ServiceMonitor forewarn: /spec/endpoints/0/port must be string" in result.stdout
    assert "invalid PrometheusRule forewarn: /spec/groups/0/rules/0 must have required property expr" in result.stdout


def pod_specs(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pod spec of every object that makes pods (a DaemonSet, a Deployment, ...)."""
    return [d["spec"]["template"]["spec"] for d in docs if "template" in d.get("spec", {})]


TARGETS = ["base", *sorted(str(p.relative_to(KUSTOMIZE)) for p in (KUSTOMIZE / "overlays").iterdir())]


@pytest.mark.parametrize("target", TARGETS)
def test_no_pod_gets_service_link_variables(target: str) -> None:
    # A Service named forewarn-* in the namespace would otherwise give forewarn FOREWARN_* variables it does
    # not read (forewarn.config.is_service_link).
    specs = pod_specs(build(target))
    assert specs and all(spec["enableServiceLinks"] is False for spec in specs)


def test_daemonset_is_locked_down() -> None:
    docs = build("base")
    pod = by_kind(docs, "DaemonSet")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 65532
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert pod["automountServiceAccountToken"] is False
    assert {"operator": "Exists"} in pod["tolerations"]
    assert pod["priorityClassName"] == by_kind(docs, "PriorityClass")["metadata"]["name"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["resources"]["requests"] and container["resources"]["limits"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert env["FOREWARN_STATE_DIR"]["value"] in mounts
    assert by_kind(docs, "Namespace")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_network_policy_allows_imds_and_dns() -> None:
    egress = by_kind(build("base"), "NetworkPolicy")["spec"]["egress"]
    imds = [rule for rule in egress if rule.get("to") == [{"ipBlock": {"cidr": "169.254.169.254/32"}}]]
    assert imds and imds[0]["ports"] == [{"port": 80, "protocol": "TCP"}]
    assert any({"port": 53, "protocol": "UDP"} in rule.get("ports", []) for rule in egress)


def test_monitoring_objects_match_the_service_and_the_rule_file(tmp_path: Path) -> None:
    docs = build(with_operator(tmp_path, "base"))
    service, monitor = by_kind(docs, "Service"), by_kind(docs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    ports = {port["name"] for port in service["spec"]["ports"]}
    assert {endpoint["port"] for endpoint in monitor["spec"]["endpoints"]} <= ports
    # jobLabel makes job="forewarn", which the alert rules select on
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "forewarn"
    rule = by_kind(docs, "PrometheusRule")
    shipped = yaml.safe_load((ROOT / "deploy" / "prometheus" / "forewarn-alerts.yaml").read_text())
    assert rule["spec"]["groups"] == shipped["groups"]
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    result = subprocess.run([require_promtool(), "check", "rules", str(rules_file)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_policy_config_map_is_a_valid_policy(tmp_path: Path) -> None:
    from forewarn.approval.policy import parse_policy

    config_map = by_kind(build("base"), "ConfigMap")
    assert parse_policy(config_map["data"]["policy.yaml"]).rules
    # the shipped default is the documented sample behaviour, kept identical to the tested example
    assert config_map["data"]["policy.yaml"] == (ROOT / "examples" / "policies" / "docs-sample.yaml").read_text()


def test_aks_overlay_reads_the_event_hubs_secret_from_a_file() -> None:
    pod = by_kind(build("overlays/aks"), "DaemonSet")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["FOREWARN_SINK"] == "stdout,eventhubs"
    path = env["FOREWARN_EVENTHUBS_CONNECTION_STRING_FILE"]
    assert "FOREWARN_EVENTHUBS_CONNECTION_STRING" not in env, "never the secret itself in the pod spec"
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert path.startswith(mounts["eventhubs"])
    assert {"name": "eventhubs", "secret": {"secretName": "forewarn-eventhubs", "defaultMode": 0o440}} in pod["volumes"]


def compose(directory: Path, target: str, components: list[str]) -> str:
    """An overlay in `directory` of `target` (base, overlays/...) with `components` (components/...), in that
    order (kustomize takes only relative paths to them)."""
    import os

    overlay = directory / "-".join(["overlay", *(c.rsplit("/", 1)[-1] for c in components)])
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(KUSTOMIZE / target, overlay)],
        "components": [os.path.relpath(KUSTOMIZE / c, overlay) for c in components]}))
    return str(overlay)


def with_operator(tmp_path: Path, target: str) -> str:
    """`target` with the Prometheus Operator's objects (the component prometheus-operator)."""
    return compose(tmp_path, target, ["components/prometheus-operator"])


def web_tls_overlay(tmp_path: Path) -> str:
    """An overlay of base with the Prometheus Operator objects and the web-tls component, which switches their
    ServiceMonitor to HTTPS."""
    return compose(tmp_path, "base", ["components/prometheus-operator", "components/web-tls"])


def test_the_web_tls_component_validates_and_wires_the_secret_the_config_and_https(tmp_path: Path) -> None:
    import kubernetes_validate

    docs = build(web_tls_overlay(tmp_path))
    for doc in docs:
        if not doc["apiVersion"].startswith("monitoring.coreos.com/"):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    result = validate_crds(yaml.safe_dump_all(docs))
    assert result.returncode == 0, result.stdout + result.stderr

    (container,) = by_kind(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    pod = by_kind(docs, "DaemonSet")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert env["FOREWARN_WEB_CONFIG_FILE"] == mounts["web-config"] + "/web.yml"
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "forewarn-web-config"]
    assert volumes["web-config"]["configMap"]["name"] == config_map["metadata"]["name"]
    web = yaml.safe_load(config_map["data"]["web.yml"])["tls_server_config"]
    assert volumes["web-tls"]["secret"]["secretName"] == "forewarn-web-tls"
    assert web["cert_file"] == mounts["web-tls"] + "/tls.crt" and web["key_file"] == mounts["web-tls"] + "/tls.key"
    assert container["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    endpoint = by_kind(docs, "ServiceMonitor")["spec"]["endpoints"][0]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"]["ca"]["secret"] == {"name": "forewarn-web-tls", "key": "ca.crt"}


def test_node_actions_component_grants_least_privilege_and_passes_the_node_name() -> None:
    from forewarn.approval.policy import parse_policy

    docs = build("overlays/aks")
    role, binding = by_kind(docs, "ClusterRole"), by_kind(docs, "ClusterRoleBinding")
    granted = {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    assert granted == {("", "nodes", "get"), ("", "nodes", "patch"), ("", "nodes/status", "patch"),
                       ("", "pods", "list"), ("", "pods", "delete"), ("", "pods/eviction", "create"),
                       ("events.k8s.io", "events", "create"),
                       ("coordination.k8s.io", "leases", "get"), ("coordination.k8s.io", "leases", "create"),
                       ("coordination.k8s.io", "leases", "update")}
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    daemonset = by_kind(docs, "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                    "namespace": daemonset["metadata"]["namespace"]}]
    assert pod["automountServiceAccountToken"] is True
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["FOREWARN_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # a drain with stop_daemonsets taints the node NoExecute: forewarn's own pod tolerates it
    assert {"key": "forewarn.io/drained", "operator": "Exists", "effect": "NoExecute"} in pod["tolerations"]
    policy = parse_policy(by_kind(docs, "ConfigMap")["data"]["policy.yaml"])
    acting = {rule.name: [a.kind for a in rule.node] for rule in policy.rules if rule.node}
    assert "drain" in acting["reboot"] and "drain" in acting["spot-eviction-and-terminate"]
    assert [d["metadata"]["namespace"] for d in docs if d["kind"] == "NetworkPolicy"] == ["forewarn", "forewarn"]
