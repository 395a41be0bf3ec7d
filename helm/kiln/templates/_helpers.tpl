{{/* Names, labels and derived settings shared by the templates. */}}

{{- define "kiln.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The resource name prefix. Dots (allowed in release names) are not in Service names. */}}
{{- define "kiln.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | replace "." "-" | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | replace "." "-" | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | replace "." "-" | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The full name with a suffix, the prefix cut so that the whole stays within 63. */}}
{{- define "kiln.suffixed" -}}
{{- $prefix := include "kiln.fullname" .context | trunc (int (sub 63 (len .suffix))) | trimSuffix "-" -}}
{{- printf "%s%s" $prefix .suffix -}}
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
{{- if eq .Values.serviceAccount.name "default" -}}
{{- fail "serviceAccount.name: \"default\" already exists in every namespace; leave it empty (the chart names its account) or set serviceAccount.create=false" -}}
{{- end -}}
{{- default (include "kiln.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- if or (not .Values.serviceAccount.name) (eq .Values.serviceAccount.name "default") -}}
{{- fail "serviceAccount.name: with serviceAccount.create=false, name an existing account for the operator alone (not \"default\": every pod there would get the operator's cluster-wide rights)" -}}
{{- end -}}
{{- .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Values no schema can check; each failure names the value and the fix. */}}
{{- define "kiln.checkValues" -}}
{{- if and (not .Values.minio.enabled) (not .Values.zoo.endpoint) -}}
{{- fail "zoo.endpoint: the operator and trainer pods need the model zoo's S3 endpoint (host:port or http(s)://host:port); set zoo.endpoint (and zoo.existingSecret), or minio.enabled=true for a bundled MinIO" -}}
{{- end -}}
{{- if eq (int .Values.metrics.port) (int .Values.operator.livenessPort) -}}
{{- fail (printf "metrics.port and operator.livenessPort are both %d; the two endpoints need different ports" (int .Values.metrics.port)) -}}
{{- end -}}
{{- $managed := list "--namespace" "-n" "--zoo-uri" "--zoo-endpoint" "--zoo-secret" "--zoo-secret-access-key" "--zoo-secret-secret-key" "--zoo-share" "--zoo-pod-access" "--zoo-access-hours" "--default-image" "--image-pull-policy" "--trainer-service-account" "--trainer-metrics-port" "--termination-grace-seconds" "--gpu-type" "--gpu-type-label" "--gpu-resource" "--max-gpus-per-job" "--cpu-slots-per-node" "--kueue" "--no-kueue" "--placement-use-milp" "--no-placement-use-milp" "--placement-time-limit-seconds" "--placement-interval-seconds" "--placement-freeze-window-seconds" "--liveness-port" "--metrics-port" "--kubeconfig" "--verbose" "--no-verbose" "--help" "-h" "--peering" "--finalizer" "--no-finalizer" "--pod-security-context" "--container-security-context" -}}
{{- $open := list "--kueue-api-version" "--zoo-secret-session-token" "--zoo-retry-limit" "--zoo-retry-delay-seconds" "--zoo-retry-max-delay-seconds" "--zoo-request-attempts" "--zoo-refresh-seconds" "--zoo-query-timeout-seconds" "--zoo-capacity" "--zoo-gc-interval-seconds" "--zoo-hit-half-life-seconds" "--warm-start-graph-timeout-seconds" "--liveness-host" "--metrics-host" "--housekeeping-interval-seconds" "--pod-start-timeout-seconds" "--progress-address" "--progress-timeout-seconds" "--profile-entrypoint-models" "--no-profile-entrypoint-models" "--profile-unmeasured" "--no-profile-unmeasured" "--profile-timeout-seconds" "--placement-objective" "--namespace-gpu-quota" "--priority-weight" "--resize" "--no-resize" "--resize-min-gain" "--resize-min-interval-seconds" "--resize-restart-seconds" "--resize-grow-price" "--resize-grow-load-exponent" "--resize-short-job-weight" -}}
{{- /* The open flags that take no value; the others need one (each extraArg is one argument). */ -}}
{{- $switches := list "--resize" "--no-resize" "--profile-entrypoint-models" "--no-profile-entrypoint-models" "--profile-unmeasured" "--no-profile-unmeasured" -}}
{{- $repeatable := list "--namespace-gpu-quota" "--priority-weight" -}}
{{- $seen := dict -}}
{{- range .Values.operator.extraArgs -}}
{{- $flag := regexReplaceAll "=.*$" . "" -}}
{{- if has $flag $managed -}}
{{- fail (printf "operator.extraArgs: %s is set by the chart from its values (see values.yaml); set the value instead" $flag) -}}
{{- else if not (has $flag $open) -}}
{{- fail (printf "operator.extraArgs: %s is not a kiln operator flag the chart leaves open; use one of %s, as --flag=value" $flag (join ", " $open)) -}}
{{- else if and (has $flag $switches) (contains "=" .) -}}
{{- fail (printf "operator.extraArgs: %s takes no value; give %s, or its --no- form, alone" . $flag) -}}
{{- else if and (not (has $flag $switches)) (not (contains "=" .)) -}}
{{- fail (printf "operator.extraArgs: %s needs a value in the same item, as %s=VALUE" $flag $flag) -}}
{{- end -}}
{{- /* the operator would take the last of two silently: --resize and --no-resize are one setting */ -}}
{{- $setting := $flag | replace "--no-" "--" -}}
{{- if and (hasKey $seen $setting) (not (has $flag $repeatable)) -}}
{{- fail (printf "operator.extraArgs: %s is given twice (%s and %s); keep one" $setting (get $seen $setting) .) -}}
{{- end -}}
{{- $_ := set $seen $setting . -}}
{{- end -}}
{{- /* KILN_OPERATOR_<SETTING> in operator.env would lose to the flag the chart passes, or set
what the values leave unset (e.g. peering with one replica): the values decide these. */ -}}
{{- $lists := dict "--namespace" "NAMESPACES" "--gpu-resource" "GPU_RESOURCES" -}}
{{- $managedEnv := dict -}}
{{- range $managed -}}
{{- if and (hasPrefix "--" .) (not (hasPrefix "--no-" .)) (ne . "--help") -}}
{{- $name := get $lists . | default (trimPrefix "--" . | replace "-" "_" | upper) -}}
{{- $_ := set $managedEnv (printf "KILN_OPERATOR_%s" $name) . -}}
{{- end -}}
{{- end -}}
{{- range .Values.operator.env -}}
{{- if hasKey $managedEnv .name -}}
{{- fail (printf "operator.env: %s sets the operator's %s, which the chart sets from its values (see values.yaml); set the value instead" .name (get $managedEnv .name)) -}}
{{- end -}}
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
{{- include "kiln.suffixed" (dict "context" . "suffix" "-minio") -}}
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

{{/* RBAC rules of the namespaced resources the operator uses (kiln.controller.rbac.RULES), and
the finalizers updates that owner references with blockOwnerDeletion need
(kiln.controller.rbac.OWNER_REFERENCE_RULES). */}}
{{- define "kiln.namespacedRules" -}}
- apiGroups: ["kiln.dev"]
  resources: ["trainingjobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["kiln.dev"]
  resources: ["trainingjobs/status"]
  verbs: ["patch"]
- apiGroups: ["kiln.dev"]
  resources: ["trainingjobs/finalizers", "trainingsweeps/finalizers"]
  verbs: ["update"]
- apiGroups: ["kiln.dev"]
  resources: ["trainingsweeps"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["kiln.dev"]
  resources: ["trainingsweeps/status"]
  verbs: ["patch"]
- apiGroups: ["kiln.dev"]
  resources: ["trainingruntimes"]
  verbs: ["get"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create", "patch"]
{{- if .Values.kueue.enabled }}
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["patch"]
{{- end }}
{{- end }}
