{{- define "worker.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "worker.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "worker.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "worker.serviceAccountName" -}}
{{- default (include "worker.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "worker.taskNamespace" -}}
{{- default .Release.Namespace .Values.taskNamespace -}}
{{- end -}}

{{- /* The operator chart's worker ClusterRole: its "batchlease.fullname"
  of release workerRole.operatorRelease, plus "-worker". */}}
{{- define "worker.clusterRole" -}}
{{- if .Values.workerRole.name -}}
{{- .Values.workerRole.name -}}
{{- else -}}
{{- $op := .Values.workerRole.operatorRelease -}}
{{- $full := ternary $op (printf "%s-batchlease-operator" $op) (contains "batchlease-operator" $op) | trunc 63 | trimSuffix "-" -}}
{{- printf "%s-worker" $full -}}
{{- end -}}
{{- end -}}

{{- /* Where the mounted PostgreSQL Secret's key is. */}}
{{- define "worker.pgDir" -}}/var/run/secrets/batchlease/postgres{{- end -}}
