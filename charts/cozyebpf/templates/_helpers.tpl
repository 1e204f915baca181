{{/* The chart's name: nameOverride, else cozyebpf. */}}
{{- define "cozyebpf.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Every object's name: fullnameOverride, else the release name (release-chart when the
two differ), as cozy-proxy's chart. */}}
{{- define "cozyebpf.fullname" -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if eq .Release.Name $name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The pods' selector: the name alone (kubectl -l app.kubernetes.io/name=cozyebpf, the
PodMonitor and deploy/uninstall/ select by it; a DaemonSet's selector cannot change). */}}
{{- define "cozyebpf.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cozyebpf.name" . }}
{{- end -}}

{{- define "cozyebpf.labels" -}}
{{ include "cozyebpf.selectorLabels" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "cozyebpf.serviceAccountName" -}}
{{- default (include "cozyebpf.fullname" .) .Values.serviceAccountName -}}
{{- end -}}

{{- define "cozyebpf.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (toString .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* HOST:PORT of the metrics server; $(NODE_IP) is the container's variable from
status.hostIP. */}}
{{- define "cozyebpf.metricsAddress" -}}
{{- printf "%s:%v" (default "$(NODE_IP)" .Values.metrics.host) .Values.metrics.port -}}
{{- end -}}
