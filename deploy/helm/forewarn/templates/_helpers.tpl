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
app.kubernetes.io/component: agent
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
