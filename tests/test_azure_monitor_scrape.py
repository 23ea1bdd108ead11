"""Scraped by Azure Monitor managed service for Prometheus (the AKS metrics add-on): the azmonitoring.coreos.com/v1
PodMonitor (agent) and ServiceMonitor (fleet) of the kustomize components and of the Helm chart, validated against
the CRDs the add-on installs (tests/crd/azure-monitor, with their source commit) and carrying the label limits of
Microsoft's templates; and every series of a live /metrics of both modes within those limits, with a long free-text
description as Azure may send."""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
from pathlib import Path
from typing import Any

import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from fleet_samples import event_grid_event, properties, target_id
from test_helm import CHART, NAMESPACE, RELEASE, helm, one, render
from test_kubernetes import K8S_VERSION, build, compose

from conftest import free_port, parse_metrics, series, wait_until

ROOT = Path(__file__).parent.parent
FIXTURES = Path(__file__).parent / "crd" / "azure-monitor"
GROUP_VERSION = "azmonitoring.coreos.com/v1"
CRDS = {"PodMonitor": "ama-metrics-podmonitor-crd.yaml", "ServiceMonitor": "ama-metrics-servicemonitor-crd.yaml"}
TEMPLATES = {"PodMonitor": "pod-monitor-template.yaml", "ServiceMonitor": "service-monitor-template.yaml"}
LIMITS = ("labelLimit", "labelNameLengthLimit", "labelValueLengthLimit")
CLIENT_ID = SUBSCRIPTION = "00000000-0000-0000-0000-00000000a2e1"
FLEET = {"mode": "fleet", "fleet": {"clientId": CLIENT_ID, "subscriptions": [SUBSCRIPTION]}}


# -- the CRDs as the API server applies them ---------------------------------------------------------------------

def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """A CRD's structural schema as a JSON schema that refuses unknown fields: the API server prunes them (and
    `kubectl apply --validate=strict` refuses them), so a misspelt limit would be lost without a word."""
    schema = copy.deepcopy(schema)

    def walk(node: dict[str, Any]) -> None:
        if node.pop("x-kubernetes-int-or-string", False):
            node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        if "properties" in node and "additionalProperties" not in node \
                and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        for child in node.get("properties", {}).values():
            walk(child)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                walk(node[key])
        for key in ("allOf", "anyOf", "oneOf"):
            for child in node.get(key, []):
                walk(child)
    walk(schema)
    return schema


@functools.cache
def crd(kind: str) -> dict[str, Any]:
    return dict(yaml.safe_load((FIXTURES / CRDS[kind]).read_text()))


@functools.cache
def validator(kind: str) -> Any:
    import jsonschema

    (version,) = [v for v in crd(kind)["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft7Validator(strict(version["schema"]["openAPIV3Schema"]))


def crd_errors(doc: dict[str, Any]) -> list[str]:
    """What the API server would refuse in `doc`, one line per problem ("/spec/... message")."""
    kind = doc.get("kind", "")
    if doc.get("apiVersion") != GROUP_VERSION or kind not in CRDS:
        return [f"/ {doc.get('apiVersion')} {kind} is not a kind the add-on's CRDs define ({GROUP_VERSION} "
                f"{' or '.join(CRDS)})"]
    errors = ["/" + "/".join(str(p) for p in error.absolute_path) + " " + error.message
              for error in validator(kind).iter_errors(doc)]
    if not doc.get("metadata", {}).get("namespace"):
        errors.append("/metadata/namespace missing: the CRDs are namespaced")
    return sorted(errors)


def azure_objects(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["apiVersion"].startswith("azmonitoring.coreos.com/")]


def template_limits(kind: str) -> dict[str, int]:
    spec = yaml.safe_load((FIXTURES / TEMPLATES[kind]).read_text())["spec"]
    return {name: spec[name] for name in LIMITS}


def test_the_fixtures_are_the_add_ons_crds_and_microsofts_templates() -> None:
    for kind in CRDS:
        definition = crd(kind)
        assert definition["kind"] == "CustomResourceDefinition"
        assert definition["spec"]["group"] == "azmonitoring.coreos.com" and definition["spec"]["names"]["kind"] == kind
        assert definition["spec"]["scope"] == "Namespaced"
        assert [(v["name"], v["served"], v["storage"]) for v in definition["spec"]["versions"]] == [("v1", True, True)]
        template = yaml.safe_load((FIXTURES / TEMPLATES[kind]).read_text())
        assert (template["apiVersion"], template["kind"]) == (GROUP_VERSION, kind)
        assert all(isinstance(value, int) and value > 0 for value in template_limits(kind).values())
    assert "39583fd50b2f828f83cc18fc0cece9e3074f56db" in (FIXTURES / "README.md").read_text()


def test_the_crd_check_refuses_what_the_api_server_would() -> None:
    (monitor,) = azure_objects(build_with("base", "azure-monitor"))
    assert crd_errors(monitor) == []
    wrong = copy.deepcopy(monitor)
    wrong["spec"]["podMetricsEndpoints"][0]["port"] = 9465           # a port name is a string
    wrong["spec"]["labelLimits"] = 63                                # misspelt: pruned by the API server
    wrong["spec"]["labelValueLengthLimit"] = "1023"
    assert crd_errors(wrong) == ["/spec Additional properties are not allowed ('labelLimits' was unexpected)",
                                 "/spec/labelValueLengthLimit '1023' is not of type 'integer'",
                                 "/spec/podMetricsEndpoints/0/port 9465 is not of type 'string'"]
    operator = {**monitor, "apiVersion": "monitoring.coreos.com/v1"}
    assert crd_errors(operator)[0].startswith("/ monitoring.coreos.com/v1 PodMonitor is not a kind the add-on's")


# -- the kustomize components ------------------------------------------------------------------------------------

@functools.cache
def _built(target: str, component: str) -> tuple[dict[str, Any], ...]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return tuple(build(compose(Path(tmp), target, [f"components/{component}"])))


def build_with(target: str, component: str) -> list[dict[str, Any]]:
    """`target` with one component, built once per test session (a copy each call)."""
    return copy.deepcopy(list(_built(target, component)))


def kustomized(target: str, component: str) -> list[dict[str, Any]]:
    import kubernetes_validate

    docs = build_with(target, component)
    (monitor,) = azure_objects(docs)
    assert crd_errors(monitor) == []
    for doc in docs:
        if doc is not monitor:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    return docs


def test_the_agent_component_is_a_pod_monitor_of_the_daemonsets_pods_with_microsofts_limits() -> None:
    docs = kustomized("base", "azure-monitor")
    monitor, daemonset = one(docs, "PodMonitor"), one(docs, "DaemonSet")
    assert {name: monitor["spec"][name] for name in LIMITS} == template_limits("PodMonitor")
    pod = daemonset["spec"]["template"]
    assert monitor["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports
    assert pod["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "forewarn"      # the rules' job="forewarn"
    # the Prometheus Operator's objects are not in it: the add-on ignores them and the base needs no CRD
    assert not [d for d in docs if d["apiVersion"].startswith("monitoring.coreos.com/")]


def test_the_fleet_component_is_a_service_monitor_of_the_fleets_service_with_microsofts_limits() -> None:
    docs = kustomized("overlays/fleet", "fleet-azure-monitor")
    monitor, service = one(docs, "ServiceMonitor"), one(docs, "Service")
    assert {name: monitor["spec"][name] for name in LIMITS} == template_limits("ServiceMonitor")
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "forewarn"
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


# -- the Helm chart ------------------------------------------------------------------------------------------------

def rendered(values: dict[str, Any], release: str = RELEASE, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    import kubernetes_validate

    lint = helm("lint", "--strict", str(CHART), values=values)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    result = helm("template", release, str(CHART), "--namespace", namespace, values=values)
    assert result.returncode == 0, result.stderr
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    for doc in docs:
        if doc in azure_objects(docs):
            assert crd_errors(doc) == [], doc["kind"]
        elif not doc["apiVersion"].startswith("monitoring.coreos.com/"):      # those: tests/test_helm.py
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    return docs


def without_selector(spec: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in spec.items() if key != "selector"}


def test_the_chart_renders_the_components_objects_in_each_mode() -> None:
    agent = rendered({"azureMonitor": {"enabled": True, "labels": {"team": "sre"}}})
    (monitor,) = azure_objects(agent)
    assert monitor["kind"] == "PodMonitor" and monitor["metadata"]["labels"]["team"] == "sre"
    assert without_selector(monitor["spec"]) == without_selector(one(build_with("base", "azure-monitor"),
                                                                     "PodMonitor")["spec"])
    assert monitor["spec"]["selector"]["matchLabels"] == one(agent, "DaemonSet")["spec"]["selector"]["matchLabels"]

    # rendered as the fleet overlay is (its release and namespace): the same object, name included
    overlay = build_with("overlays/fleet", "fleet-azure-monitor")
    fleet = rendered({**FLEET, "azureMonitor": {"enabled": True}}, release="forewarn-fleet", namespace="forewarn")
    (monitor,) = azure_objects(fleet)
    ours = one(overlay, "ServiceMonitor")
    assert (monitor["kind"], monitor["metadata"]["name"]) == ("ServiceMonitor", ours["metadata"]["name"])
    assert without_selector(monitor["spec"]) == without_selector(ours["spec"])
    assert monitor["spec"]["selector"]["matchLabels"].items() <= one(fleet, "Service")["metadata"]["labels"].items()
    assert one(fleet, "Service")["spec"]["selector"]["app.kubernetes.io/component"] == "fleet"

    timed = rendered({"azureMonitor": {"enabled": True, "interval": "1m", "scrapeTimeout": "20s"}})
    (endpoint,) = azure_objects(timed)[0]["spec"]["podMetricsEndpoints"]
    assert (endpoint["interval"], endpoint["scrapeTimeout"]) == ("1m", "20s")

    # basic auth from a Secret in the object's namespace, as the Prometheus Operator's ServiceMonitor has it
    basic = {"enabled": True, "configSecret": {"name": "forewarn-web-config", "key": "web.yml"},
             "scrapeSecretName": "forewarn-scrape"}
    both = rendered({"azureMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True},
                     "web": {"basicAuth": basic}})
    (endpoint,) = azure_objects(both)[0]["spec"]["podMetricsEndpoints"]
    assert endpoint["basicAuth"] == one(both, "ServiceMonitor")["spec"]["endpoints"][0]["basicAuth"] == {
        "username": {"name": "forewarn-scrape", "key": "username"},
        "password": {"name": "forewarn-scrape", "key": "password"}}


def secrets_reader(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in ("Role", "RoleBinding") and "ama-metrics" in d["metadata"]["name"]]


def test_with_basic_auth_the_chart_lets_the_add_on_read_secrets_in_its_namespace() -> None:
    # Kubernetes 1.37 and later: the add-on's ClusterRole no longer reads Secrets cluster-wide, so the Secret that
    # basicAuth names is readable only through a Role in its namespace bound to the add-on's service account.
    basic = {"enabled": True, "configSecret": {"name": "forewarn-web-config", "key": "web.yml"},
             "scrapeSecretName": "forewarn-scrape"}
    for values, namespace in (({"azureMonitor": {"enabled": True}}, NAMESPACE),
                              ({**FLEET, "azureMonitor": {"enabled": True}}, "forewarn")):
        docs = rendered({**values, "web": {"basicAuth": basic}}, namespace=namespace)
        role, binding = one(secrets_reader(docs), "Role"), one(secrets_reader(docs), "RoleBinding")
        assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == namespace
        assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list", "watch"]}]
        account = yaml.safe_load((FIXTURES / "ama-metrics-serviceAccount.yaml").read_text())
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                        "namespace": account["metadata"]["namespace"]}]
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": role["metadata"]["name"]}
        (monitor,) = azure_objects(docs)
        endpoints = monitor["spec"].get("podMetricsEndpoints") or monitor["spec"]["endpoints"]
        assert endpoints[0]["basicAuth"]["password"]["name"] == "forewarn-scrape"
        assert monitor["metadata"]["namespace"] == namespace

    # the ConfigMap setting the chart cannot write is named in the release notes
    notes = helm("install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
                 values={"azureMonitor": {"enabled": True}, "web": {"basicAuth": basic}})
    assert notes.returncode == 0, notes.stderr
    assert (f"the add-on reads forewarn-scrape only once {NAMESPACE} is in secrets_access_namespaces of the "
            "ConfigMap kube-system/ama-metrics-settings-configmap") in notes.stdout.split("NOTES:", 1)[1]

    # none without basic auth, without the add-on's objects, or when turned off
    assert not secrets_reader(rendered({"azureMonitor": {"enabled": True}}))
    assert not secrets_reader(rendered({"serviceMonitor": {"enabled": True}, "web": {"basicAuth": basic}}))
    assert not secrets_reader(rendered({"azureMonitor": {"enabled": True, "basicAuthRbac": False},
                                        "web": {"basicAuth": basic}}))


def test_the_chart_renders_none_by_default_and_refuses_what_the_add_on_could_not_scrape() -> None:
    assert not azure_objects(render()) and not azure_objects(render({"serviceMonitor": {"enabled": True}}))
    tls = {"enabled": True, "secretName": "forewarn-web-tls"}
    result = helm("template", RELEASE, str(CHART), values={"azureMonitor": {"enabled": True}, "web": {"tls": tls}})
    assert result.returncode == 1
    assert "azureMonitor.enabled scrapes over plain HTTP: the add-on reads TLS certificates only from the " \
        "Secret kube-system/ama-metrics-mtls-secret" in result.stderr
    typo = helm("template", RELEASE, str(CHART), values={"azureMonitor": {"enabled": True, "labelLimit": 100}})
    assert typo.returncode == 1 and "additional properties 'labelLimit' not allowed" in typo.stderr


# -- forewarn's series within the limits ---------------------------------------------------------------------------

#: The labels a scrape through a PodMonitor or ServiceMonitor adds to each series (the operator's relabelling:
#: job, instance, namespace, pod, container, endpoint, and service for a ServiceMonitor; node from our
#: relabelling) and the add-on's cluster label. A series label of the same name becomes exported_<name>: one
#: more label, and a longer name.
TARGET_LABELS = ("job", "instance", "namespace", "pod", "container", "endpoint", "service", "node", "cluster")
#: Free text as Azure may send it in Description: longer than any label value forewarn keeps, and not ASCII
#: (a label value's length limit counts UTF-8 bytes, as Prometheus does).
DESCRIPTION = "Host OS update: the VM reboots once — Wartung über Nacht. " + "主機維護更新後虛擬機器將重新開機。" * 60


def breaches(exposition: str, limits: dict[str, int]) -> list[str]:
    """Every series of `exposition` that a scrape with `limits` would drop, with why."""
    found = []
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            names = [*sample.labels, *TARGET_LABELS]
            count = 1 + len(names)                                          # __name__ counts too
            if count > limits["labelLimit"]:
                found.append(f"{sample.name}: {count} labels")
            for name in sample.labels:
                longest = len(("exported_" if name in TARGET_LABELS else "") + name)
                if longest > limits["labelNameLengthLimit"]:
                    found.append(f"{sample.name}: label name {name} is {longest} bytes")
            for name, value in sample.labels.items():
                if len(value.encode()) > limits["labelValueLengthLimit"]:
                    found.append(f"{sample.name}: {name} is {len(value.encode())} bytes")
    return found


def test_the_limit_check_finds_each_kind_of_breach() -> None:
    limits = template_limits("PodMonitor")
    wide = ",".join(f'l{i}="x"' for i in range(limits["labelLimit"]))
    text = (f"# TYPE many gauge\nmany{{{wide}}} 1\n"
            f"# TYPE long_name gauge\nlong_name{{{'n' * (limits['labelNameLengthLimit'] + 1)}=\"x\"}} 1\n"
            f"# TYPE long_value gauge\nlong_value{{d=\"{'é' * (limits['labelValueLengthLimit'] // 2 + 1)}\"}} 1\n"
            f"# TYPE fine gauge\nfine{{d=\"{'é' * (limits['labelValueLengthLimit'] // 2)}\"}} 1\n")
    assert [line.split(":")[0] for line in breaches(text, limits)] == ["many", "long_name", "long_value"]


def test_every_series_of_a_live_agent_stays_within_the_limits(simulator: Any, collector: Any) -> None:
    sim = simulator({"vm_name": "vm-" + "a" * 60, "events": [
        {"id": "EV-LONG", "type": "Reboot", "notice": 900, "description": DESCRIPTION},
        {"id": "EV-USER", "type": "Redeploy", "source": "User", "notice": 600, "description": DESCRIPTION[::-1]}]})
    proc = collector(sim.url, "--policy", str(ROOT / "examples" / "policies" / "docs-sample.yaml"))
    wait_until(lambda: "EV-USER" in proc.metrics_text(), timeout=20, message="both events in /metrics")
    text = proc.metrics_text()
    assert breaches(text, template_limits("PodMonitor")) == []
    descriptions = {row["description"] for row in series(parse_metrics(text), "azure_scheduled_event_info")}
    assert {d[:15] for d in descriptions} == {DESCRIPTION[:15], DESCRIPTION[::-1][:15]}   # there, and cut
    assert all(d.endswith("...") and 1000 < len(d.encode()) <= 1023 for d in descriptions)


def test_every_series_of_a_live_fleet_stays_within_the_limits(tmp_path: Path) -> None:
    secret, port = "0123456789abcdef0123456789abcdef", free_port()
    fleet = subprocess.Popen([sys.executable, "-m", "forewarn", "fleet", "--eventgrid-path", "/eventgrid",
                              "--listen-address", f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "state")],
                             env={"FOREWARN_EVENTGRID_SECRET": secret, "PATH": "/usr/bin:/bin"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _answers(url + "/metrics"), timeout=30, message="forewarn fleet")
        # a scale set's event on VMs with the longest names Azure allows in the longest resource group
        group, scale_set = "rg-" + "g" * 87, "s" * 64
        pushed = [event_grid_event(properties(event_id="E-long", resources=("pool_0", "pool_1"),
                                              Description=DESCRIPTION),
                                   target_id("vmss", scale_set, rg=group), "d-1")]
        answer = requests.post(url + "/eventgrid", params={"code": secret}, json=pushed, timeout=10)
        assert answer.status_code == 200, answer.text
        wait_until(lambda: "E-long" in requests.get(url + "/metrics", timeout=5).text, timeout=20,
                   message="the event in /metrics")
        text = requests.get(url + "/metrics", timeout=5).text
    finally:
        fleet.terminate()
        fleet.wait(20)
    assert group in text and "Wartung" in text
    assert breaches(text, template_limits("ServiceMonitor")) == []


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=1).status_code == 200
    except requests.RequestException:
        return False
