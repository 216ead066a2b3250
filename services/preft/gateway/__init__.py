"""The OpenAI-compatible gateway: API keys, per-tenant rate limits, adapter resolution, and the hop to the engine.

    PREFT_GATEWAY__REGISTRY_TOKEN=... PREFT_GATEWAY__MODEL_DIR=/models/base PREFT_GATEWAY__SERVED_MODEL_NAME=llama \\
    PREFT_GATEWAY__ENGINE_URL=http://ray-head:8000 PREFT_GATEWAY__REDIS__URL=redis://redis:6379/0 \\
        python -m preft.gateway

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream`), GET /v1/models[/{model}],
GET /healthz, /readyz, /metrics. A request's path: key -> tenant (`auth`), prompt -> token ids
(`tokenization`), tenant buckets (`limits`), `model` -> adapter version and mode (`resolution`), then the engine
(`engine_client`); `generation` owns that order, `errors` is the only place errors become HTTP. Settings are in
`settings` (every field documented); `testing` holds the stub engine used by the tests and the benchmark.

With an S3 bucket (`PREFT_GATEWAY__S3__*`), OpenAI's Files API (`files`: contents in S3, metadata in Redis) and Batch
API: a batch's lines are answered as live requests of their endpoint (`batch_lines`), by whichever replica holds the
batch's lease (`batches`, state in `batch_store`, input checks in `batch_input`).

`create_app(settings)` (in `app`) builds the FastAPI application; nothing heavy is imported here: the tokenizer,
Redis, gRPC and HTTP clients are built in the app's lifespan.
"""
