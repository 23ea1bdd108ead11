// Validates Prometheus Operator objects (ServiceMonitor, PodMonitor, PrometheusRule) against the JSON
// schemas generated from the operator's CRDs (@kubernetes-models/prometheus-operator).
// Reads a multi-document YAML stream on stdin (e.g. `kubectl kustomize` output); prints one line per
// monitoring object ("ok KIND NAME" or "invalid KIND NAME: reasons") and exits 1 if any is invalid.
import { readFileSync } from "node:fs";
import yaml from "js-yaml";
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";
import { PodMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor";
import { PrometheusRule } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule";

const models = { ServiceMonitor, PodMonitor, PrometheusRule };
let failed = false;
for (const doc of yaml.loadAll(readFileSync(0, "utf8"))) {
  if (!doc || doc.apiVersion !== "monitoring.coreos.com/v1") continue;
  const Model = models[doc.kind];
  const name = `${doc.kind} ${doc.metadata?.name ?? "?"}`;
  if (!Model) {
    console.log(`invalid ${name}: no schema for this kind`);
    failed = true;
    continue;
  }
  try {
    new Model(doc).validate();
    console.log(`ok ${name}`);
  } catch (error) {
    const details = (error.errors ?? []).map((e) => `${e.instancePath || "/"} ${e.message}`).join("; ");
    console.log(`invalid ${name}: ${details || error.message}`);
    failed = true;
  }
}
process.exit(failed ? 1 : 0);
