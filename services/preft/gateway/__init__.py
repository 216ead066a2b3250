"""The OpenAI-compatible gateway: API keys, per-tenant rate limits, adapter resolution, and the hop to the engine.

    PREFT_GATEWAY__REGISTRY_TOKEN=... PREFT_GATEWAY__MODEL_DIR=/models/base PREFT_GATEWAY__SERVED_MODEL_NAME=llama \\
    PREFT_GATEWAY__ENGINE_URL=http://ray-head:8000 PREFT_GATEWAY__REDIS__URL=redis://redis:6379/0 \\
        python -m preft.gateway

Sub-packages, each over the ones below it (import-linter checks the order), each with its own settings part, its
`wiring` (`start`: its collaborators in the lifespan; `wire`: its routes) and its typed dependencies (`deps`):

- `core`: settings, key -> tenant (`auth`), tenant buckets and quotas (`limits`), `model` -> adapter version and mode
  (`resolution`), the engine and registry clients, the tokenizer and its guard, metering, `errors` (the only place
  errors become HTTP), health and metrics.
- `openai`: completions and chat (tools, logprobs, thinking), tokenize, models; `generation` owns the order of checks
  around the engine call, `chat` and `completions` are the services that answer (`answers`: whole or streamed).
- `responses`: OpenAI's Responses and Conversations APIs over the chat service, stored responses, background runs.
- `files`: OpenAI's Files API (contents in S3, metadata in Redis), with an S3 bucket (`PREFT_GATEWAY__S3__*`).
- `batches`: OpenAI's Batch API: any replica runs any batch under a lease (`runner`, state in `store`); its lines are
  answered by the same services as live requests (`lines`), their tokens metered with the part that records them.
- `manage`: tenants' adapters, shares and token usage.

`create_app(settings)` (in `app`) is the table of contents; nothing heavy is imported here: the tokenizer, Redis,
gRPC and HTTP clients are built in the app's lifespan. `testing` holds the stub engine used by the tests and the
benchmark.
"""
