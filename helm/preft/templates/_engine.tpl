{{/* The engine's settings and its Serve config. ------------------------------------------------------------------

Every non-secret engine setting travels in serveConfigV2 (the application's `args`, which
`preft.engine.serve_app:app_builder` validates into EngineSettings): a change edits serveConfigV2 alone, and KubeRay
updates the Serve application in place on the running Ray cluster. The Ray pod templates carry only what is secret
(Secret references in env) and what the pods themselves need, so they change only with the image or the pods' shape:
a new Ray cluster (NewCluster upgrade, twice the GPUs while it comes up) is then the rare case. */}}

{{/* The engine settings, as EngineSettings' nested field names. */}}
{{- define "preft.engineArgs" -}}
{{- $ctx := . }}
{{- $e := .Values.engine }}
{{- $fullname := include "preft.fullname" . }}
{{- $replica := dict "max_adapters_per_replica" (int $e.maxCpuLoras) "num_gpus_per_replica" (float64 $e.gpusPerReplica) "metrics_tenant_label" $e.metricsTenantLabel "graceful_shutdown_timeout_s" (float64 $e.serve.gracefulShutdownTimeoutSeconds) }}
{{- $s3 := dict "bucket" .Values.s3.bucket "region" .Values.s3.region }}
{{- with include "preft.s3Endpoint" . }}{{ $_ := set $s3 "endpoint_url" . }}{{ end }}
{{- $args := dict "model_dir" (include "preft.modelDir" .) "disk_cache_dir" "/var/cache/preft-adapters" "disk_cache_max_bytes" (mulf 0.9 (include "preft.quantityBytes" $e.workers.adapterCacheSizeLimit) | int64) "dtype" $e.dtype "load_format" $e.loadFormat "tensor_parallel_size" (int $e.tensorParallelSize) "registry_address" (printf "%s-registry:%d" $fullname (int .Values.registry.port)) "max_loras" (int $e.maxLoras) "max_cpu_loras" (int $e.maxCpuLoras) "replica" $replica "s3" $s3 }}
{{- if $e.maxModelLen }}{{ $_ := set $args "max_model_len" (int $e.maxModelLen) }}{{ end }}
{{- if eq (include "preft.redisMode" .) "internal" }}
{{- $_ := set $args "redis" (dict "url" (printf "redis://%s-redis:6379/0" $fullname)) }}
{{- end }}
{{- /* engine.env: KEY or NESTED__KEY (PREFT_ENGINE__ left off) -> nested args */}}
{{- range $k, $v := $e.env }}
{{- $parts := splitList "__" (lower $k) }}
{{- $node := $args }}
{{- range $i, $p := initial $parts }}
{{- if not (kindIs "map" (get $node $p)) }}{{ $_ := set $node $p (dict) }}{{ end }}
{{- $node = get $node $p }}
{{- end }}
{{- $_ := set $node (last $parts) $v }}
{{- end }}
{{- $args = mergeOverwrite $args (deepCopy $e.settings) }}
{{- if and $e.metricsTenantLabel (not .Values.networkPolicies.enabled) }}
{{- fail "engine.metricsTenantLabel needs networkPolicies.enabled: Serve's and Ray's metrics ports would serve tenant ids to the whole cluster" }}
{{- end }}
{{- if and (gt (float64 $e.gpusPerReplica) 0.0) (lt (float64 $e.gpusPerReplica) (float64 $e.tensorParallelSize)) }}
{{- fail "engine.gpusPerReplica must be at least engine.tensorParallelSize (one GPU per shard)" }}
{{- end }}
{{- if gt (float64 $e.gpusPerReplica) (float64 $e.workers.gpus) }}
{{- fail "engine.gpusPerReplica must not exceed engine.workers.gpus: a replica's GPUs are on one worker pod" }}
{{- end }}
{{- toYaml $args }}
{{- end }}

{{/* The Serve config embedded in the RayService (serveConfigV2). With engine.serve.autoscaling.enabled Serve scales
the deployment (autoscaling_config) and num_replicas is left out; otherwise num_replicas is fixed (and
`preft-admin cluster scale engine N` edits it). */}}
{{- define "preft.serveConfig" -}}
{{- $s := .Values.engine.serve }}
{{- $deployment := dict "name" $s.deploymentName }}
{{- if $s.autoscaling.enabled }}
{{- $a := $s.autoscaling }}
{{- if gt (int $a.minReplicas) (int $a.maxReplicas) }}{{ fail "engine.serve.autoscaling.minReplicas must not exceed maxReplicas" }}{{ end }}
{{- $_ := set $deployment "autoscaling_config" (dict "min_replicas" (int $a.minReplicas) "max_replicas" (int $a.maxReplicas) "target_ongoing_requests" (float64 $a.targetOngoingRequests) "upscale_delay_s" (float64 $a.upscaleDelaySeconds) "downscale_delay_s" (float64 $a.downscaleDelaySeconds)) }}
{{- else }}
{{- $_ := set $deployment "num_replicas" (int $s.numReplicas) }}
{{- end }}
{{- $app := dict "name" $s.appName "route_prefix" $s.routePrefix "import_path" $s.importPath "args" (include "preft.engineArgs" . | fromYaml) "deployments" (list $deployment) }}
{{- $config := dict "proxy_location" "EveryNode" "http_options" (dict "host" "0.0.0.0" "port" 8000) "applications" (list $app) }}
{{- toYaml $config }}
{{- end }}

{{/* A Ray worker's preStop: ask Ray to drain the node (Serve starts replacements on other workers, then stops the
replicas here, each finishing its streams for up to engine.serve.gracefulShutdownTimeoutSeconds), wait until no Serve
replica runs in the pod, then stop Ray. Kubernetes kills the pod at terminationGracePeriodSeconds regardless. */}}
{{- define "preft.workerPreStop" -}}
{{- $grace := int .Values.engine.workers.terminationGracePeriodSeconds }}
{{- if lt $grace (add (int .Values.engine.serve.gracefulShutdownTimeoutSeconds) 30) }}
{{- fail "engine.workers.terminationGracePeriodSeconds must exceed engine.serve.gracefulShutdownTimeoutSeconds by 30 s at least (the drain's own steps)" }}
{{- end -}}
ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --reason-message "pod $HOSTNAME terminating" --deadline-remaining-seconds {{ sub $grace 10 }} || true; sleep 5; while grep -qs 'ray::Serve[R]eplica' /proc/[0-9]*/cmdline; do sleep 2; done; ray stop
{{- end }}

{{/* What the Ingress and the HTTPRoute route to the gateway: its API and health check, not /metrics. */}}
{{- define "preft.publicPaths" -}}
- {path: /v1, type: Prefix}
- {path: /healthz, type: Exact}
{{- end }}

{{/* nginx's body limit: the largest upload the gateway takes (its max_adapter_upload_bytes, 512 MiB unless
gateway.env sets MAX_ADAPTER_UPLOAD_BYTES; files are smaller) plus 1 MiB of multipart framing, in MiB. */}}
{{- define "preft.maxBodySize" -}}
{{- $bytes := int64 (default 536870912 .Values.gateway.env.MAX_ADAPTER_UPLOAD_BYTES) }}
{{- $files := int64 (default 209715200 .Values.gateway.env.FILES_MAX_BYTES) }}
{{- if gt $files $bytes }}{{ $bytes = $files }}{{ end }}
{{- printf "%dm" (add1 (div (add $bytes 1048575) 1048576)) }}
{{- end }}
