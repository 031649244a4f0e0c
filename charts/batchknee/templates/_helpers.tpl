{{/*
The chart name, or nameOverride.
*/}}
{{- define "batchknee.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full name of the release's objects: fullnameOverride, or the release name plus the chart name
unless the release name already contains it. 63 characters at most (DNS label).
*/}}
{{- define "batchknee.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
chart label: name-version.
*/}}
{{- define "batchknee.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The standard labels of every object.
*/}}
{{- define "batchknee.labels" -}}
helm.sh/chart: {{ include "batchknee.chart" . }}
{{ include "batchknee.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: batchknee
{{- end }}

{{/*
The labels that select the operator's pods (immutable once installed: never add to them).
*/}}
{{- define "batchknee.selectorLabels" -}}
app.kubernetes.io/name: {{ include "batchknee.name" . | quote }}
app.kubernetes.io/instance: {{ .Release.Name | quote }}
{{- end }}

{{/*
The ServiceAccount the operator runs as.
*/}}
{{- define "batchknee.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "batchknee.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The operator image: repository@digest, or repository:tag (tag defaults to the appVersion).
*/}}
{{- define "batchknee.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
kopf peering mode: operator.peering.mode, or "mandatory" with several replicas and "standalone" with
one. Several standalone replicas would all act on every object: refused.
*/}}
{{- define "batchknee.peeringMode" -}}
{{- $mode := .Values.operator.peering.mode | default (ternary "mandatory" "standalone" (gt (int .Values.replicaCount) 1)) }}
{{- if and (eq $mode "standalone") (gt (int .Values.replicaCount) 1) }}
{{- fail "replicaCount > 1 needs kopf peering: leave operator.peering.mode empty or set it to \"mandatory\"" }}
{{- end }}
{{- $mode }}
{{- end }}

{{/*
"true" when the operator peers with other replicas.
*/}}
{{- define "batchknee.peering" -}}
{{- if ne (include "batchknee.peeringMode" .) "standalone" }}true{{- end }}
{{- end }}

{{/*
The RBAC rules of one watched namespace (or, with the cluster-scoped extras, of the whole cluster).
Each rule is a call the operator makes; the README lists which code makes it.
*/}}
{{- define "batchknee.namespacedRules" -}}
# kopf lists and watches LLMServings and patches off the finalizer older builds added; reconcile
# reads one from that watch (or, right after writing it, by a list of its name) and writes its
# status through the status subresource (server-side apply).
- apiGroups: ["batchknee.io"]
  resources: ["llmservings"]
  verbs: ["list", "watch", "patch"]
- apiGroups: ["batchknee.io"]
  resources: ["llmservings/status"]
  verbs: ["patch"]
# Nothing calls it: the objects the operator applies name their LLMServing as an owner that their
# deletion blocks (blockOwnerDeletion), which the OwnerReferencesPermissionEnforcement admission
# plugin (on in OpenShift) allows only to whoever may update the owner's finalizers.
- apiGroups: ["batchknee.io"]
  resources: ["llmservings/finalizers"]
  verbs: ["update"]
# The engine Deployment: watched (list, watch: rollout progress, and what reconcile reads), read (get)
# where the watch has not brought it yet, written by server-side apply: a PATCH, for which the
# apiserver also requires create when the object does not exist yet.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch"]
# An adopted StatefulSet (spec.targetRef): read, and its one env entry set by server-side apply.
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "patch"]
# The engine Service: watched (list, watch: what reconcile reads), read (get) where the watch has not
# brought it (an object of that name that this LLMServing does not control is never applied over),
# then server-side apply (create, patch).
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch"]
# TensorRT-LLM's options ConfigMaps (immutable, one per content): read first, applied, and its own
# old ones listed and deleted past the newest three.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch", "list", "delete"]
# The engine pods' PodDisruptionBudget (at most one evicted at a time): watched and read as the
# Service is, then server-side apply; with operator.disruptionBudgets off, its own are deleted.
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch"{{ if not .Values.operator.disruptionBudgets }}, "delete"{{ end }}]
# The engine pods: listed to report an engine that crash-loops after a change.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list"]
# Deployed / Retuned / Recommended / InvalidSpec events.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}
