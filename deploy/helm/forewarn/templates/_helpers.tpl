{{/*
The name of every object: the release name when it already says forewarn, else <release>-forewarn.
The app.kubernetes.io/name label is always "forewarn": the ServiceMonitor's jobLabel turns it into
job="forewarn", which the alert rules select on.
*/}}
{{- define "forewarn.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "forewarn.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: {{ include "forewarn.component" . }}
{{- end -}}

{{/*
"agent" (mode: agent, the per-VM DaemonSet) or "fleet" (mode: fleet, the central Deployment): the component
label, so the Service, ServiceMonitor and NetworkPolicy select the pods of the mode in use.
*/}}
{{- define "forewarn.component" -}}
{{- if eq .Values.mode "fleet" }}fleet{{ else }}agent{{ end -}}
{{- end -}}

{{- define "forewarn.labels" -}}
{{ include "forewarn.selectorLabels" . }}
app.kubernetes.io/part-of: forewarn
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "forewarn.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "forewarn.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "forewarn.priorityClassName" -}}
{{- if .Values.priorityClass.create -}}
{{- default (printf "%s-node-agent" (include "forewarn.fullname" .)) .Values.priorityClass.name -}}
{{- else -}}
{{- .Values.priorityClass.name -}}
{{- end -}}
{{- end -}}

{{- define "forewarn.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "forewarn.policyText" -}}
{{- default (.Files.Get "files/policy.yaml") .Values.policy.content -}}
{{- end -}}

{{/*
The sinks as FOREWARN_SINK takes them, comma-separated; checks what the schema cannot (one field
depending on another) and stops with a message naming the value.
*/}}
{{- define "forewarn.sinks" -}}
{{- $sinks := list -}}
{{- with .Values.sinks -}}
{{- if .stdout.enabled }}{{ $sinks = append $sinks "stdout" }}{{ end -}}
{{- if .file.enabled }}{{ $sinks = append $sinks (printf "file:%s" .file.path) }}{{ end -}}
{{- if .eventhubs.enabled -}}
{{- $secret := .eventhubs.connectionStringSecret.name -}}
{{- $aad := and .eventhubs.namespace .eventhubs.name -}}
{{- if and (not $secret) (not $aad) -}}
{{- fail "sinks.eventhubs.enabled needs sinks.eventhubs.connectionStringSecret.name (an existing Secret) or both sinks.eventhubs.namespace and sinks.eventhubs.name (Azure AD)" -}}
{{- end -}}
{{- if and $secret .eventhubs.namespace -}}
{{- fail "sinks.eventhubs: give either connectionStringSecret.name or namespace (Azure AD), not both" -}}
{{- end -}}
{{- $sinks = append $sinks "eventhubs" -}}
{{- end -}}
{{- if .otlp.enabled }}{{ $sinks = append $sinks "otlp" }}{{ end -}}
{{- end -}}
{{- if not $sinks -}}
{{- fail "sinks: enable at least one of sinks.stdout, sinks.file, sinks.eventhubs, sinks.otlp" -}}
{{- end -}}
{{- join "," $sinks -}}
{{- end -}}

{{/*
The web configuration: "chart" (a ConfigMap made here, TLS only), "secret" (web.basicAuth.configSecret, the
user's whole file) or "" (none: plain HTTP). Stops with a message when the values do not fit together.
*/}}
{{- define "forewarn.webConfig" -}}
{{- $web := .Values.web -}}
{{- if and $web.tls.enabled (not $web.tls.secretName) -}}
{{- fail "web.tls.enabled needs web.tls.secretName (an existing kubernetes.io/tls Secret)" -}}
{{- end -}}
{{- if $web.basicAuth.enabled -}}
{{- if not $web.basicAuth.configSecret.name -}}
{{- fail "web.basicAuth.enabled needs web.basicAuth.configSecret.name (an existing Secret holding the web configuration file with basic_auth_users)" -}}
{{- end -}}
secret
{{- else if $web.tls.enabled -}}
chart
{{- end -}}
{{- end -}}

{{/*
mode: fleet. The Lease's name (FOREWARN_LEASE_NAME, and the one name the Role may get and update). The fullname
by default, which differs between two releases in one namespace: instances with different scopes (a Lease and a
scope make a fleet instance's owner of node actions) never share a Lease, where one would stand by for ever.
*/}}
{{- define "forewarn.leaseName" -}}
{{- default (include "forewarn.fullname" .) .Values.fleet.leaseName -}}
{{- end -}}

{{/*
mode: fleet. Checks what the schema cannot (values that depend on the mode or on each other) and stops with a
message naming the values, as `forewarn fleet` would at start.
*/}}
{{- define "forewarn.fleetChecks" -}}
{{- $fleet := .Values.fleet -}}
{{- if .Values.hostNetwork -}}
{{- fail "hostNetwork is for mode: agent (IMDS through the node); forewarn fleet reads no IMDS" -}}
{{- end -}}
{{- if .Values.nodeActions.enabled -}}
{{- fail "nodeActions.enabled is for mode: agent; mode: fleet's is fleet.nodeActions.enabled (with node actions in fleet.policy)" -}}
{{- end -}}
{{- if .Values.dryRun -}}
{{- fail "dryRun is for mode: agent; mode: fleet's is fleet.policy.dryRun" -}}
{{- end -}}
{{- if not $fleet.clientId -}}
{{- fail "mode: fleet needs fleet.clientId (the client id of the managed identity federated with the service account, for Workload Identity)" -}}
{{- end -}}
{{- if not (or $fleet.subscriptions $fleet.managementGroups $fleet.queue.url $fleet.eventgrid.path) -}}
{{- fail (printf "mode: fleet needs a source: fleet.subscriptions or fleet.managementGroups (Resource Graph), and/or fleet.queue.url (Event Grid through a Storage queue), and/or fleet.eventgrid.path (Event Grid push)%s" (ternary "; fleet.resourceGroups only narrows a source" "" (not (empty $fleet.resourceGroups)))) -}}
{{- end -}}
{{- if and $fleet.subscriptions $fleet.managementGroups -}}
{{- fail "fleet.subscriptions and fleet.managementGroups: give one scope or the other" -}}
{{- end -}}
{{- if and $fleet.queue.connectionStringSecret.name (not $fleet.queue.url) -}}
{{- fail "fleet.queue.connectionStringSecret needs fleet.queue.url (the queue's name is its last segment)" -}}
{{- end -}}
{{- if and $fleet.eventgrid.path (not $fleet.eventgrid.sharedSecret.name) -}}
{{- fail "fleet.eventgrid.path needs fleet.eventgrid.sharedSecret.name (an existing Secret with the shared secret of the webhook URL)" -}}
{{- end -}}
{{- if and $fleet.eventgrid.sharedSecret.name (not $fleet.eventgrid.path) -}}
{{- fail "fleet.eventgrid.sharedSecret needs fleet.eventgrid.path (the push route is off without it)" -}}
{{- end -}}
{{- end -}}
