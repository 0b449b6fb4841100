{{/*
The internal plane (README "Security"): mutual TLS files and the cluster secret, mounted into the
gateway and worker pods as files the processes read through SPLITSERVE_TLS_* and
SPLITSERVE_CLUSTER_SECRET_FILE. Pass (dict "root" $ "component" "gateway"|"prefill"|"decode").
*/}}

{{/* The kubernetes.io/tls Secret (tls.crt, tls.key, ca.crt): yours, cert-manager's or the chart's. */}}
{{- define "splitserve.internalTlsSecretName" -}}
{{- .Values.security.tls.existingSecret | default (include "splitserve.componentName" (dict "root" . "component" "internal-tls")) -}}
{{- end -}}

{{- define "splitserve.clusterSecretName" -}}
{{- .Values.security.clusterSecret.existingSecret | default (include "splitserve.componentName" (dict "root" . "component" "cluster-secret")) -}}
{{- end -}}

{{/* Names in the shared certificate: the one clients check (pods are dialed by IP) and the
gateway Service, for callers of the gRPC front door. */}}
{{- define "splitserve.internalTlsNames" -}}
{{- $gateway := include "splitserve.componentName" (dict "root" . "component" "gateway") -}}
{{- $ns := .Release.Namespace -}}
{{- list .Values.security.tls.serverName $gateway (printf "%s.%s" $gateway $ns) (printf "%s.%s.svc" $gateway $ns) (printf "%s.%s.svc.cluster.local" $gateway $ns) | uniq | toJson -}}
{{- end -}}

{{- define "splitserve.securityEnv" -}}
{{- $s := .root.Values.security -}}
{{- if $s.tls.enabled }}
- name: SPLITSERVE_TLS_CERT
  value: /etc/splitserve/tls/tls.crt
- name: SPLITSERVE_TLS_KEY
  value: /etc/splitserve/tls/tls.key
- name: SPLITSERVE_TLS_CA
  value: /etc/splitserve/tls/ca.crt
{{- if eq .component "gateway" }}
- name: SPLITSERVE_TLS_SERVER_NAME
  value: {{ $s.tls.serverName | quote }}
- name: SPLITSERVE_GATEWAY_GRPC_CLIENT_CERTS
  value: {{ $s.tls.grpcClientCerts | quote }}
{{- end }}
{{- end }}
{{- if $s.clusterSecret.enabled }}
- name: SPLITSERVE_CLUSTER_SECRET_FILE
  value: /etc/splitserve/cluster/secret
{{- end }}
{{- end -}}

{{- define "splitserve.securityVolumeMounts" -}}
{{- $s := .root.Values.security -}}
{{- if $s.tls.enabled }}
- name: internal-tls
  mountPath: /etc/splitserve/tls
  readOnly: true
{{- end }}
{{- if $s.clusterSecret.enabled }}
- name: cluster-secret
  mountPath: /etc/splitserve/cluster
  readOnly: true
{{- end }}
{{- end -}}

{{/* Mounted as folders, not subPath files, so a renewed certificate reaches running pods. */}}
{{- define "splitserve.securityVolumes" -}}
{{- $s := .root.Values.security -}}
{{- if $s.tls.enabled }}
- name: internal-tls
  secret:
    secretName: {{ include "splitserve.internalTlsSecretName" .root }}
    defaultMode: 0440
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      - {key: ca.crt, path: ca.crt}
{{- end }}
{{- if $s.clusterSecret.enabled }}
- name: cluster-secret
  secret:
    secretName: {{ include "splitserve.clusterSecretName" .root }}
    defaultMode: 0440
    items:
      - {key: {{ $s.clusterSecret.secretKey }}, path: secret}
{{- end }}
{{- end -}}

{{/* The API keys (gateway.apiKeys) as a file, not an environment variable: the gateway (and a
worker's own OpenAI endpoint) re-reads it when the Secret changes, so a rotated key takes
effect within the kubelet's sync period without rolling any pod. Pass the Secret's name. */}}
{{- define "splitserve.apiKeysEnv" -}}
- name: SPLITSERVE_GATEWAY_API_KEYS_FILE
  value: /etc/splitserve/api-keys/keys
{{- end -}}

{{- define "splitserve.apiKeysVolumeMount" -}}
- name: api-keys
  mountPath: /etc/splitserve/api-keys
  readOnly: true
{{- end -}}

{{- define "splitserve.apiKeysVolume" -}}
- name: api-keys
  secret:
    secretName: {{ .name }}
    defaultMode: 0440
    items:
      - {key: {{ .key }}, path: keys}
{{- end -}}
