{{/* Chart name, truncated to 63 characters (a DNS label). */}}
{{- define "rljob-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Prefix of namespaced resource names: the release name when it already says rljob-operator,
     rljob-operator for a release named like its prefix ("rljob"), else RELEASE-rljob-operator. */}}
{{- define "rljob-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else if hasPrefix (printf "%s-" .Release.Name) $name }}
{{- $name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Name of cluster-scoped objects (ClusterRole/Binding): also carries the release namespace, so that
     teams can each install a namespaced operator under the same release name. */}}
{{- define "rljob-operator.clusterName" -}}
{{- printf "%s-%s" (include "rljob-operator.fullname" .) .Release.Namespace | trunc 200 | trimSuffix "-" }}
{{- end }}

{{- define "rljob-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select the operator's pod (Deployment, Service, NetworkPolicy). Never change them:
     a Deployment's selector is immutable. */}}
{{- define "rljob-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rljob-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "rljob-operator.labels" -}}
helm.sh/chart: {{ include "rljob-operator.chart" . }}
{{ include "rljob-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rljob
{{- end }}

{{- define "rljob-operator.serviceAccountName" -}}
{{- .Values.serviceAccount.name }}
{{- end }}

{{/* repository:tag or repository@digest; the tag defaults to the chart's appVersion. */}}
{{- define "rljob-operator.imageRef" -}}
{{- $image := index . 0 }}
{{- $root := index . 1 }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) }}
{{- end }}
{{- end }}

{{/* True when a watch-namespace entry is a kopf pattern (glob or negation), not an exact name. */}}
{{- define "rljob-operator.hasNamespacePatterns" -}}
{{- range .Values.watchNamespaces }}
{{- if regexMatch "[*?!]" . }}true{{ end }}
{{- end }}
{{- end }}

{{/* kopf's cluster observation (rbac.scanning): it watches CRDs to notice new or changed resources, and
     lists/watches namespaces whenever it is given namespaces (to resolve patterns and follow namespaces
     coming and going). Read-only, cluster-scoped, metadata only. Patterns always need namespaces. */}}
{{- define "rljob-operator.scanningRules" -}}
{{- if .Values.rbac.scanning }}
# kopf: runtime observation of CRDs (a changed rljobs CRD is picked up without a restart).
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end }}
{{- if or (and .Values.rbac.scanning .Values.watchNamespaces) (include "rljob-operator.hasNamespacePatterns" .) }}
# kopf: resolves the watched namespaces (patterns, namespaces created or deleted later).
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}
{{- end }}

{{/* The rules both the Role and the ClusterRole grant: exactly the calls the operator makes
     (operator/rljob/controller/kube.py and queueing.py, plus kopf's own watches and patches). */}}
{{- define "rljob-operator.rules" -}}
# RLJobs: kopf lists and watches them, patches its annotations and finalizer onto them; the conductor
# reads them via the watch, and deletes a finished job when ttlSecondsAfterFinished expires.
- apiGroups: ["rljob.io"]
  resources: ["rljobs"]
  verbs: ["get", "list", "watch", "patch", "delete"]
# Status has exactly one writer: the operator's StatusWriter (merge patch of the subresource).
- apiGroups: ["rljob.io"]
  resources: ["rljobs/status"]
  verbs: ["patch"]
# Children carry ownerReferences with blockOwnerDeletion: clusters that enable the
# OwnerReferencesPermissionEnforcement admission plugin require update on the owner's finalizers.
- apiGroups: ["rljob.io"]
  resources: ["rljobs/finalizers"]
  verbs: ["update"]
# The gang: list (by label) and watch to observe, create and delete to converge. No get/update/patch,
# no pods/exec, pods/log or pods/attach.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "create", "delete"]
# The per-job agent token: read back, create once, delete on cleanup. No list/watch: the operator never
# enumerates Secrets.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "delete"]
# The per-job headless Service (agent DNS); created once, deleted on cleanup.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["create", "delete"]
# Kubernetes Events for every phase change and refusal (core/v1 Events).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# Kueue (operator/rljob/controller/queueing.py), for RLJobs labelled kueue.x-k8s.io/queue-name: each
# such job's Workload is created (and deleted, to queue again after it finished), read, watched to follow
# admission and eviction, and its spec (active, queueName) merge-patched. Harmless without Kueue.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Its status: the quota given back after an eviction, Finished when the job ends (merge patches).
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["patch"]
{{- end }}
