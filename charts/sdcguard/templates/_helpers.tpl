{{/* Names and labels shared by every object of the chart. */}}
{{- define "sdcguard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "sdcguard.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "sdcguard.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "sdcguard.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "sdcguard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sdcguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "sdcguard.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "sdcguard.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sdcguard
{{- end }}

{{- define "sdcguard.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "sdcguard.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "sdcguard.operatorImage" -}}
{{- printf "%s:%s" .Values.image.operator.repository (default .Chart.AppVersion .Values.image.operator.tag) }}
{{- end }}

{{- define "sdcguard.agentImage" -}}
{{- printf "%s:%s" .Values.image.agent.repository (default .Chart.AppVersion .Values.image.agent.tag) }}
{{- end }}

{{- define "sdcguard.webhookServiceName" -}}
{{- printf "%s-webhook" (include "sdcguard.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The Secret holding the webhook's serving certificate (tls.crt, tls.key). */}}
{{- define "sdcguard.webhookSecretName" -}}
{{- if eq .Values.webhook.tls.mode "secret" }}
{{- required "webhook.tls.existingSecret is required when webhook.tls.mode is secret" .Values.webhook.tls.existingSecret }}
{{- else }}
{{- printf "%s-webhook-tls" (include "sdcguard.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
