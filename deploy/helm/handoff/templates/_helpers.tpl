{{/* The release's name prefix for every object. */}}
{{- define "handoff.fullname" -}}
{{- printf "%s-handoff" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object; `role` names the component. */}}
{{- define "handoff.labels" -}}
app.kubernetes.io/name: handoff
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{/* Selector labels of one role. */}}
{{- define "handoff.selector" -}}
app.kubernetes.io/name: handoff
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{/* The name of the Secret holding the cluster token. */}}
{{- define "handoff.tokenSecret" -}}
{{- if .Values.token.existingSecret -}}
{{ .Values.token.existingSecret }}
{{- else -}}
{{ include "handoff.fullname" . }}-token
{{- end -}}
{{- end -}}

{{/* etcd endpoints: in-chart or external. */}}
{{- define "handoff.etcd" -}}
{{- if .Values.etcd.enabled -}}
http://{{ include "handoff.fullname" . }}-etcd:2379
{{- else -}}
{{ required "etcd.external.endpoints is required when etcd.enabled is false" .Values.etcd.external.endpoints }}
{{- end -}}
{{- end -}}

{{/* NATS URL: in-chart or external. */}}
{{- define "handoff.nats" -}}
{{- if .Values.nats.enabled -}}
nats://{{ include "handoff.fullname" . }}-nats:4222
{{- else -}}
{{ required "nats.external.url is required when nats.enabled is false" .Values.nats.external.url }}
{{- end -}}
{{- end -}}

{{/* Environment every handoff role gets: discovery, the token, the pod's address. */}}
{{- define "handoff.env" -}}
- name: HANDOFF_ETCD
  value: {{ include "handoff.etcd" . | quote }}
- name: HANDOFF_NATS
  value: {{ include "handoff.nats" . | quote }}
- name: HANDOFF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "handoff.tokenSecret" . }}
      key: token
- name: HANDOFF_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- end -}}

{{/* Container security settings shared by every role. */}}
{{- define "handoff.securityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 10001
capabilities:
  drop: ["ALL"]
{{- end -}}
