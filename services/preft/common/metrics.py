"""Every Prometheus metric of the platform, declared once (prefix `preft_`, base units, bounded labels).

Label values are bounded: tenant ids (operators create them; on the engine's metrics only with
`ReplicaSettings.metrics_tenant_label`, as its ports serve them), method (lora|direft|none), mode (prefill|all|base),
tier (gpu|host|disk|s3), reason (a fixed vocabulary per service), a batch's status and a line's outcome, a
file's purpose. No request ids, no adapter names, no batch or file ids.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# Fine enough that histogram_quantile reads a saturated GPU engine's TTFT (seconds) and decode gaps (tens of ms)
# within ~20%: the platform benchmark reports p50/p95 from these buckets.
LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.35, 0.5, 0.75, 1, 1.5, 2, 2.5, 3.5, 5, 7.5, 10, 15, 30, 60, 120
)  # fmt: skip
TOKEN_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.06, 0.075, 0.1, 0.15,
    0.25, 0.5, 1, 2.5,
)  # fmt: skip

# -- traffic (engine replicas; the gateway counts the same requests under gateway_*) -----------------------------
REQUESTS = Counter("preft_requests_total", "Generation requests finished", ["tenant", "method", "mode", "outcome"])
PROMPT_TOKENS = Counter("preft_prompt_tokens_total", "Prompt tokens processed", ["tenant", "method", "mode"])
GENERATED_TOKENS = Counter("preft_generated_tokens_total", "Tokens generated", ["tenant", "method", "mode"])
TIME_TO_FIRST_TOKEN = Histogram(
    "preft_time_to_first_token_seconds", "Request arrival to first token", ["mode"], buckets=LATENCY_BUCKETS_S
)
INTER_TOKEN_LATENCY = Histogram(
    "preft_inter_token_latency_seconds", "Gap between streamed tokens", ["mode"], buckets=TOKEN_LATENCY_BUCKETS_S
)
END_TO_END = Histogram(
    "preft_request_duration_seconds", "Request arrival to last token", ["mode"], buckets=LATENCY_BUCKETS_S
)
TOKENS_PER_SECOND = Gauge(
    "preft_tokens_per_second", "Prompt+generated tokens per second over the last window, by mode", ["mode"]
)
QUEUE_DEPTH = Gauge("preft_queue_depth", "Requests accepted and not finished", ["service"])

# -- adapter paging (engine replicas) ----------------------------------------------------------------------------
PAGING_HITS = Counter("preft_paging_hits_total", "Adapter found in this tier", ["tier"])
PAGING_MISSES = Counter("preft_paging_misses_total", "Adapter not in this tier", ["tier"])
PAGING_EVICTIONS = Counter("preft_paging_evictions_total", "Adapters evicted from this tier", ["tier"])
PAGING_LOAD_SECONDS = Histogram(
    "preft_paging_load_seconds", "Time to bring an adapter into this tier", ["tier"], buckets=LATENCY_BUCKETS_S
)
PAGING_RESIDENT_BYTES = Gauge("preft_paging_resident_bytes", "Adapter bytes held in this tier", ["tier"])
PAGING_RESIDENT_ADAPTERS = Gauge("preft_paging_resident_adapters", "Adapters held in this tier", ["tier"])
ADAPTER_LOAD_FAILURES = Counter(
    "preft_adapter_load_failures_total",
    "Adapter loads into a replica that failed, by the error's gRPC status name in lower case (unavailable: the blob "
    "store or the disk cache; invalid_argument: the adapter does not fit the model; internal: anything else)",
    ["reason"],
)
ADAPTER_WEIGHT_UPDATES = Counter(
    "preft_adapter_weight_updates_total",
    "In-place adapter weight updates (and restores) on a replica, by the outcome's gRPC status name in lower case "
    "(ok; invalid_argument: weights that do not fit; not_found, permission_denied, failed_precondition, "
    "resource_exhausted: refused; unavailable, internal)",
    ["outcome"],
)
ADAPTER_WEIGHT_UPDATE_SECONDS = Histogram(
    "preft_adapter_weight_update_seconds",
    "From an update's call to its weights serving (waits for prompts of the adapter already running included)",
    buckets=LATENCY_BUCKETS_S,
)
LIVE_ADAPTERS = Gauge("preft_live_adapters", "Adapters serving weights updated in place (pinned in host memory)")

# -- stores (any service: the registry, the engines' downloads, the gateway's files) ---------------------------------
STORE_ERRORS = Counter(
    "preft_store_errors_total",
    "Calls to a store that failed because it was unreachable or timed out (store: redis or s3)",
    ["store"],
)
BLOB_BYTES = Counter(
    "preft_blob_bytes_total",
    "Adapter blob bytes this process moved to or from the blob store (direction: upload or download)",
    ["direction"],
)

# -- registry (served on its metrics_address) ----------------------------------------------------------------------
REGISTRY_RPCS = Counter(
    "preft_registry_rpcs_total", "Registry RPCs answered, by method and gRPC status code", ["method", "code"]
)
REGISTRY_RPC_SECONDS = Histogram(
    "preft_registry_rpc_duration_seconds", "Registry RPC time, arrival to answer", ["method"], buckets=LATENCY_BUCKETS_S
)
REGISTRY_INDEX_ENTRIES = Gauge(
    "preft_registry_index_entries",
    "Entries in the registry's index, read from Redis on scrape (kind: tenants, adapters, base_models, blobs)",
    ["kind"],
)

# -- gateway -----------------------------------------------------------------------------------------------------
GATEWAY_REQUESTS = Counter("preft_gateway_requests_total", "HTTP requests answered", ["route", "status_class"])
GATEWAY_ERRORS = Counter("preft_gateway_errors_total", "4xx/5xx answers by reason", ["status", "reason"])
GATEWAY_OVERHEAD = Histogram(
    "preft_gateway_overhead_seconds",
    "Gateway time before the engine is called (auth, limits, resolve, tokenize)",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
)
ENGINE_RETRIES = Counter("preft_gateway_engine_retries_total", "Requests retried on another replica", ["reason"])
BACKGROUND_RUNNING = Gauge("preft_gateway_background_responses", "Background responses this replica runs")
BACKGROUND_ENDED = Counter(
    "preft_gateway_background_responses_ended_total", "Background responses ended, by how", ["status"]
)
METERING_COARSENED = Counter(
    "preft_gateway_metering_coarsened_total",
    "Token usage entries folded from minutes into hours: the meter held its most entries while Redis was unreachable",
)
METERING_DROPPED = Counter(
    "preft_gateway_metering_dropped_total",
    "Answered requests left out of the token usage: the meter held its most entries while Redis was unreachable",
)

# -- gateway: files and batches (labels: status and outcome are fixed vocabularies, purpose the Files API's) ---------
FILE_BYTES_STORED = Counter(
    "preft_gateway_file_bytes_stored_total", "Bytes of files stored in S3 (uploads and batch outputs)", ["purpose"]
)
FILES_EXPIRED = Counter(
    "preft_gateway_files_expired_total", "Expired files removed by the gateways' sweepers (Redis and S3)", ["purpose"]
)
BATCHES_CREATED = Counter("preft_gateway_batches_created_total", "Batches created through POST /v1/batches")
BATCHES_RUNNING = Gauge("preft_gateway_batches_running", "Batches this gateway replica runs (holds the lease of)")
BATCHES_ENDED = Counter(
    "preft_gateway_batches_ended_total",
    "Batches ended, by final status (completed, failed, expired, cancelled)",
    ["status"],
)
BATCH_LINES = Counter(
    "preft_gateway_batch_lines_total", "Batch requests answered, by outcome (completed, failed, expired)", ["outcome"]
)
BATCH_SLOTS_HELD = Gauge(
    "preft_gateway_batch_slots_held",
    "Slots of the fleet's cap on batch requests at the engines (batches_max_lines_in_flight) this replica holds",
)
BATCH_SLOTS_WAIT = Histogram(
    "preft_gateway_batch_slots_wait_seconds",
    "How long a batch line waited for its slots of the fleet's cap (0 where it took them at once)",
    buckets=(0.001, 0.01, 0.1, 0.5, 1, 5, 15, 60, 300),
)
BATCH_TAKEOVERS = Counter(
    "preft_gateway_batch_takeovers_total", "Batches this replica took on after another replica had begun them"
)
