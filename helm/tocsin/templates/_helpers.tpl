{{/* Names ------------------------------------------------------------------------ */}}

{{- define "tocsin.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tocsin.fullname" -}}
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

{{- define "tocsin.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels: "tocsin.labels" for metadata, "tocsin.selectorLabels" (immutable) for selectors.
     Both take a dict: (dict "ctx" $ "component" "worker"). */}}
{{- define "tocsin.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tocsin.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end -}}

{{- define "tocsin.labels" -}}
helm.sh/chart: {{ include "tocsin.chart" .ctx }}
{{ include "tocsin.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: tocsin
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "tocsin.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tocsin.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "tocsin.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* Secrets ---------------------------------------------------------------------- */}}

{{- define "tocsin.kafkaSaslEnabled" -}}
{{- if hasPrefix "SASL_" .Values.kafka.securityProtocol -}}true{{- end -}}
{{- end -}}

{{- define "tocsin.kafkaSaslSecret" -}}
{{- default (printf "%s-kafka-sasl" (include "tocsin.fullname" .)) .Values.kafka.sasl.existingSecret -}}
{{- end -}}

{{- define "tocsin.admissionSecret" -}}
{{- default (printf "%s-admission" (include "tocsin.fullname" .)) .Values.admission.existingSecret -}}
{{- end -}}

{{/* The admission key (docs/api.md) of the API and worker pods, when one is configured. */}}
{{- define "tocsin.admissionEnv" -}}
{{- if or .Values.admission.existingSecret .Values.admission.key }}
- name: TOCSIN_ADMISSION_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "tocsin.admissionSecret" . }}
      key: {{ .Values.admission.keyKey }}
- name: TOCSIN_ADMISSION_PREVIOUS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "tocsin.admissionSecret" . }}
      key: {{ .Values.admission.previousKeyKey }}
      optional: true
{{- end }}
{{- end -}}

{{- define "tocsin.cassandraAuthEnabled" -}}
{{- if or .Values.cassandra.auth.existingSecret .Values.cassandra.auth.username -}}true{{- end -}}
{{- end -}}

{{- define "tocsin.cassandraAuthSecret" -}}
{{- default (printf "%s-cassandra-auth" (include "tocsin.fullname" .)) .Values.cassandra.auth.existingSecret -}}
{{- end -}}

{{/* Environment: every TOCSIN_* setting shared by all roles (tocsin/settings.py).
     Rendered inline rather than from a ConfigMap so the pre-install hook Job, which runs
     before any regular release object exists, gets exactly the same configuration. */}}
{{- define "tocsin.env" -}}
- name: TOCSIN_KAFKA_BOOTSTRAP_SERVERS
  value: {{ required "kafka.bootstrapServers is required" .Values.kafka.bootstrapServers | quote }}
- name: TOCSIN_KAFKA_SECURITY_PROTOCOL
  value: {{ .Values.kafka.securityProtocol | quote }}
{{- if include "tocsin.kafkaSaslEnabled" . }}
- name: TOCSIN_KAFKA_SASL_MECHANISM
  value: {{ .Values.kafka.sasl.mechanism | quote }}
- name: TOCSIN_KAFKA_SASL_USERNAME
  valueFrom:
    secretKeyRef:
      name: {{ include "tocsin.kafkaSaslSecret" . }}
      key: {{ .Values.kafka.sasl.usernameKey }}
- name: TOCSIN_KAFKA_SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "tocsin.kafkaSaslSecret" . }}
      key: {{ .Values.kafka.sasl.passwordKey }}
{{- end }}
{{- if .Values.kafka.tls.enabled }}
{{- if .Values.kafka.tls.caKey }}
- name: TOCSIN_KAFKA_SSL_CA_LOCATION
  value: /etc/tocsin/kafka-tls/{{ .Values.kafka.tls.caKey }}
{{- end }}
{{- if .Values.kafka.tls.certKey }}
- name: TOCSIN_KAFKA_SSL_CERTIFICATE_LOCATION
  value: /etc/tocsin/kafka-tls/{{ .Values.kafka.tls.certKey }}
- name: TOCSIN_KAFKA_SSL_KEY_LOCATION
  value: /etc/tocsin/kafka-tls/{{ required "kafka.tls.keyKey is required with kafka.tls.certKey" .Values.kafka.tls.keyKey }}
{{- end }}
{{- end }}
- name: TOCSIN_CASSANDRA_CONTACT_POINTS
  value: {{ join "," .Values.cassandra.contactPoints | quote }}
- name: TOCSIN_CASSANDRA_PORT
  value: {{ .Values.cassandra.port | quote }}
- name: TOCSIN_CASSANDRA_KEYSPACE
  value: {{ .Values.cassandra.keyspace | quote }}
- name: TOCSIN_CASSANDRA_REPLICATION
  value: {{ .Values.cassandra.replication | quote }}
- name: TOCSIN_CASSANDRA_REQUEST_TIMEOUT_S
  value: {{ .Values.cassandra.requestTimeoutS | quote }}
{{- with .Values.cassandra.localDC }}
- name: TOCSIN_CASSANDRA_LOCAL_DC
  value: {{ . | quote }}
{{- end }}
{{- if include "tocsin.cassandraAuthEnabled" . }}
- name: TOCSIN_CASSANDRA_USERNAME
  valueFrom:
    secretKeyRef:
      name: {{ include "tocsin.cassandraAuthSecret" . }}
      key: {{ .Values.cassandra.auth.usernameKey }}
- name: TOCSIN_CASSANDRA_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "tocsin.cassandraAuthSecret" . }}
      key: {{ .Values.cassandra.auth.passwordKey }}
{{- end }}
{{- if .Values.cassandra.tls.enabled }}
- name: TOCSIN_CASSANDRA_SSL_CA_LOCATION
  value: /etc/tocsin/cassandra-tls/{{ .Values.cassandra.tls.caKey }}
{{- end }}
- name: TOCSIN_TOPIC_PREFIX
  value: {{ .Values.topics.prefix | quote }}
- name: TOCSIN_COMMAND_PARTITIONS
  value: {{ .Values.topics.commandPartitions | quote }}
- name: TOCSIN_FIRE_PARTITIONS
  value: {{ .Values.topics.firePartitions | quote }}
- name: TOCSIN_TOPIC_REPLICATION_FACTOR
  value: {{ .Values.topics.replicationFactor | quote }}
- name: TOCSIN_MAX_PAYLOAD_BYTES
  value: {{ .Values.scheduler.maxPayloadBytes | int64 | quote }}
- name: TOCSIN_DEFAULT_MISFIRE_TOLERANCE_S
  value: {{ .Values.scheduler.defaultMisfireToleranceS | int64 | quote }}
- name: TOCSIN_BUCKET_SHARDS
  value: {{ .Values.scheduler.bucketShards | quote }}
- name: TOCSIN_PRELOAD_AHEAD_S
  value: {{ .Values.scheduler.preloadAheadS | quote }}
- name: TOCSIN_FIRED_RETENTION_S
  value: {{ .Values.scheduler.firedRetentionS | int64 | quote }}
- name: TOCSIN_COMMAND_BATCH_SIZE
  value: {{ .Values.scheduler.commandBatchSize | quote }}
- name: TOCSIN_CONSUMER_FETCH_MAX_WAIT_MS
  value: {{ .Values.scheduler.consumerFetchMaxWaitMs | quote }}
- name: TOCSIN_CONSUMER_FETCH_MIN_BYTES
  value: {{ .Values.scheduler.consumerFetchMinBytes | int64 | quote }}
- name: TOCSIN_COMMIT_GROUP_SIZE
  value: {{ .Values.scheduler.commitGroupSize | quote }}
- name: TOCSIN_SESSION_TIMEOUT_S
  value: {{ .Values.scheduler.sessionTimeoutS | quote }}
{{- /* One switch with the proxy's guard: the worker and the API reject IP-literal
     callbacks to private addresses at create unless private targets are allowed. */}}
- name: TOCSIN_ALLOW_PRIVATE_TARGETS
  value: {{ .Values.proxy.allowPrivateTargets | toString | quote }}
- name: TOCSIN_METRICS_PORT
  value: {{ .Values.worker.metricsPort | quote }}
- name: TOCSIN_WORKER_WEB_PORT
  value: {{ .Values.worker.webPort | quote }}
- name: TOCSIN_STATE_DIR
  value: /var/lib/tocsin
- name: TOCSIN_LOG_LEVEL
  value: {{ .Values.log.level | quote }}
- name: TOCSIN_LOG_FORMAT
  value: {{ .Values.log.format | quote }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Volumes: writable scratch (read-only root filesystem) and the TLS files. */}}
{{- define "tocsin.volumes" -}}
- name: state
  emptyDir: {}
- name: tmp
  emptyDir:
    medium: Memory
    sizeLimit: 64Mi
{{- if .Values.kafka.tls.enabled }}
- name: kafka-tls
  secret:
    secretName: {{ required "kafka.tls.existingSecret is required when kafka.tls.enabled" .Values.kafka.tls.existingSecret }}
    defaultMode: 0440
{{- end }}
{{- if .Values.cassandra.tls.enabled }}
- name: cassandra-tls
  secret:
    secretName: {{ required "cassandra.tls.existingSecret is required when cassandra.tls.enabled" .Values.cassandra.tls.existingSecret }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "tocsin.volumeMounts" -}}
- name: state
  mountPath: /var/lib/tocsin
- name: tmp
  mountPath: /tmp
{{- if .Values.kafka.tls.enabled }}
- name: kafka-tls
  mountPath: /etc/tocsin/kafka-tls
  readOnly: true
{{- end }}
{{- if .Values.cassandra.tls.enabled }}
- name: cassandra-tls
  mountPath: /etc/tocsin/cassandra-tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* HTTP probes on a named port: (dict "probes" .Values.worker.probes "port" "metrics"). */}}
{{- define "tocsin.probes" -}}
startupProbe:
  httpGet:
    path: /healthz
    port: {{ .port }}
  periodSeconds: 5
  timeoutSeconds: {{ .probes.timeoutSeconds }}
  failureThreshold: {{ div (int .probes.startupSeconds) 5 | max 1 }}
livenessProbe:
  httpGet:
    path: /healthz
    port: {{ .port }}
  periodSeconds: {{ .probes.periodSeconds }}
  timeoutSeconds: {{ .probes.timeoutSeconds }}
  failureThreshold: {{ .probes.livenessFailureThreshold }}
readinessProbe:
  httpGet:
    path: /readyz
    port: {{ .port }}
  periodSeconds: {{ .probes.periodSeconds }}
  timeoutSeconds: {{ .probes.timeoutSeconds }}
  failureThreshold: {{ .probes.readinessFailureThreshold }}
{{- end -}}

{{/* Pod-level scheduling: (dict "ctx" $ "component" "worker" "role" .Values.worker). */}}
{{- define "tocsin.podScheduling" -}}
{{- with .role.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .role.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .role.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if .ctx.Values.topologySpread.enabled }}
topologySpreadConstraints:
  - maxSkew: {{ .ctx.Values.topologySpread.maxSkew }}
    topologyKey: {{ .ctx.Values.topologySpread.topologyKey }}
    whenUnsatisfiable: {{ .ctx.Values.topologySpread.whenUnsatisfiable }}
    labelSelector:
      matchLabels:
        {{- include "tocsin.selectorLabels" (dict "ctx" .ctx "component" .component) | nindent 8 }}
{{- end }}
{{- end -}}

{{- define "tocsin.podAnnotations" -}}
{{- $ann := merge (dict) (.role.podAnnotations | default dict) (.ctx.Values.podAnnotations | default dict) -}}
{{- if and .ctx.Values.metrics.podAnnotations .metricsPort -}}
{{- $_ := set $ann "prometheus.io/scrape" "true" -}}
{{- $_ := set $ann "prometheus.io/port" (toString .metricsPort) -}}
{{- $_ := set $ann "prometheus.io/path" "/metrics" -}}
{{- end -}}
{{- if $ann }}
{{- toYaml $ann }}
{{- end }}
{{- end -}}

{{/* The proxy's own TOCSIN_PROXY_* settings (proxy/settings.py). */}}
{{- define "tocsin.proxyEnv" -}}
{{- $p := .Values.proxy -}}
- name: TOCSIN_PROXY_MODE
  value: {{ $p.mode | quote }}
- name: TOCSIN_PROXY_GROUP_ID
  value: {{ $p.groupId | quote }}
{{- with $p.sourceTopic }}
- name: TOCSIN_PROXY_SOURCE_TOPIC
  value: {{ . | quote }}
{{- end }}
{{- with $p.endpointUrl }}
- name: TOCSIN_PROXY_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
- name: TOCSIN_PROXY_CONCURRENCY
  value: {{ $p.concurrency | int64 | quote }}
- name: TOCSIN_PROXY_PER_HOST_CONCURRENCY
  value: {{ $p.perHostConcurrency | int64 | quote }}
- name: TOCSIN_PROXY_MAX_PENDING_MESSAGES
  value: {{ $p.maxPendingMessages | int64 | quote }}
- name: TOCSIN_PROXY_MAX_PENDING_BYTES
  value: {{ $p.maxPendingBytes | int64 | quote }}
- name: TOCSIN_PROXY_SHUTDOWN_TIMEOUT_S
  value: {{ $p.shutdownTimeoutS | quote }}
- name: TOCSIN_PROXY_METRICS_PORT
  value: {{ $p.metricsPort | quote }}
- name: TOCSIN_PROXY_ALLOW_PRIVATE_TARGETS
  value: {{ $p.allowPrivateTargets | toString | quote }}
{{- range $name, $value := $p.config }}
- name: TOCSIN_PROXY_{{ $name | upper }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end -}}
