"""Deploy files for `forewarn fleet`: the Helm chart's mode: fleet (a real helm, every object validated), the
kustomize overlay overlays/fleet kept equal to it, the chart's mode: agent unchanged, and the Azure side
(deploy/azure: the ARM template's structure, since ARM cannot run here, and the az script's syntax)."""

from __future__ import annotations

import copy
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from test_helm import CHART, NAMESPACE, RELEASE, helm, lint_and_validate, one, render
from test_kubernetes import K8S_VERSION, build, pod_specs

ROOT = Path(__file__).parent.parent
AZURE = ROOT / "deploy" / "azure"
CLIENT_ID = "00000000-0000-0000-0000-00000000c11d"
SUBSCRIPTION = "00000000-0000-0000-0000-000000000005"
QUEUE_URL = "https://forewarnfleet.queue.core.windows.net/scheduled-events"
FLEET = {"mode": "fleet",
         "fleet": {"clientId": CLIENT_ID, "subscriptions": [SUBSCRIPTION], "queue": {"url": QUEUE_URL}}}


def fleet(**more: Any) -> dict[str, Any]:
    """FLEET with more values merged in (nested dicts merged, not replaced)."""
    values = copy.deepcopy(FLEET)

    def merge(into: dict[str, Any], extra: dict[str, Any]) -> None:
        for key, value in extra.items():
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                merge(into[key], value)
            else:
                into[key] = value
    merge(values, more)
    return values


def pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return dict(one(docs, "Deployment")["spec"]["template"]["spec"])


def env_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod(docs)["containers"][0]["env"]}


OPERATOR = {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}, "dashboards": {"enabled": True}}
MATRIX: dict[str, dict[str, Any]] = {
    "subscriptions and a queue": FLEET,
    "subscriptions, resource groups and a queue": fleet(fleet={"resourceGroups": ["rg-a", "MC_rg-a_aks-a_westeurope"]}),
    "resource groups and a push route, no Resource Graph": {
        "mode": "fleet", "fleet": {"clientId": CLIENT_ID, "resourceGroups": ["rg-a"], "eventgrid": {
            "path": "/eventgrid", "sharedSecret": {"name": "forewarn-eventgrid"}}}},
    "management group, one replica, no network policy, own service account": {
        "mode": "fleet", "networkPolicy": {"enabled": False},
        "serviceAccount": {"create": False, "name": "forewarn-central"},
        "fleet": {"clientId": CLIENT_ID, "managementGroups": ["platform"], "replicas": 1}},
    "queue with a connection string, push route, every sink, web tls, operator": fleet(
        **OPERATOR,
        fleet={"reconcileInterval": 120, "metricsMaxVms": 2500, "leaseName": "central",
               "queue": {"connectionStringSecret": {"name": "forewarn-queue"}},
               "eventgrid": {"path": "/eventgrid", "sharedSecret": {"name": "forewarn-eventgrid"}}},
        sinks={"file": {"enabled": True}, "otlp": {"enabled": True, "endpoint": "http://otel:4317"},
               "eventhubs": {"enabled": True, "connectionStringSecret": {"name": "forewarn-eventhubs"}}},
        web={"tls": {"enabled": True, "secretName": "forewarn-web-tls"}},
        extraEnv=[{"name": "FOREWARN_LEASE_SECONDS", "value": "20"}], logLevel="debug"),
}


@pytest.mark.parametrize("name", MATRIX)
def test_fleet_mode_lints_strictly_and_every_rendered_object_validates(name: str) -> None:
    lint_and_validate(MATRIX[name])


@pytest.mark.parametrize("name", MATRIX)
def test_fleet_mode_has_no_daemonset_host_network_or_cluster_wide_object(name: str) -> None:
    docs = render(MATRIX[name])
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"DaemonSet", "ClusterRole", "ClusterRoleBinding", "PriorityClass"}
    assert "Deployment" in kinds
    spec = pod(docs)
    assert "hostNetwork" not in spec and "priorityClassName" not in spec
    # per-node and agent-only settings are gone: no node name, no IMDS egress, no policy
    assert not {"NODE_NAME", "FOREWARN_NODE_NAME", "FOREWARN_POLICY", "FOREWARN_DRY_RUN"} & set(env_of(docs))
    assert not [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-policy")]
    for policy in (d for d in docs if d["kind"] == "NetworkPolicy"):
        assert "169.254.169.254" not in json.dumps(policy)


def test_every_forewarn_variable_is_an_option_of_forewarn_fleet() -> None:
    from forewarn.config import FLEET_OPTIONS

    known = {option.env for option in FLEET_OPTIONS}
    for name, values in MATRIX.items():
        chart_set = {n for n in env_of(render(values)) if n.startswith("FOREWARN_")}
        assert chart_set <= known, (name, chart_set - known)
    assert {"FOREWARN_SUBSCRIPTION", "FOREWARN_QUEUE_URL", "FOREWARN_LEASE_NAME", "FOREWARN_LEASE_NAMESPACE"} <= \
        set(env_of(render(FLEET)))


def test_the_rendered_settings_are_what_forewarn_fleet_resolves(tmp_path: Path) -> None:
    """The environment the chart sets, through the real option parser of `forewarn fleet`."""
    from forewarn.cli import build_parser
    from forewarn.config import resolve_fleet

    docs = render(MATRIX["queue with a connection string, push route, every sink, web tls, operator"])
    environ = {k: v for k, v in env_of(docs).items() if isinstance(v, str)}
    for name, value in environ.items():         # the mounted Secrets, as files here
        if name.endswith("_FILE") and value.startswith("/var/run/secrets/"):
            environ[name] = str(tmp_path / value.strip("/").replace("/", "_"))
            Path(environ[name]).write_text("not a real secret\n")
    environ["FOREWARN_LEASE_NAMESPACE"] = NAMESPACE          # the downward API's metadata.namespace
    settings = resolve_fleet(build_parser().parse_args(["fleet"]), environ=environ)
    assert settings.subscription == [SUBSCRIPTION] and settings.queue_url == QUEUE_URL
    assert settings.reconcile_interval == 120 and settings.eventgrid_path == "/eventgrid"
    assert settings.metrics_max_vms == 2500 and "FOREWARN_METRICS_MAX_VMS" not in env_of(render(FLEET))
    assert settings.lease_name == "central" and settings.lease_namespace == NAMESPACE
    mounts = {m["name"]: m["mountPath"] for m in pod(docs)["containers"][0]["volumeMounts"]}
    files = {k: v for k, v in env_of(docs).items() if k.endswith("_FILE")}
    assert files["FOREWARN_QUEUE_CONNECTION_STRING_FILE"] == mounts["queue"] + "/connection-string"
    assert files["FOREWARN_EVENTGRID_SECRET_FILE"] == mounts["eventgrid"] + "/secret"
    assert settings.queue_connection_string_file and settings.eventgrid_secret_file    # files, never env values
    assert env_of(docs)["FOREWARN_LEASE_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


FLEET_POLICY = """rules:
  - name: aks-pools
    action: approve
    match: {scale_set: ["aks-*"], event_type: [Reboot, Redeploy]}
"""


def test_a_fleet_policy_is_mounted_checked_and_resolved(tmp_path: Path) -> None:
    """fleet.policy: the ConfigMap holds a policy `forewarn policy check --fleet` accepts, mounted where
    FOREWARN_POLICY points, with the dry run and api-version set through the real option parser."""
    from forewarn.cli import build_parser
    from forewarn.config import resolve_fleet

    assert "FOREWARN_POLICY" not in env_of(render(FLEET))             # no policy: nothing is acknowledged
    docs = render(fleet(fleet={"policy": {"content": FLEET_POLICY, "dryRun": True,
                                          "acknowledgeApiVersion": "2026-02-01-preview"}}))
    lint_and_validate(fleet(fleet={"policy": {"content": FLEET_POLICY}}))
    text = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-fleet-policy"))
    policy = tmp_path / "policy.yaml"
    policy.write_text(text["data"]["policy.yaml"])
    checked = subprocess.run(["forewarn", "policy", "check", "--fleet", str(policy)], capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0 and "1 rule(s), fleet mode" in checked.stdout, checked.stderr
    mount = next(m for m in pod(docs)["containers"][0]["volumeMounts"] if m["name"] == "policy")
    assert env_of(docs)["FOREWARN_POLICY"] == mount["mountPath"] and mount["readOnly"] is True
    environ = {k: v for k, v in env_of(docs).items() if isinstance(v, str)}
    environ["FOREWARN_POLICY"] = str(policy)
    settings = resolve_fleet(build_parser().parse_args(["fleet"]), environ=environ)
    assert settings.policy == str(policy) and settings.dry_run is True
    assert settings.acknowledge_api_version == "2026-02-01-preview"
    existing = render(fleet(fleet={"policy": {"existingConfigMap": "team-policy"}}))
    volume = next(v for v in pod(existing)["volumes"] if v["name"] == "policy")
    assert volume["configMap"]["name"] == "team-policy"
    assert not [d for d in existing if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-fleet-policy")]


def test_node_actions_rbac_is_off_by_default_and_the_same_in_helm_and_kustomize() -> None:
    """fleet.nodeActions.enabled: the cluster-wide role the fleet's node actions need, bound to its service
    account, with the rules of the kustomize component (tests/test_fleet_nodeactions.py runs the actions
    against the stand-in with that component's role)."""
    assert not [d for d in render(FLEET) if d["kind"].startswith("Cluster")]
    values = fleet(fleet={"nodeActions": {"enabled": True}})
    lint_and_validate(values)
    docs = render(values)
    component = ROOT / "deploy" / "kubernetes" / "components" / "fleet-node-actions"
    shipped = yaml.safe_load((component / "clusterrole.yaml").read_text())
    assert one(docs, "ClusterRole")["rules"] == shipped["rules"]
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == one(docs, "ClusterRole")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": one(docs, "ServiceAccount")["metadata"]["name"],
                                    "namespace": NAMESPACE}]
    kustomized = yaml.safe_load((component / "clusterrolebinding.yaml").read_text())
    overlay_account = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "overlays" / "fleet" /
                                      "serviceaccount.yaml").read_text())["metadata"]
    assert kustomized["subjects"] == [{"kind": "ServiceAccount", "name": overlay_account["name"],
                                       "namespace": "forewarn"}]


@pytest.mark.parametrize("name", ["subscriptions and a queue", "queue with a connection string, push route, "
                                  "every sink, web tls, operator"])
def test_no_fleet_pod_gets_service_link_variables(name: str) -> None:
    # A Service named forewarn-* in the namespace would otherwise give forewarn FOREWARN_* variables it does
    # not read (forewarn.config.is_service_link); the kustomize overlays: tests/test_kubernetes.py.
    specs = pod_specs(render(MATRIX[name]))
    assert specs and all(spec["enableServiceLinks"] is False for spec in specs)


def test_the_pod_is_locked_down_with_workload_identity_and_probes() -> None:
    docs = render(FLEET)
    deployment = one(docs, "Deployment")
    spec = pod(docs)
    (main,) = spec["containers"]
    assert main["args"] == ["fleet"]
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 65532
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert main["securityContext"] == {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                                       "privileged": False, "capabilities": {"drop": ["ALL"]}}
    assert main["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert main["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert main["resources"]["requests"] and main["resources"]["limits"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes["state"]
    assert {"name": "state", "mountPath": env_of(docs)["FOREWARN_STATE_DIR"]} in main["volumeMounts"]
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["template"]["metadata"]["labels"]["azure.workload.identity/use"] == "true"
    account = one(docs, "ServiceAccount")
    assert account["metadata"]["annotations"]["azure.workload.identity/client-id"] == CLIENT_ID
    assert spec["serviceAccountName"] == account["metadata"]["name"]
    assert spec["automountServiceAccountToken"] is True          # the Lease, with the service account's token
    assert not [d for d in docs if d["kind"] == "Secret"]


def test_replicas_land_on_different_nodes_and_a_disruption_budget_keeps_one() -> None:
    docs = render(FLEET)
    selector = one(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    spread = {c["topologyKey"]: c for c in pod(docs)["topologySpreadConstraints"]}
    assert spread["kubernetes.io/hostname"]["whenUnsatisfiable"] == "DoNotSchedule"
    assert spread["kubernetes.io/hostname"]["labelSelector"]["matchLabels"] == selector
    budget = one(docs, "PodDisruptionBudget")
    assert budget["spec"]["minAvailable"] == 1 and budget["spec"]["selector"]["matchLabels"] == selector
    single = render(fleet(fleet={"replicas": 1}))
    assert not [d for d in single if d["kind"] == "PodDisruptionBudget"]
    assert "tolerations" not in pod(docs)       # not on Spot nodes by default, unlike the agent


def test_rbac_is_one_role_for_one_lease_in_the_release_namespace() -> None:
    docs = render(fleet(fleet={"leaseName": "central"}))
    role, binding = one(docs, "Role"), one(docs, "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == NAMESPACE
    by_name = [r for r in role["rules"] if "resourceNames" in r]
    unnamed = [r for r in role["rules"] if "resourceNames" not in r]
    assert by_name == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["central"],
                        "verbs": ["get", "update"]}]
    # create cannot be limited by name; it is the only verb without one
    assert unnamed == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]}]
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod(docs)["serviceAccountName"],
                                    "namespace": NAMESPACE}]
    assert env_of(docs)["FOREWARN_LEASE_NAME"] == "central"
    assert env_of(render(FLEET))["FOREWARN_LEASE_NAME"] == RELEASE      # the fullname by default


def test_service_monitor_rules_and_network_policy_select_the_fleet_pods() -> None:
    docs = render(fleet(**OPERATOR))
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    service, monitor = one(docs, "Service"), one(docs, "ServiceMonitor")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "fleet"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "forewarn"   # the rules' job="forewarn"
    assert one(docs, "PrometheusRule")["metadata"]["labels"]["app.kubernetes.io/component"] == "fleet"
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    egress = {p["port"] for rule in policy["spec"]["egress"] for p in rule["ports"]}
    assert {53, 443, 6443} <= egress                # DNS, Azure, the Kubernetes API (the Lease)


def test_secrets_are_mounted_from_existing_secrets_by_name() -> None:
    docs = render(MATRIX["queue with a connection string, push route, every sink, web tls, operator"])
    volumes = {v["name"]: v for v in pod(docs)["volumes"]}
    assert volumes["queue"] == {"name": "queue", "secret": {"secretName": "forewarn-queue", "defaultMode": 0o440}}
    assert volumes["eventgrid"]["secret"]["secretName"] == "forewarn-eventgrid"
    env = env_of(docs)
    assert "FOREWARN_QUEUE_CONNECTION_STRING" not in env and "FOREWARN_EVENTGRID_SECRET" not in env
    assert env["FOREWARN_SINK"] == "stdout,file:/var/log/forewarn/records.jsonl,eventhubs,otlp"


@pytest.mark.parametrize(("values", "message"), [
    ({"mode": "central"}, "at '/mode': value must be one of 'agent', 'fleet'"),
    (fleet(fleet={"replicas": 0}), "at '/fleet/replicas': minimum"),
    (fleet(fleet={"subscriptions": ["not-a-guid"]}), "at '/fleet/subscriptions/0': 'not-a-guid' does not match"),
    (fleet(fleet={"queue": {"url": "http://acct.queue.core.windows.net/q"}}), "at '/fleet/queue/url'"),
    (fleet(fleet={"queue": {"connectionString": "DefaultEndpointsProtocol=https;AccountKey=s3cr3t"}}),
     "at '/fleet/queue': additional properties 'connectionString' not allowed"),
    (fleet(fleet={"reconcileInterval": "5m"}), "at '/fleet/reconcileInterval': got string, want integer"),
    (fleet(fleet={"replica": 3}), "at '/fleet': additional properties 'replica' not allowed"),
    # what one value cannot say alone: the templates stop with a message naming the values
    ({"mode": "fleet", "fleet": {"subscriptions": [SUBSCRIPTION]}}, "mode: fleet needs fleet.clientId"),
    (fleet(fleet={"resourceGroups": ["rg-a."]}), "at '/fleet/resourceGroups/0': 'rg-a.' does not match pattern"),
    (fleet(fleet={"resourceGroups": ["rg-a,rg-b"]}), "at '/fleet/resourceGroups/0': 'rg-a,rg-b' does not match"),
    (fleet(fleet={"resourceGroups": ["rg-a", "rg-a"]}), "at '/fleet/resourceGroups': items at 0 and 1 are equal"),
    (fleet(fleet={"resourceGroups": "rg-a"}), "at '/fleet/resourceGroups': got string, want array"),
    ({"mode": "fleet", "fleet": {"clientId": CLIENT_ID}}, "mode: fleet needs a source: fleet.subscriptions"),
    ({"mode": "fleet", "fleet": {"clientId": CLIENT_ID, "resourceGroups": ["rg-a"]}},
     "and/or fleet.eventgrid.path (Event Grid push); fleet.resourceGroups only narrows a source"),
    (fleet(fleet={"managementGroups": ["platform"]}),
     "fleet.subscriptions and fleet.managementGroups: give one scope or the other"),
    (fleet(fleet={"eventgrid": {"path": "/eventgrid"}}), "fleet.eventgrid.path needs fleet.eventgrid.sharedSecret"),
    (fleet(hostNetwork=True), "hostNetwork is for mode: agent"),
    (fleet(nodeActions={"enabled": True}), "nodeActions.enabled is for mode: agent"),
    (fleet(dryRun=True), "dryRun is for mode: agent"),
])
def test_a_bad_fleet_value_is_refused_with_a_clear_message(values: dict[str, Any], message: str) -> None:
    result = helm("template", RELEASE, str(CHART), values=values)
    assert result.returncode == 1
    assert message in result.stderr, result.stderr
    assert "s3cr3t" not in result.stderr


# -- mode: agent is unchanged ----------------------------------------------------------------------------------

AGENT_MATRIX = [{}, {"nodeActions": {"enabled": True}, "policy": {"content": "version: 1\nrules: []\n"}},
                {**OPERATOR, "hostNetwork": True, "fleet": {"replicas": 3, "clientId": CLIENT_ID}}]


@pytest.mark.parametrize("values", AGENT_MATRIX)
def test_agent_mode_renders_exactly_as_the_default(values: dict[str, Any]) -> None:
    # mode: agent is the default: saying it changes nothing, and the fleet values are ignored in agent mode
    without = {k: v for k, v in values.items() if k != "fleet"}
    assert render({**values, "mode": "agent"}) == render(without)
    docs = render(without)
    assert not {"Deployment", "Role", "RoleBinding", "PodDisruptionBudget"} & {d["kind"] for d in docs}
    assert one(docs, "DaemonSet")["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "agent"


# -- the kustomize overlay equals the chart ------------------------------------------------------------------

OVERLAY = "overlays/fleet"
OVERLAY_RELEASE, OVERLAY_NAMESPACE = "forewarn-fleet", "forewarn"


def overlay_inputs() -> dict[str, Any]:
    """The chart's values for what the overlay says: its client id, subscription and queue."""
    docs = build(OVERLAY)
    (main,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in main["env"]}
    values: dict[str, Any] = {"mode": "fleet", "fleet": {
        "clientId": one(docs, "ServiceAccount")["metadata"]["annotations"]["azure.workload.identity/client-id"],
        "subscriptions": env["FOREWARN_SUBSCRIPTION"].split(","), "queue": {"url": env["FOREWARN_QUEUE_URL"]}}}
    if "FOREWARN_RESOURCE_GROUP" in env:            # the commented example, once a user sets it
        values["fleet"]["resourceGroups"] = env["FOREWARN_RESOURCE_GROUP"].split(",")
    return values


def render_like_the_overlay(values: dict[str, Any]) -> list[dict[str, Any]]:
    result = helm("template", OVERLAY_RELEASE, str(CHART), "--namespace", OVERLAY_NAMESPACE, values=values)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def without_selectors(spec: dict[str, Any]) -> dict[str, Any]:
    spec = copy.deepcopy(spec)
    for key in ("selector", "podSelector"):
        spec.pop(key, None)
    return spec


def test_the_overlay_validates_and_equals_the_chart_in_fleet_mode() -> None:
    import kubernetes_validate

    kustomized = build(OVERLAY)
    for doc in kustomized:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    rendered = render_like_the_overlay(overlay_inputs())
    # the same objects, but the Namespace (Helm installs into the release namespace)
    assert sorted(d["kind"] for d in kustomized if d["kind"] != "Namespace") == sorted(d["kind"] for d in rendered)
    assert {d["metadata"]["name"] for d in kustomized if d["kind"] != "Namespace"} == \
        {d["metadata"]["name"] for d in rendered}
    deployment, ours = one(rendered, "Deployment"), one(kustomized, "Deployment")
    # everything the pod runs with: image, args, env, security, probes, volumes, resources, scheduling
    assert deployment["spec"]["template"]["spec"] == ours["spec"]["template"]["spec"]
    assert {**without_selectors(deployment["spec"]), "template": None} == \
        {**without_selectors(ours["spec"]), "template": None}
    assert deployment["spec"]["selector"] == ours["spec"]["selector"]
    assert ours["spec"]["template"]["metadata"]["labels"]["azure.workload.identity/use"] == "true"
    for kind in ("Service", "NetworkPolicy", "PodDisruptionBudget"):
        assert without_selectors(one(rendered, kind)["spec"]) == without_selectors(one(kustomized, kind)["spec"]), kind
        selects = one(kustomized, kind)["spec"].get("selector") or one(kustomized, kind)["spec"]["podSelector"]
        assert selects.get("matchLabels", selects).items() <= ours["spec"]["template"]["metadata"]["labels"].items()
    assert one(rendered, "Role")["rules"] == one(kustomized, "Role")["rules"]
    assert one(rendered, "RoleBinding")["roleRef"] == one(kustomized, "RoleBinding")["roleRef"]
    assert one(rendered, "RoleBinding")["subjects"] == one(kustomized, "RoleBinding")["subjects"]
    for field in ("annotations",):
        assert one(rendered, "ServiceAccount")["metadata"][field] == \
            one(kustomized, "ServiceAccount")["metadata"][field]
    assert one(rendered, "ServiceAccount")["automountServiceAccountToken"] is \
        one(kustomized, "ServiceAccount")["automountServiceAccountToken"] is False
    assert one(kustomized, "Namespace")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_the_overlay_comparison_can_fail() -> None:
    ours = one(build(OVERLAY), "Deployment")
    rendered = one(render_like_the_overlay({**overlay_inputs(), "logLevel": "debug"}), "Deployment")
    assert rendered["spec"]["template"]["spec"] != ours["spec"]["template"]["spec"]


# -- a scope below the subscription, and two scopes in one cluster ----------------------------------------------

RESOURCE_GROUPS = ["rg-a", "MC_rg-a_aks-a_westeurope"]


def resolved(docs: list[dict[str, Any]], namespace: str = NAMESPACE) -> Any:
    """The settings `forewarn fleet` resolves from a rendered pod's environment (the downward API's namespace
    filled in)."""
    from forewarn.cli import build_parser
    from forewarn.config import resolve_fleet

    environ = {k: v for k, v in env_of(docs).items() if isinstance(v, str)}
    environ["FOREWARN_LEASE_NAMESPACE"] = namespace
    return resolve_fleet(build_parser().parse_args(["fleet"]), environ=environ)


def test_resource_groups_become_forewarn_resource_group_and_the_scope() -> None:
    from forewarn.fleet.service import fleet_scope

    assert "FOREWARN_RESOURCE_GROUP" not in env_of(render(FLEET))          # the whole subscription by default
    docs = render(fleet(fleet={"resourceGroups": RESOURCE_GROUPS}))
    assert env_of(docs)["FOREWARN_RESOURCE_GROUP"] == "rg-a,MC_rg-a_aks-a_westeurope"
    settings = resolved(docs)
    assert settings.resource_group == RESOURCE_GROUPS and settings.subscription == [SUBSCRIPTION]
    assert fleet_scope(settings).resource_groups == ("mc_rg-a_aks-a_westeurope", "rg-a")


def test_the_schema_takes_the_resource_group_names_forewarn_takes() -> None:
    """values.schema.json's pattern against forewarn's own check, on one render: every refused name is reported
    by its index. The chart is stricter in one way only: a comma (forewarn's list separator) and outer blanks."""
    from forewarn.cli import build_parser
    from forewarn.config import ConfigError, resolve_fleet

    names = ["rg", "a" * 90, "a" * 91, "rg.", ".rg", "r.g", "rg-\u00e4", "\u0440\u0433", "rg(1)", "rg_1", "bad/rg",
             "rg name", "", "rg\u0663", "\u216b", "e\u0301", "rg\u00bd", "rg;drop", "rg\"", "a,b", " rg"]
    result = helm("template", RELEASE, str(CHART), values=fleet(fleet={"resourceGroups": names}))
    refused = {int(i) for i in re.findall(r"at '/fleet/resourceGroups/(\d+)'", result.stderr)}
    assert refused and result.returncode == 1, result.stderr

    for index, name in enumerate(names):
        try:
            taken = resolve_fleet(build_parser().parse_args(["fleet"]), environ={
                "FOREWARN_RESOURCE_GROUP": name, "FOREWARN_QUEUE_URL": QUEUE_URL}).resource_group == [name]
        except ConfigError:
            taken = False
        if "," in name or name != name.strip():
            assert index in refused, name
        else:
            assert (index not in refused) == taken, (name, taken)


def test_two_releases_in_one_namespace_get_two_leases_and_two_owners() -> None:
    """Two scopes in one cluster: each release's Lease is its own by default (else one instance stands by for
    ever), its Role may touch that Lease only, and the owners their node actions' ledger entries name differ."""
    from forewarn.fleet.service import fleet_scope

    leases, owners = {}, set()
    for release, groups in (("fleet-a", ["rg-a"]), ("fleet-b", ["rg-b"]), ("forewarn-c", ["rg-c"])):
        docs = render(fleet(fleet={"resourceGroups": groups}), release=release)
        lease = env_of(docs)["FOREWARN_LEASE_NAME"]
        assert [r["resourceNames"] for r in one(docs, "Role")["rules"] if "resourceNames" in r] == [[lease]]
        leases[release] = lease
        settings = resolved(docs)
        owners.add(str(fleet_scope(settings).owner(f"{settings.lease_namespace}/{settings.lease_name}")))
    assert leases == {"fleet-a": "fleet-a-forewarn", "fleet-b": "fleet-b-forewarn", "forewarn-c": "forewarn-c"}
    assert len(owners) == 3
    # the same scope under another Lease is another owner too: the Lease is part of the owner
    assert fleet_scope(settings).owner("monitoring/x") != fleet_scope(settings).owner("monitoring/y")


# -- the kustomize overlay for a second scope ------------------------------------------------------------------

SECOND = "overlays/fleet-second-scope"


def test_the_second_scope_overlay_validates_and_shares_nothing_with_the_first() -> None:
    import kubernetes_validate

    first, second = build(OVERLAY), build(SECOND)
    for doc in second:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    # everything but the namespace, which ../fleet makes, under names of its own
    assert sorted(d["kind"] for d in second) == sorted(d["kind"] for d in first if d["kind"] != "Namespace")
    names = {(d["kind"], d["metadata"]["name"]) for d in first}
    assert not names & {(d["kind"], d["metadata"]["name"]) for d in second}
    env_a, env_b = (env_of(docs) for docs in (first, second))
    assert env_a["FOREWARN_LEASE_NAME"] != env_b["FOREWARN_LEASE_NAME"]
    assert env_a["FOREWARN_QUEUE_URL"] != env_b["FOREWARN_QUEUE_URL"]
    assert "FOREWARN_RESOURCE_GROUP" not in env_a and env_b["FOREWARN_RESOURCE_GROUP"]
    for docs in (first, second):
        leases = [r["resourceNames"] for r in one(docs, "Role")["rules"] if "resourceNames" in r]
        assert leases == [[env_of(docs)["FOREWARN_LEASE_NAME"]]]
        binding, account = one(docs, "RoleBinding"), one(docs, "ServiceAccount")["metadata"]
        assert binding["roleRef"]["name"] == one(docs, "Role")["metadata"]["name"]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["name"],
                                        "namespace": account["namespace"]}]
        assert pod(docs)["serviceAccountName"] == account["name"]
    # no selector of one instance selects the other's pods, the spread constraints included
    for docs, other in ((first, second), (second, first)):
        pods = one(other, "Deployment")["spec"]["template"]["metadata"]["labels"]
        selectors = [one(docs, "Deployment")["spec"]["selector"]["matchLabels"]]
        selectors += [c["labelSelector"]["matchLabels"] for c in pod(docs)["topologySpreadConstraints"]]
        for kind in ("Service", "PodDisruptionBudget", "NetworkPolicy"):
            spec = one(docs, kind)["spec"]
            selectors.append(spec.get("selector", {}).get("matchLabels", spec.get("selector"))
                             if kind != "NetworkPolicy" else spec["podSelector"]["matchLabels"])
        for selector in selectors:
            assert not selector.items() <= pods.items(), selector
    settings = resolved(second, "forewarn")
    assert settings.resource_group == env_b["FOREWARN_RESOURCE_GROUP"].split(",")
    assert settings.subscription == env_a["FOREWARN_SUBSCRIPTION"].split(",")      # the same subscription


def test_the_second_scope_overlay_is_the_charts_second_release() -> None:
    """The pod of ../fleet-second-scope is the chart's for a release named like its suffix (the environment
    compared by name: kustomize puts the patched variables first)."""
    second = build(SECOND)
    env = env_of(second)
    values = overlay_inputs()
    values["fleet"].update(resourceGroups=env["FOREWARN_RESOURCE_GROUP"].split(","),
                           queue={"url": env["FOREWARN_QUEUE_URL"]})
    result = helm("template", "forewarn-fleet-b", str(CHART), "--namespace", OVERLAY_NAMESPACE, values=values)
    assert result.returncode == 0, result.stderr
    rendered = [doc for doc in yaml.safe_load_all(result.stdout) if doc]

    def by_name(spec: dict[str, Any]) -> dict[str, Any]:
        spec = copy.deepcopy(spec)
        spec["containers"][0]["env"] = sorted(spec["containers"][0]["env"], key=lambda e: str(e["name"]))
        return spec
    assert by_name(pod(rendered)) == by_name(pod(second))
    assert one(rendered, "Role")["rules"] == one(second, "Role")["rules"]
    assert one(rendered, "Deployment")["spec"]["selector"] == one(second, "Deployment")["spec"]["selector"]


# -- the Azure side: the ARM template and the az script --------------------------------------------------------

ROLE_IDS = {"reader": "acdd72a7-3385-48ef-bd42-f606fba81ae7",
            "queueMessageProcessor": "8a0f0c08-91a1-4084-bc3d-661d67233fed",
            "queueMessageSender": "c6a89b2d-59bc-44d0-9896-0f6e12d7b80a",
            "scheduledEventsContributor": "b67fe603-310e-4889-b9ee-8257d09d353d"}


def arm() -> dict[str, Any]:
    return dict(json.loads((AZURE / "fleet.json").read_text()))


def expressions(node: Any) -> list[str]:
    """Every ARM expression ("[...]") in a template, depth first."""
    if isinstance(node, dict):
        return [e for value in node.values() for e in expressions(value)]
    if isinstance(node, list):
        return [e for value in node for e in expressions(value)]
    return [node] if isinstance(node, str) and node.startswith("[") and node.endswith("]") else []


def check_parameters(template: dict[str, Any]) -> None:
    """Every parameter is used and every parameters('x') is declared; likewise variables. A nested template
    (scope inner) has parameters of its own, checked on their own."""
    resources = copy.deepcopy(template["resources"])
    for resource in resources:
        resource.get("properties", {}).pop("template", None)
    text = json.dumps([expressions(r) for r in (resources, template.get("outputs", {}),
                                                template.get("variables", {}))])
    used = set(re.findall(r"parameters\('([A-Za-z]+)'\)", text))
    assert used == set(template["parameters"]), (used, set(template["parameters"]))
    assert set(re.findall(r"variables\('([A-Za-z]+)'\)", text)) <= set(template.get("variables", {}))


def test_the_arm_template_is_a_subscription_deployment_with_the_documented_parameters() -> None:
    template = arm()
    assert template["$schema"].endswith("/subscriptionDeploymentTemplate.json#")
    assert {"storageAccountName", "queueName", "principalId"} <= set(template["parameters"])
    check_parameters(template)
    (nested,) = [r for r in template["resources"] if r["type"] == "Microsoft.Resources/deployments"]
    inner = nested["properties"]["template"]
    assert nested["properties"]["expressionEvaluationOptions"] == {"scope": "inner"}
    check_parameters(inner)
    assert set(nested["properties"]["parameters"]) == set(inner["parameters"])
    assert nested["resourceGroup"] == "[parameters('resourceGroupName')]"
    (group,) = [r for r in template["resources"] if r["type"] == "Microsoft.Resources/resourceGroups"]
    assert nested["dependsOn"] == ["[subscriptionResourceId('Microsoft.Resources/resourceGroups', "
                                   "parameters('resourceGroupName'))]"]
    assert group["name"][1:-1] in nested["dependsOn"][0]      # the group this template makes
    for resource in template["resources"] + inner["resources"]:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", resource["apiVersion"]), resource["type"]   # no previews


def inner_resources() -> list[dict[str, Any]]:
    (nested,) = [r for r in arm()["resources"] if r["type"] == "Microsoft.Resources/deployments"]
    return list(nested["properties"]["template"]["resources"])


def test_the_system_topic_delivers_every_event_to_the_queue() -> None:
    resources = inner_resources()
    (topic,) = [r for r in resources if r["type"] == "Microsoft.EventGrid/systemTopics"]
    assert topic["location"] == "global"
    assert topic["properties"] == {"source": "[subscription().id]",
                                   "topicType": "Microsoft.ResourceNotifications.MaintenanceResources"}
    (subscription,) = [r for r in resources if r["type"] == "Microsoft.EventGrid/systemTopics/eventSubscriptions"]
    topic_id = "[resourceId('Microsoft.EventGrid/systemTopics', parameters('systemTopicName'))]"
    assert topic_id in subscription["dependsOn"]
    queues = [r for r in resources if r["type"] == "Microsoft.Storage/storageAccounts/queueServices/queues"]
    assert len(queues) == 2
    queue_id = ("[resourceId('Microsoft.Storage/storageAccounts/queueServices/queues', "
                "parameters('storageAccountName'), 'default', parameters('queueName'))]")
    assert queue_id in subscription["dependsOn"]
    properties = subscription["properties"]
    assert properties["eventDeliverySchema"] == "EventGridSchema"
    assert properties["destination"]["endpointType"] == "StorageQueue"
    assert properties["destination"]["properties"]["queueName"] == "[parameters('queueName')]"
    assert properties["destination"]["properties"]["resourceId"] == \
        "[resourceId('Microsoft.Storage/storageAccounts', parameters('storageAccountName'))]"
    # no event type filter: the documented type strings disagree
    assert properties["filter"] == {} and "includedEventTypes" not in json.dumps(arm())
    # the wiring: every dependsOn names a resource of the same template
    names = {r["type"]: r for r in resources}
    for resource in resources:
        for dependency in resource.get("dependsOn", []):
            kind = re.match(r"\[resourceId\('([^']+)'", dependency)
            assert kind and kind.group(1) in names, dependency


def test_the_identity_gets_the_least_roles_each_on_its_scope() -> None:
    template = arm()
    assignments = [r for r in template["resources"] + inner_resources()
                   if r["type"] == "Microsoft.Authorization/roleAssignments"]
    variables = {**template["variables"]["roles"],
                 **next(r for r in template["resources"] if r["type"] == "Microsoft.Resources/deployments")
                 ["properties"]["template"]["variables"]["roles"]}
    assert variables == ROLE_IDS

    def role(assignment: dict[str, Any]) -> str:
        found = re.search(r"variables\('roles'\)\.(\w+)", assignment["properties"]["roleDefinitionId"])
        assert found
        return found.group(1)
    by_role = {role(a): a for a in assignments}
    assert set(by_role) == set(ROLE_IDS)
    for assignment in assignments:
        assert assignment["properties"]["principalId"] == "[parameters('principalId')]"
        assert assignment["properties"]["principalType"] == "ServicePrincipal"
        assert assignment["name"].startswith("[guid(")       # idempotent: the same name on every deployment
    # the queue roles on the queues alone; Reader (Resource Graph) on the subscription; acknowledging only on request
    assert by_role["queueMessageProcessor"]["scope"].endswith("parameters('queueName'))]")
    assert by_role["queueMessageSender"]["scope"].endswith("variables('poisonQueueName'))]")
    assert "scope" not in by_role["reader"] and "scope" not in by_role["scheduledEventsContributor"]
    assert by_role["scheduledEventsContributor"]["condition"] == "[parameters('assignScheduledEventsContributor')]"
    assert template["parameters"]["assignScheduledEventsContributor"]["defaultValue"] is False
    # the README cites every id the template uses
    readme = (AZURE / "README.md").read_text()
    assert all(role_id in readme for role_id in ROLE_IDS.values())


def test_the_az_script_parses_does_the_same_and_prints_no_secret() -> None:
    script = AZURE / "fleet-setup.sh"
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    text = script.read_text()
    assert "set -euo pipefail" in text
    assert all(role_id in text for role_id in ROLE_IDS.values())
    assert "--topic-type microsoft.resourcenotifications.maintenanceresources" in text
    assert "--endpoint-type storagequeue" in text and "--included-event-types" not in text
    # no keys or connection strings are fetched or shown
    assert not re.search(r"keys list|connection-string|show-connection-string|set -x", text)
    # the check above can fail: bash -n sees a broken script as broken
    broken = subprocess.run(["bash", "-n"], input=text.replace("done\n", "", 1), capture_output=True, text=True,
                            timeout=60)
    assert broken.returncode != 0
