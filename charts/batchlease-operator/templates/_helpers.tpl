{{- define "batchlease.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "batchlease.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "batchlease.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "batchlease.serviceAccountName" -}}
{{- default (include "batchlease.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- /* "true" when the holder-only policy is rendered: admission.enabled and
  the API server serves admissionregistration.k8s.io/v1
  ValidatingAdmissionPolicy (GA in Kubernetes 1.30; it can be switched off
  with --runtime-config). Empty otherwise. */}}
{{- define "batchlease.admissionPolicy" -}}
{{- if and .Values.admission.enabled (.Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy") -}}
true
{{- end -}}
{{- end -}}
