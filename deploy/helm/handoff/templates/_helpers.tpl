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

{{/* The headless Service that gives a role's pods DNS names (`role` in the context). */}}
{{- define "handoff.podService" -}}
{{- if eq .role "prefill" -}}
{{ include "handoff.fullname" .root }}-prefill
{{- else -}}
{{ include "handoff.fullname" .root }}-{{ .role }}-pods
{{- end -}}
{{- end -}}

{{/* The host other processes dial a pod of a role by: with the cluster's TLS, the pod's DNS
name under its role's headless Service, which its certificate must name (a wildcard
`*.<service>.<namespace>.svc.<clusterDomain>`); else the pod's address. */}}
{{- define "handoff.advertiseHost" -}}
{{- if .root.Values.tls.existingSecret -}}
$(POD_NAME).{{ include "handoff.podService" . }}.{{ .root.Release.Namespace }}.svc.{{ .root.Values.tls.clusterDomain }}
{{- else -}}
$(POD_IP)
{{- end -}}
{{- end -}}

{{/* Refuses a role's extraArgs that repeat a flag the chart sets (`args`, `role`): the
binary would stop at startup on a flag given twice. */}}
{{- define "handoff.refuseChartArgs" -}}
{{- $root := .root -}}
{{- $role := .role -}}
{{- $set := dict
  "prefill" (list "--id" "--bootstrap-listen" "--grpc-listen" "--ops-listen" "--advertise-host" "--transfer-bind" "--transfer" "--engine" "--tp" "--dp" "--drain-secs")
  "frontend" (list "--listen" "--http-listen" "--ops-listen" "--max-kv-mib" "--advertise-host" "--transfer-bind" "--drain-secs" "--transfer" "--engine" "--decode-tp")
  "scheduler" (list "--listen" "--advertise-host" "--ops-listen" "--policy") -}}
{{- range .args -}}
{{- $arg := . -}}
{{- range (get $set $role) -}}
{{- if or (eq $arg .) (hasPrefix (printf "%s=" .) $arg) -}}
{{- fail (printf "%s.extraArgs: %s is set by the chart (from values.yaml: frontend.maxKvMiB, prefill.tp, drainSeconds, transfer, engine, ...)" $role $arg) -}}
{{- end -}}
{{- end -}}
{{- if and $root.Values.tls.existingSecret (or (hasPrefix "--tls-" .) (hasPrefix "--transfer-advertise" .)) -}}
{{- fail (printf "%s.extraArgs: %s is set by the chart with tls.existingSecret" $role .) -}}
{{- end -}}
{{- if and $root.Values.publicTls.existingSecret (hasPrefix "--public-tls-" .) -}}
{{- fail (printf "%s.extraArgs: %s is set by the chart with publicTls.existingSecret" $role .) -}}
{{- end -}}
{{- end -}}
{{- if $root.Values.tls.existingSecret -}}
{{- /* The Service naming the role's pods is a DNS label (63 characters at most), and the
StatefulSet's name goes into each pod's `controller-revision-hash` label with a dash and
up to 10 characters more (63 at most): 52 for the name. */ -}}
{{- $service := len (include "handoff.podService" (dict "root" $root "role" $role)) -}}
{{- $workload := len (printf "%s-%s" (include "handoff.fullname" $root) $role) -}}
{{- if or (gt $service 63) (gt $workload 52) -}}
{{- fail (printf "tls.existingSecret: the %s Service's name (%d characters, 63 at most) or its StatefulSet's (%d, 52 at most) is too long: shorten the release name" $role $service $workload) -}}
{{- end -}}
{{- if eq $root.Values.transfer "mooncake" -}}
{{- fail "tls.existingSecret: transfer mooncake has no TLS (its wire has none): use transfer tcp" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Pod annotations every role gets: a scrape, a checksum of the token the chart stores
(a new token rolls every pod: each reads it once), and podAnnotations. */}}
{{- define "handoff.podAnnotations" -}}
prometheus.io/scrape: "true"
prometheus.io/port: "9090"
{{- if not .Values.token.existingSecret }}
checksum/token: {{ .Values.token.value | sha256sum | quote }}
{{- end }}
{{- with .Values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Pod-level settings for the TLS files and extraVolumes (`role` in the context). */}}
{{- define "handoff.podTls" -}}
{{- if or .root.Values.tls.existingSecret .root.Values.publicTls.existingSecret }}
# The secret files' group, so the non-root user reads them (mode 0440).
securityContext:
  fsGroup: 10001
{{- end }}
{{- $public := and (eq .role "frontend") .root.Values.publicTls.existingSecret }}
{{- if or .root.Values.tls.existingSecret $public .root.Values.extraVolumes }}
volumes:
  {{- if .root.Values.tls.existingSecret }}
  - name: cluster-tls
    secret: {secretName: {{ .root.Values.tls.existingSecret | quote }}, defaultMode: 0440}
  {{- end }}
  {{- if $public }}
  - name: public-tls
    secret: {secretName: {{ .root.Values.publicTls.existingSecret | quote }}, defaultMode: 0440}
  {{- end }}
  {{- with .root.Values.extraVolumes }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* The container's mounts of those volumes (`role` in the context). */}}
{{- define "handoff.tlsMounts" -}}
{{- $public := and (eq .role "frontend") .root.Values.publicTls.existingSecret }}
{{- if or .root.Values.tls.existingSecret $public .root.Values.extraVolumeMounts }}
volumeMounts:
  {{- if .root.Values.tls.existingSecret }}
  - {name: cluster-tls, mountPath: /etc/handoff/tls, readOnly: true}
  {{- end }}
  {{- if $public }}
  - {name: public-tls, mountPath: /etc/handoff/public-tls, readOnly: true}
  {{- end }}
  {{- with .root.Values.extraVolumeMounts }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* The cluster's TLS flags (with tls.existingSecret). */}}
{{- define "handoff.tlsArgs" -}}
{{- if .Values.tls.existingSecret }}
- --tls-cert=/etc/handoff/tls/tls.crt
- --tls-key=/etc/handoff/tls/tls.key
- --tls-ca=/etc/handoff/tls/ca.crt
{{- end }}
{{- end -}}

{{/* With the cluster's TLS, a headless Service naming a role's pods (`role` in the context;
the prefills' own Service does it for them). */}}
{{- define "handoff.podNames" -}}
{{- if and .root.Values.tls.existingSecret (ne .role "prefill") }}
---
# Names each pod, for the cluster's TLS (see handoff.advertiseHost), ready or not.
apiVersion: v1
kind: Service
metadata:
  name: {{ include "handoff.podService" . }}
  labels:
    {{- include "handoff.labels" . | nindent 4 }}
spec:
  clusterIP: None
  publishNotReadyAddresses: true
  selector:
    {{- include "handoff.selector" . | nindent 4 }}
{{- end }}
{{- end -}}

{{/* A role's workload up to its pod template (`role` and `replicas` in the context): a
Deployment, or with the cluster's TLS a StatefulSet, whose pods alone get DNS names of their
own (`<workload>-<n>.<serviceName>...`; a Deployment's pods have no hostname, so no record). */}}
{{- define "handoff.workload" -}}
apiVersion: apps/v1
kind: {{ if .root.Values.tls.existingSecret }}StatefulSet{{ else }}Deployment{{ end }}
metadata:
  name: {{ include "handoff.fullname" .root }}-{{ .role }}
  labels:
    {{- include "handoff.labels" . | nindent 4 }}
spec:
  replicas: {{ .replicas }}
  selector:
    matchLabels:
      {{- include "handoff.selector" . | nindent 6 }}
  {{- if .root.Values.tls.existingSecret }}
  serviceName: {{ include "handoff.podService" . }}
  # Started and stopped side by side; an update replaces one pod at a time, stopping it
  # before its successor starts (a StatefulSet does not surge).
  podManagementPolicy: Parallel
  updateStrategy:
    type: RollingUpdate
  {{- else }}
  strategy:
    type: RollingUpdate
    rollingUpdate: {maxSurge: 1, maxUnavailable: 0}
  {{- end }}
{{- end -}}
