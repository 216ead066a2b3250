{{/* Names ---------------------------------------------------------------------------------------------------- */}}

{{- define "preft.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of every object's name: the release name, plus "-preft" unless it already contains it. */}}
{{- define "preft.fullname" -}}
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

{{- define "preft.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels: the standard app.kubernetes.io/* set. Call with (dict "ctx" $ "component" "gateway"). ---------------- */}}

{{- define "preft.selectorLabels" -}}
app.kubernetes.io/name: {{ include "preft.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end }}

{{- define "preft.labels" -}}
helm.sh/chart: {{ include "preft.chart" .ctx }}
{{ include "preft.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: preft-serve
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Images: repository@digest when a digest is set, else repository:tag. Call with the image's values. ---------- */}}

{{- define "preft.image" -}}
{{- if .digest -}}
{{ .repository }}@{{ .digest }}
{{- else -}}
{{ .repository }}:{{ required "image tag must be set" .tag }}
{{- end -}}
{{- end }}

{{/* Secrets ------------------------------------------------------------------------------------------------- */}}

{{- define "preft.registryTokenSecretName" -}}
{{- default (printf "%s-registry-token" (include "preft.fullname" .)) .Values.registry.auth.existingSecret }}
{{- end }}

{{- define "preft.registryTokenSecretKey" -}}
{{- if .Values.registry.auth.existingSecret }}{{ .Values.registry.auth.existingSecretKey }}{{ else }}admin-token{{ end }}
{{- end }}

{{- define "preft.registryGatewayTokenKey" -}}
{{- with .Values.registry.auth }}{{ if .existingSecret }}{{ .existingSecretGatewayTokenKey }}{{ else }}gateway-token{{ end }}{{ end }}
{{- end }}

{{- define "preft.registryReaderTokenKey" -}}
{{- with .Values.registry.auth }}{{ if .existingSecret }}{{ .existingSecretReaderTokenKey }}{{ else }}reader-token{{ end }}{{ end }}
{{- end }}

{{- define "preft.engineTokenSecretName" -}}
{{- default (printf "%s-engine-token" (include "preft.fullname" .)) .Values.engine.auth.existingSecret }}
{{- end }}

{{- define "preft.engineTokenSecretKey" -}}
{{- if .Values.engine.auth.existingSecret }}{{ .Values.engine.auth.existingSecretKey }}{{ else }}token{{ end }}
{{- end }}

{{/* The engine's token (its /generate) and its read-only registry token, on the Ray head and workers. */}}
{{- define "preft.engineAuthEnv" -}}
- name: PREFT_ENGINE__API_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ include "preft.engineTokenSecretName" . }}, key: {{ include "preft.engineTokenSecretKey" . }}}
- name: PREFT_ENGINE__REGISTRY_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ include "preft.registryTokenSecretName" . }}, key: {{ include "preft.registryReaderTokenKey" . }}}
{{- end }}

{{/* S3 credentials: "existing", "chart" (values or SeaweedFS dummies) or "none" (default AWS credential chain). */}}
{{- define "preft.s3CredentialsMode" -}}
{{- if .Values.s3.existingSecret }}existing
{{- else if or .Values.s3.accessKey .Values.seaweedfs.enabled }}chart
{{- else }}none
{{- end }}
{{- end }}

{{- define "preft.s3SecretName" -}}
{{- default (printf "%s-s3" (include "preft.fullname" .)) .Values.s3.existingSecret }}
{{- end }}

{{- define "preft.s3Endpoint" -}}
{{- if .Values.seaweedfs.enabled }}http://{{ include "preft.fullname" . }}-seaweedfs:8333
{{- else }}{{ .Values.s3.endpointUrl }}
{{- end }}
{{- end }}

{{/* Redis: "internal" (the chart's StatefulSet, URL in the ConfigMap), or a Secret holding the URL. */}}
{{- define "preft.redisMode" -}}
{{- if .Values.redis.enabled }}internal
{{- else if .Values.externalRedis.existingSecret }}existing
{{- else if .Values.externalRedis.url }}chart
{{- else }}{{ fail "Redis: set redis.enabled=true, externalRedis.url or externalRedis.existingSecret" }}
{{- end }}
{{- end }}

{{- define "preft.redisSecretName" -}}
{{- default (printf "%s-redis" (include "preft.fullname" .)) .Values.externalRedis.existingSecret }}
{{- end }}

{{- define "preft.redisSecretKey" -}}
{{- if .Values.externalRedis.existingSecret }}{{ .Values.externalRedis.existingSecretKey }}{{ else }}url{{ end }}
{{- end }}

{{/* Environment entries shared by the services. Call with (dict "ctx" $ "prefix" "PREFT_GATEWAY__"). ----------- */}}

{{- /* The pod IP, for `ray start --node-ip-address=$MY_POD_IP` (KubeRay runs `ray start` in a shell). */}}
{{- define "preft.podIPEnv" -}}
- name: MY_POD_IP
  valueFrom:
    fieldRef: {fieldPath: status.podIP}
{{- end }}

{{- define "preft.redisEnv" -}}
{{- $ctx := .ctx }}
{{- if ne (include "preft.redisMode" $ctx) "internal" }}
- name: {{ .prefix }}REDIS__URL
  valueFrom:
    secretKeyRef: {name: {{ include "preft.redisSecretName" $ctx }}, key: {{ include "preft.redisSecretKey" $ctx }}}
{{- end }}
- name: {{ .prefix }}REDIS__USERNAME
  value: {{ .user }}
- name: {{ .prefix }}REDIS__PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ include "preft.redisAclSecretName" $ctx }}, key: {{ .user }}}
{{- end }}

{{/* The Redis ACL users' passwords (keys: default = the admin, gateway, registry, engine, ray = Ray's GCS). */}}
{{- define "preft.redisAclSecretName" -}}
{{- default (printf "%s-redis-acl" (include "preft.fullname" .)) .Values.redis.auth.existingSecret }}
{{- end }}

{{/* A service's Redis ACL rules, password left out: services/preft/common/redis_acl.py's (tests/deploy check them).
Call with (dict "user" "gateway"). */}}
{{- define "preft.redisAclRules" -}}
{{- if eq .user "gateway" }}resetkeys ~preft:limits:* ~preft:quota-reserved:* ~preft:quota-reservations:* ~preft:usage:* ~preft:usage-hour:* ~preft:usage-minute:* ~preft:usage-month:* ~preft:usage-batch:* ~preft:file:* ~preft:files:* ~preft:batch:* ~preft:batch-done:* ~preft:batch-parts:* ~preft:batch-lease:* ~preft:batches:* ~preft:batches-open ~preft:batches-open:* ~preft:batches-started ~preft:offline-slots ~preft:response:* ~preft:response-run:* ~preft:response-events:* ~preft:conversation:* ~preft:conversation-order:* ~preft:conversation-items:* ~preft:conversations:* %R~preft:key:* %R~preft:keyid:* %R~preft:tenant:* resetchannels -@all +@read +@write +@transaction +@connection +evalsha +evalsha_ro +script|load +script|exists +time -@dangerous -scan -randomkey -function{{ end }}
{{- if eq .user "registry" }}resetkeys ~preft:tenant:* ~preft:tenants ~preft:key:* ~preft:keyid:* ~preft:keys ~preft:base:* ~preft:bases ~preft:adapter:* ~preft:adapters ~preft:blobrefs ~preft:blobtouch ~preft:gc:deleting ~preft:hot %R~preft:usage:* resetchannels -@all +@read +@write +@transaction +@connection +evalsha +evalsha_ro +script|load +script|exists -@dangerous -scan -randomkey -function{{ end }}
{{- if eq .user "engine" }}resetkeys ~preft:residency:* %R~preft:hot:specs resetchannels -@all +@read +@write +@transaction +@connection -@dangerous -scan -randomkey -function{{ end }}
{{- if eq .user "ray" }}resetkeys ~RAY* ~DUMMY resetchannels -@all +@connection +info +hget +hmget +hset +hsetnx +hdel +hscan +hexists +hkeys +hlen +incrby +del +exists +scan{{ end }}
{{- end }}

{{- define "preft.s3Env" -}}
{{- $ctx := .ctx }}
{{- $mode := include "preft.s3CredentialsMode" $ctx }}
{{- if ne $mode "none" }}
- name: {{ .prefix }}S3__ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "preft.s3SecretName" $ctx }}
      key: {{ if eq $mode "existing" }}{{ $ctx.Values.s3.existingSecretAccessKeyKey }}{{ else }}access-key{{ end }}
- name: {{ .prefix }}S3__SECRET_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "preft.s3SecretName" $ctx }}
      key: {{ if eq $mode "existing" }}{{ $ctx.Values.s3.existingSecretSecretKeyKey }}{{ else }}secret-key{{ end }}
{{- end }}
{{- end }}

{{/* Config entries shared by the services' ConfigMaps. Call with (dict "ctx" $ "prefix" "PREFT_ENGINE__"). ----- */}}

{{- define "preft.storeConfig" -}}
{{- $ctx := .ctx }}
{{- if eq (include "preft.redisMode" $ctx) "internal" }}
{{ .prefix }}REDIS__URL: {{ printf "redis://%s-redis:6379/0" (include "preft.fullname" $ctx) | quote }}
{{- end }}
{{- with include "preft.s3Endpoint" $ctx }}
{{ $.prefix }}S3__ENDPOINT_URL: {{ . | quote }}
{{- end }}
{{ .prefix }}S3__BUCKET: {{ $ctx.Values.s3.bucket | quote }}
{{ .prefix }}S3__REGION: {{ $ctx.Values.s3.region | quote }}
{{- end }}

{{/* The model volume: the PVC, or an emptyDir that an init container fills (the tiny model, or the model fetched
from S3 or Hugging Face). Call with (dict "ctx" $ "tokenizerOnly" bool): the gateway's needs only the tokenizer. */}}

{{- define "preft.modelVolume" -}}
{{- $ctx := .ctx }}
- name: models
{{- if eq $ctx.Values.model.source "pvc" }}
  persistentVolumeClaim: {claimName: {{ required "model.existingClaim is required when model.source=pvc" $ctx.Values.model.existingClaim }}, readOnly: true}
{{- else if and (has $ctx.Values.model.source (list "s3" "hf")) (not .tokenizerOnly) }}
  emptyDir: {sizeLimit: {{ $ctx.Values.model.cacheSizeLimit }}}
{{- else }}
  emptyDir: {sizeLimit: 256Mi}
{{- end }}
{{- end }}

{{/* The init container that fetches the model (model.source=s3|hf) into the models volume, checked against its
digests, and links it at the model directory (`python -m preft.common.model_source`). Call with (dict "ctx" $
"image" <image values> "tokenizerOnly" bool "readOnlyRoot" bool). */}}
{{- define "preft.fetchModelInit" -}}
{{- $ctx := .ctx }}
{{- $m := $ctx.Values.model }}
- name: fetch-model
  image: {{ include "preft.image" .image }}
  imagePullPolicy: {{ .image.pullPolicy }}
  command: ["python", "-m", "preft.common.model_source", "fetch", "--cache-dir", "/models/.cache", "--link", {{ include "preft.modelDir" $ctx | quote }}]
  env:
    - {name: HOME, value: /tmp}
    - {name: PREFT_MODEL__SOURCE, value: {{ required "model.uri is required when model.source is s3 or hf" $m.uri | quote }}}
    - {name: PREFT_MODEL__TOKENIZER_ONLY, value: {{ .tokenizerOnly | quote }}}
    {{- if eq $m.source "s3" }}
    {{- with include "preft.s3Endpoint" $ctx }}
    - {name: PREFT_MODEL__S3__ENDPOINT_URL, value: {{ . | quote }}}
    {{- end }}
    - {name: PREFT_MODEL__S3__REGION, value: {{ $ctx.Values.s3.region | quote }}}
    {{- include "preft.s3Env" (dict "ctx" $ctx "prefix" "PREFT_MODEL__") | nindent 4 }}
    {{- else if $m.hfTokenSecret }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef: {name: {{ $m.hfTokenSecret }}, key: token}
    {{- end }}
  resources: {requests: {cpu: 250m, memory: 512Mi}, limits: {cpu: "2", memory: 2Gi}}
  securityContext:
    {{- toYaml (set (deepCopy $ctx.Values.containerSecurityContext) "readOnlyRootFilesystem" .readOnlyRoot) | nindent 4 }}
  volumeMounts:
    - {name: models, mountPath: /models}
    {{- if .readOnlyRoot }}
    - {name: tmp, mountPath: /tmp}
    {{- end }}
{{- end }}

{{/* The init containers that fill the models volume, if the source needs one. Same arguments as fetchModelInit. */}}
{{- define "preft.modelInit" -}}
{{- if eq .ctx.Values.model.source "tiny" }}
{{- include "preft.tinyModelInit" . }}
{{- else if has .ctx.Values.model.source (list "s3" "hf") }}
{{- include "preft.fetchModelInit" . }}
{{- end }}
{{- end }}

{{- define "preft.modelDir" -}}
/models/{{ .Values.model.path }}
{{- end }}

{{/* The init container that writes the tiny generated model (model.source=tiny). Call with (dict "ctx" $ "readOnlyRoot" bool). */}}
{{- define "preft.tinyModelInit" -}}
{{- $ctx := .ctx }}
- name: tiny-model
  image: {{ include "preft.image" $ctx.Values.image.engine }}
  imagePullPolicy: {{ $ctx.Values.image.engine.pullPolicy }}
  command: ["python", "-c", "from preft.devtools.tiny import build_model; build_model({{ include "preft.modelDir" $ctx | squote }})"]
  env:
    - {name: HOME, value: /tmp}
  resources: {requests: {cpu: 250m, memory: 1Gi}, limits: {cpu: "1", memory: 2Gi}}
  securityContext:
    {{- toYaml (set (deepCopy $ctx.Values.containerSecurityContext) "readOnlyRootFilesystem" .readOnlyRoot) | nindent 4 }}
  volumeMounts:
    - {name: models, mountPath: /models}
    {{- if .readOnlyRoot }}
    - {name: tmp, mountPath: /tmp}
    {{- end }}
{{- end }}

{{/* Bytes in a Kubernetes quantity with a binary suffix (Ki, Mi, Gi, Ti) or none: for the disk tier's capacity. */}}
{{- define "preft.quantityBytes" -}}
{{- $q := toString . }}
{{- $units := dict "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 }}
{{- $out := "" }}
{{- range $suffix, $mult := $units }}
{{- if hasSuffix $suffix $q }}
{{- $out = mulf (float64 (trimSuffix $suffix $q)) $mult }}
{{- end }}
{{- end }}
{{- if eq (toString $out) "" }}{{ $out = float64 $q }}{{ end }}
{{- $out }}
{{- end }}
