{{/* The prefix of every object's name: the release name, or <release>-strata. */}}
{{- define "strata.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains "strata" .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-strata" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels of every object. app.kubernetes.io/name is always `strata`: the ServiceMonitor takes its job
label from it, and the alerts select job="strata". */}}
{{- define "strata.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: strata
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: strata
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "server") */}}
{{- define "strata.selectorLabels" -}}
app.kubernetes.io/name: strata
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "strata.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "strata.operatorServiceAccount" -}}
{{- if .Values.operator.serviceAccount.create -}}
{{- .Values.operator.serviceAccount.name | default (printf "%s-operator" (include "strata.fullname" .)) -}}
{{- else -}}
{{- .Values.operator.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{/* The --model argument: `default`, an absolute path, or a path relative to the model cache's mountPath. */}}
{{- define "strata.modelPath" -}}
{{- $model := .Values.server.model -}}
{{- if or (eq $model "default") (hasPrefix "/" $model) -}}
{{- $model -}}
{{- else -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.server.modelCache.mountPath) $model -}}
{{- end -}}
{{- end -}}

{{- define "strata.modelClaim" -}}
{{- .Values.server.modelCache.pvc.existingClaim | default (printf "%s-models" (include "strata.fullname" .)) -}}
{{- end -}}

{{/* The name of the Service port that the ServiceMonitor scrapes; vLLM's production stack uses the same. */}}
{{- define "strata.metricsPortName" -}}service-port{{- end -}}
