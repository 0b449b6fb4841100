{{/*
Model delivery: the model volume (pvc, hostPath, or a per-pod emptyDir) and, with
model.download.enabled, an init container that fills model.path with the standard client of its
source (`hf download` from the splitserve image, `aws s3 sync` from the AWS CLI image) before
the gateway or worker starts. Secrets reach it as files, never as environment variables.
*/}}

{{- define "splitserve.modelVolume" -}}
{{- $v := .Values.model.volume -}}
- name: model
{{- if eq $v.type "hostPath" }}
  hostPath:
    path: {{ $v.hostPath.path }}
    type: {{ $v.hostPath.type }}
{{- else if eq $v.type "emptyDir" }}
  emptyDir:
    sizeLimit: {{ $v.emptyDir.sizeLimit }}
{{- else }}
  persistentVolumeClaim:
    claimName: {{ include "splitserve.modelClaimName" . }}
    {{- /* The download init container writes the claim; the serving container mounts it read-only. */}}
    readOnly: {{ not .Values.model.download.enabled }}
{{- end }}
{{- end -}}

{{- define "splitserve.modelVolumeMount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end -}}

{{/* Volumes the download init container needs besides the model: its credentials and scratch. */}}
{{- define "splitserve.modelDownloadVolumes" -}}
{{- $d := .Values.model.download -}}
{{- if $d.enabled }}
- name: model-download-tmp
  emptyDir:
    sizeLimit: 1Gi
{{- $secret := ternary $d.huggingface.tokenSecret $d.s3.credentialsSecret (eq $d.source "huggingface") }}
{{- if $secret }}
- name: model-download-credentials
  secret:
    secretName: {{ $secret }}
    defaultMode: 0440
    items:
      - key: {{ ternary $d.huggingface.tokenSecretKey $d.s3.credentialsSecretKey (eq $d.source "huggingface") }}
        path: {{ ternary "token" "credentials" (eq $d.source "huggingface") }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Pass (dict "root" $ "weights" true); the gateway passes weights false (tokenizer only). */}}
{{- define "splitserve.modelDownloadInitContainer" -}}
{{- $weights := .weights -}}
{{- with .root -}}
{{- $d := .Values.model.download -}}
{{- if $d.enabled }}
- name: model-download
  {{- if eq $d.source "huggingface" }}
  image: {{ include "splitserve.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command:
    - hf
    - download
    - {{ $d.huggingface.repo | quote }}
    - --revision
    - {{ $d.huggingface.revision | quote }}
    - --local-dir
    - {{ .Values.model.path | quote }}
    {{- range $d.huggingface.include }}
    {{- if or $weights (ne . "*.safetensors") }}
    - --include
    - {{ . | quote }}
    {{- end }}
    {{- end }}
  env:
    # The image serves offline (HF_HUB_OFFLINE=1); only this container reaches the hub.
    - name: HF_HUB_OFFLINE
      value: "0"
    - name: HF_HOME
      value: /tmp/hf
    {{- with $d.huggingface.endpoint }}
    - name: HF_ENDPOINT
      value: {{ . | quote }}
    {{- end }}
    {{- if $d.huggingface.tokenSecret }}
    - name: HF_TOKEN_PATH
      value: /etc/splitserve/model-download/token
    {{- end }}
  {{- else }}
  image: {{ include "splitserve.s3Image" . }}
  imagePullPolicy: {{ $d.s3.image.pullPolicy }}
  command:
    - aws
    - s3
    - sync
    - {{ $d.s3.uri | quote }}
    - {{ .Values.model.path | quote }}
    - --only-show-errors
    {{- if not $weights }}
    - --exclude
    - "*.safetensors"
    {{- end }}
    {{- with $d.s3.endpointUrl }}
    - --endpoint-url
    - {{ . | quote }}
    {{- end }}
  env:
    - name: HOME
      value: /tmp
    {{- with $d.s3.region }}
    - name: AWS_REGION
      value: {{ . | quote }}
    {{- end }}
    {{- if $d.s3.credentialsSecret }}
    - name: AWS_SHARED_CREDENTIALS_FILE
      value: /etc/splitserve/model-download/credentials
    {{- end }}
  {{- end }}
  resources:
    {{- toYaml $d.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: {{ .Values.model.mountPath }}
    - name: model-download-tmp
      mountPath: /tmp
    {{- if ternary $d.huggingface.tokenSecret $d.s3.credentialsSecret (eq $d.source "huggingface") }}
    - name: model-download-credentials
      mountPath: /etc/splitserve/model-download
      readOnly: true
    {{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "splitserve.s3Image" -}}
{{- $img := .Values.model.download.s3.image -}}
{{- if $img.digest -}}
{{- printf "%s:%s@%s" $img.repository $img.tag $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository $img.tag -}}
{{- end -}}
{{- end -}}
