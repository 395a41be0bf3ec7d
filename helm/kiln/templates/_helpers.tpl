{{/* Names, labels and derived settings shared by the templates. */}}

{{- define "kiln.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kiln.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kiln.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kiln.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kiln.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kiln.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kiln
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "kiln.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kiln.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kiln.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.registry -}}
{{- printf "%s/%s:%s" .Values.image.registry .Values.image.repository $tag -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "kiln.minioName" -}}
{{- printf "%s-minio" (include "kiln.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The zoo: s3://bucket[/prefix]. */}}
{{- define "kiln.zooUri" -}}
{{- if .Values.zoo.prefix -}}
{{- printf "s3://%s/%s" .Values.zoo.bucket (trimPrefix "/" .Values.zoo.prefix) -}}
{{- else -}}
{{- printf "s3://%s" .Values.zoo.bucket -}}
{{- end -}}
{{- end -}}

{{- define "kiln.zooEndpoint" -}}
{{- if .Values.minio.enabled -}}
{{- printf "http://%s.%s.svc:9000" (include "kiln.minioName" .) .Release.Namespace -}}
{{- else -}}
{{- .Values.zoo.endpoint -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the operator's zoo credentials ("" when none). */}}
{{- define "kiln.zooSecret" -}}
{{- if .Values.minio.enabled -}}
{{- include "kiln.minioName" . -}}
{{- else -}}
{{- .Values.zoo.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "kiln.trainerSecret" -}}
{{- default (include "kiln.zooSecret" .) .Values.zoo.trainerSecret -}}
{{- end -}}

{{/* RBAC rules of the namespaced resources the operator uses (kiln.controller.rbac.RULES). */}}
{{- define "kiln.namespacedRules" -}}
- apiGroups: ["kiln.dev"]
  resources: ["trainingjobs"]
  verbs: ["get", "list", "watch", "patch", "delete"]
- apiGroups: ["kiln.dev"]
  resources: ["trainingjobs/status"]
  verbs: ["patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}
