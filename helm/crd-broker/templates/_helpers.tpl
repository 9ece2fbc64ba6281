{{/* The chart's name. */}}
{{- define "crd-broker.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The full name of the release's resources. */}}
{{- define "crd-broker.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "crd-broker.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "crd-broker.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Labels on every resource. */}}
{{- define "crd-broker.labels" -}}
app.kubernetes.io/name: {{ include "crd-broker.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* Labels that select the pods. */}}
{{- define "crd-broker.selectorLabels" -}}
app.kubernetes.io/name: {{ include "crd-broker.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The ServiceAccount's name. */}}
{{- define "crd-broker.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "crd-broker.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The headless Service's name: what xDS clients name in their target. */}}
{{- define "crd-broker.headlessName" -}}
{{- default (printf "%s-headless" (include "crd-broker.fullname" .)) .Values.headlessService.name }}
{{- end }}
