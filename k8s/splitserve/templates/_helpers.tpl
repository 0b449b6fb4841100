{{/* Names, labels and the pieces every splitserve pod shares. */}}

{{- define "splitserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped base name; component objects append "-<component>" (kept under 63). */}}
{{- define "splitserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The name of one component's objects: (dict "root" $ "component" "prefill"). */}}
{{- define "splitserve.componentName" -}}
{{- printf "%s-%s" (include "splitserve.fullname" .root) .component -}}
{{- end -}}

{{- define "splitserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "splitserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "splitserve.labels" -}}
{{ include "splitserve.selectorLabels" . }}
app.kubernetes.io/part-of: splitserve
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* A pod template's labels: those of its objects less the chart's and the app's version
(and managed-by), so that a new chart release that changes nothing in the pods (its docs, a
template of another object) does not roll every worker and reload every model. A new image
rolls them through its tag. */}}
{{- define "splitserve.podLabels" -}}
{{ include "splitserve.selectorLabels" . }}
app.kubernetes.io/part-of: splitserve
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Labels every pod of this release carries, whatever its component (NetworkPolicy peers). */}}
{{- define "splitserve.releaseSelector" -}}
app.kubernetes.io/name: {{ include "splitserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "splitserve.image" -}}
{{- $img := .Values.image -}}
{{- $tag := default (printf "%s-%s" .Chart.AppVersion $img.variant) $img.tag -}}
{{- if $img.digest -}}
{{- printf "%s:%s@%s" $img.repository $tag $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.redisImage" -}}
{{- $img := .Values.redis.image -}}
{{- if $img.digest -}}
{{- printf "%s:%s@%s" $img.repository $img.tag $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository $img.tag -}}
{{- end -}}
{{- end -}}

{{/* REDIS_URL for gateway, workers and autoscaler: bundled, external url, or external Secret. */}}
{{- define "splitserve.redisUrlEnv" -}}
- name: REDIS_URL
{{- if .Values.redis.enabled }}
  value: {{ printf "redis://%s:%d/0" (include "splitserve.componentName" (dict "root" . "component" "redis")) (int .Values.redis.port) | quote }}
{{- else if .Values.redis.external.existingSecret }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.existingSecretKey }}
{{- else }}
  value: {{ .Values.redis.external.url | quote }}
{{- end }}
{{- end -}}

{{/* Downward-API identity; enableServiceLinks is off, so these are the only injected names. */}}
{{- define "splitserve.podIdentityEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end -}}

{{/* A map of extra environment variables, rendered as an env list sorted by name. */}}
{{- define "splitserve.extraEnv" -}}
{{- range $name, $value := . }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end -}}

{{- define "splitserve.modelClaimName" -}}
{{- .Values.model.volume.pvc.claimName -}}
{{- end -}}

{{/* The scalers that size the worker pools; at most one may be enabled (see validate.yaml). */}}
{{- define "splitserve.enabledScalers" -}}
{{- $on := list -}}
{{- if .Values.autoscaler.enabled }}{{ $on = append $on "autoscaler" }}{{ end -}}
{{- if .Values.hpa.enabled }}{{ $on = append $on "hpa" }}{{ end -}}
{{- if .Values.keda.enabled }}{{ $on = append $on "keda" }}{{ end -}}
{{- join "," $on -}}
{{- end -}}

{{/* failureThreshold that lets a startup probe run for at least timeout seconds. */}}
{{- define "splitserve.startupFailureThreshold" -}}
{{- $period := int .period -}}
{{- div (add (int .timeout) (sub $period 1)) $period -}}
{{- end -}}

{{/* The Secret with the gateway's API keys: yours, the chart's, or none (no authentication). */}}
{{- define "splitserve.apiKeysSecretName" -}}
{{- if .Values.gateway.apiKeys.existingSecret -}}
{{- .Values.gateway.apiKeys.existingSecret -}}
{{- else if .Values.gateway.apiKeys.keys -}}
{{- include "splitserve.componentName" (dict "root" . "component" "api-keys") -}}
{{- end -}}
{{- end -}}

{{/*
checkov findings this object accepts, each with its reason: metadata annotations
checkov.io/skipN: "CHECK_ID=reason". Pass (dict "root" $ "component" "gateway").
*/}}
{{- define "splitserve.checkovSkips" -}}
{{- $v := .root.Values -}}
{{- $skips := list -}}
{{- $digest := ternary $v.redis.image.digest $v.image.digest (eq .component "redis") -}}
{{- if not $digest -}}
{{- $skips = append $skips "CKV_K8S_43=Pin by digest with image.digest (redis.image.digest for Redis): only the operator knows the digest of the image it built or mirrored, so the chart cannot default one" -}}
{{- end -}}
{{- $secretEnv := and (ne .component "redis") $v.redis.external.existingSecret (not $v.redis.enabled) -}}
{{- if $secretEnv -}}
{{- $skips = append $skips "CKV_K8S_35=splitserve processes read REDIS_URL from the environment (their configuration interface); the value comes from a Secret by reference and never appears in the manifest" -}}
{{- end -}}
{{- if and $v.rdma.enabled (has .component (list "prefill" "decode")) -}}
{{- $skips = append $skips "CKV_K8S_25=rdma.enabled adds IPC_LOCK to the prefill and decode workers alone: RDMA registers pinned memory for NCCL's KV transfer; every other capability stays dropped" -}}
{{- end -}}
{{- if eq .component "autoscaler" -}}
{{- $skips = append $skips "CKV_K8S_38=The autoscaler calls the API server to get and patch deployments/scale of the two worker Deployments; its Role grants nothing else" -}}
{{- end -}}
{{- range $i, $skip := $skips }}
checkov.io/skip{{ add1 $i }}: {{ $skip | quote }}
{{- end -}}
{{- end -}}

{{/*
The worker pools of .Values.mode, as a JSON list: disaggregated runs a prefill and a decode pool;
aggregated runs one pool of role-both workers named "-worker", configured by .Values.aggregated
and scaled (hpa, keda) by the decode settings, since decode's KV bounds what it serves.
*/}}
{{- define "splitserve.workerPools" -}}
{{- if eq .Values.mode "aggregated" -}}
[{"component": "worker", "role": "both", "values": "aggregated", "scaler": "decode"}]
{{- else -}}
[{"component": "prefill", "role": "prefill", "values": "prefill", "scaler": "prefill"}, {"component": "decode", "role": "decode", "values": "decode", "scaler": "decode"}]
{{- end -}}
{{- end -}}

{{/* Tensor-parallel ranks of a pool's worker: tensorParallelSize, or 0 for one per GPU. */}}
{{- define "splitserve.tensorParallelSize" -}}
{{- $tp := int (default 0 .tensorParallelSize) -}}
{{- if eq $tp 0 -}}{{- max 1 (int .gpus) -}}{{- else -}}{{- $tp -}}{{- end -}}
{{- end -}}

{{/* The gateway's and workers' service account: empty for the namespace's default. */}}
{{- define "splitserve.servingServiceAccount" -}}
{{- if .Values.serviceAccount.create -}}
{{ default (include "splitserve.fullname" .) .Values.serviceAccount.name }}
{{- else -}}
{{ .Values.serviceAccount.name }}
{{- end -}}
{{- end -}}
