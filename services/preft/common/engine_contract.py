"""The internal contract between the gateway and engine replicas (HTTP + JSON through the Ray Serve proxy).

    POST /generate
    header authorization: Bearer <engine token>: the secret the gateway and the engine share (else 401); only the
        gateway may spend the engine's capacity or pick a request's cache salt and priority
    header serve_multiplexed_model_id: <adapter content digest> (or "base"): Ray Serve routes to a replica that
        already holds the adapter when one is not overloaded
    body: EngineRequest (JSON)

GET /healthz and GET /metrics need no token (probes and Prometheus).

Non-streaming answers are one EngineResponse. Streaming answers (`stream: true`) are newline-delimited JSON:
EngineChunk lines, the last one with `finish_reason` and `usage` set. Errors are an HTTP status with an
EngineError body: 400 (the request or adapter is invalid), 503 (the adapter cannot be fetched now, or the replica
is draining; retrying elsewhere may work), 500 (a bug).

A request's `cache_salt` is vLLM's: requests share cached prompt KV blocks only with requests of the same salt. The
gateway derives it from the tenant (`preft.gateway.core.cache_salt`), so one tenant's prompts never warm (or reveal
themselves through the timing of) another's; it is never taken from a client.

A request's `priority` is vLLM's (lower first): live requests are LIVE_PRIORITY, a batch's lines OFFLINE_PRIORITY, so
an engine with the priority scheduling policy admits queued live requests before queued batch work.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from preft.common.modes import PositionMode

BASE_MODEL_ID = "base"  # the multiplexed model id of requests without an adapter
MULTIPLEX_HEADER = "serve_multiplexed_model_id"
AUTH_HEADER = "authorization"  # "Bearer <engine token>" on /generate


def bearer(token: str) -> str:
    """The authorization header's value that carries `token`."""
    return f"Bearer {token}"


LIVE_PRIORITY = 0  # vLLM's scheduling priority of interactive requests (lower is scheduled first)
OFFLINE_PRIORITY = 1  # of offline work (a batch's lines): behind every queued live request


class AdapterFileSpec(BaseModel):
    """One file of the adapter version, as the registry's manifest lists it."""

    path: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size_bytes: int = Field(ge=0)


class AdapterSpec(BaseModel):
    """Which adapter version to apply: enough for a replica to fetch it (digest-checked) without the registry."""

    digest: str = Field(pattern=r"^[0-9a-f]{64}$", description="Content digest; the multiplexed model id")
    method: Literal["lora", "direft"]
    files: list[AdapterFileSpec]
    ref: str = Field(description="tenant/name@vN, for logs")


MAX_LOGPROBS = 20  # alternatives per generated token at most (the engine's vLLM max_logprobs)
MAX_LOGIT_BIASES = 300  # token ids a request may bias (OpenAI's limit)
LogitBias = Annotated[float, Field(ge=-100.0, le=100.0)]
MAX_CONSTRAINT_CHARS = 32_768  # a constraint's schema (as JSON), regex or grammar
MAX_CONSTRAINT_CHOICES = 64
MAX_REPETITION_PENALTY = 10.0
MAX_STOP_TOKEN_IDS = 32
MAX_ALLOWED_TOKEN_IDS = 1024
MAX_BAD_WORDS = 64  # (each word is tokenized alone and after a space: vLLM 0.28 takes up to 128 such sequences)
# A seed vLLM takes as given: it sends a request to its engine core as msgpack (ints in [-2**63, 2**64 - 1], else
# OverflowError), its V2 model runner keeps seeds in an int64 array, and SamplingParams reads -1 as "no seed".
# (On the CPU, torch's generator uses only the low 32 bits; CUDA's Philox the whole seed.)
MAX_SEED = 2**63 - 1
MAX_COUNT = 2**31 - 1  # token counts and top_k: vLLM keeps them in int32 arrays


def _not_blank(word: str) -> str:
    if not word.strip():
        raise ValueError("a bad word must have a character other than whitespace")
    return word


BadWord = Annotated[str, Field(min_length=1, max_length=256), AfterValidator(_not_blank)]


def check_min_tokens(min_tokens: int, max_tokens: int) -> None:
    """ValueError where min_tokens exceeds the generation's max_tokens (the gateway, the serving and the offline
    engine's requests all hold to it)."""
    if min_tokens > max_tokens:
        raise ValueError(f"min_tokens ({min_tokens}) exceeds max_tokens ({max_tokens})")


def _schema_from_text(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as e:
            raise ValueError(f"not JSON: {e}") from None
    return value


def _valid_schema(schema: dict[str, Any]) -> dict[str, Any]:
    if len(json.dumps(schema)) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"the schema is longer than {MAX_CONSTRAINT_CHARS} characters as JSON")
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise ValueError(f"not a valid JSON Schema{f' at {where}' if where else ''}: {e.message}") from None
    return schema


# A JSON Schema: an object, or that object as a JSON string; checked against its meta-schema
JsonSchema = Annotated[dict[str, Any], BeforeValidator(_schema_from_text), AfterValidator(_valid_schema)]

# a constraint's kinds as sent (vLLM's names) → their fields
CONSTRAINT_KINDS = {
    "json": "json_schema",
    "json_object": "json_object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


class OutputConstraint(BaseModel):
    """What the generated text must match, enforced token by token while sampling (vLLM's structured outputs: xgrammar,
    or guidance where xgrammar lacks a feature): exactly one kind. A schema that is not valid JSON Schema is refused
    here; one the backend cannot compile (or a bad regex or grammar) is refused by the engine before it runs."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: JsonSchema | None = Field(None, alias="json", description="A JSON Schema the text satisfies")
    json_object: Literal[True] | None = Field(None, description="True: the text is one JSON object")
    regex: str | None = Field(None, min_length=1, max_length=MAX_CONSTRAINT_CHARS, description="A regular expression")
    choice: list[Annotated[str, Field(min_length=1, max_length=1024)]] | None = Field(
        None, min_length=1, max_length=MAX_CONSTRAINT_CHOICES, description="The text is one of these strings"
    )
    grammar: str | None = Field(
        None, min_length=1, max_length=MAX_CONSTRAINT_CHARS, description="A context-free grammar (EBNF / GBNF)"
    )

    @field_validator("json_object", mode="before")
    @classmethod
    def _false_is_absent(cls, value: Any) -> Any:
        return None if value is False else value

    @model_validator(mode="after")
    def _exactly_one(self) -> OutputConstraint:
        given = [kind for kind, name in CONSTRAINT_KINDS.items() if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(CONSTRAINT_KINDS)} (given: {', '.join(given) or 'none'})")
        return self

    def vllm_fields(self) -> dict[str, Any]:
        """The keyword arguments of vLLM's StructuredOutputsParams."""
        return self.model_dump(by_alias=True, exclude_none=True)


class SamplingOptions(BaseModel):
    """How a generation picks its tokens and what it returns beside them (vLLM's SamplingParams, less the length):
    the serving engine's requests and the offline engine's take the same ones."""

    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Subtracted from the logit of each token already generated"
    )
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Subtracted from each token's logit once per time it was generated"
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        le=MAX_REPETITION_PENALTY,
        description="The logit of each token in the prompt or generated so far divided by it (multiplied where the "
        "logit is negative); 1: none",
    )
    top_k: int = Field(0, ge=0, le=MAX_COUNT, description="Sample among this many most likely tokens only (0: all)")
    min_p: float = Field(
        0.0, ge=0.0, le=1.0, description="Leave out tokens less likely than min_p times the most likely one (0: none)"
    )
    min_tokens: int = Field(
        0, ge=0, le=MAX_COUNT, description="Tokens to generate before the end-of-sequence or a stop token may"
    )
    stop_token_ids: list[int] = Field(
        default_factory=list, max_length=MAX_STOP_TOKEN_IDS, description="Token ids that end the answer (kept in it)"
    )
    allowed_token_ids: list[int] = Field(
        default_factory=list, max_length=MAX_ALLOWED_TOKEN_IDS, description="The only tokens to generate (none: any)"
    )
    bad_words: list[BadWord] = Field(
        default_factory=list,
        max_length=MAX_BAD_WORDS,
        description="Words never generated: the last of a word's tokens (alone, and after a space where that is as "
        "many tokens) is left out wherever the tokens before it were just generated",
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Return each generated token's log-probability and this many most likely tokens at its position",
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Return each prompt token's log-probability after the tokens before it (all but the first) and "
        "this many most likely tokens at its position",
    )
    logit_bias: dict[int, LogitBias] = Field(
        default_factory=dict, max_length=MAX_LOGIT_BIASES, description="Added to these token ids' logits"
    )
    constraint: OutputConstraint | None = Field(None, description="What the generated text must match")
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: list[str] = Field(default_factory=list, max_length=8)
    include_stop_str_in_output: bool = Field(False, description="Keep the stop string that ended the answer in it")
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the text")
    spaces_between_special_tokens: bool = Field(True, description="A space between adjacent special tokens' text")
    ignore_eos: bool = False


class EngineRequest(SamplingOptions):
    """One generation, already tokenized and authorized by the gateway."""

    request_id: str
    prompt_token_ids: list[int] = Field(min_length=1)
    max_tokens: int = Field(ge=1, le=MAX_COUNT)
    stream: bool = False
    adapter: AdapterSpec | None = None
    mode: PositionMode = PositionMode.PREFILL
    tenant: str = Field("", description="For metrics labels only")
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="vLLM's prefix-cache salt: cached prompt blocks are shared only among requests with the same one "
        "(None: with every request without one)",
    )
    priority: int = Field(
        LIVE_PRIORITY,
        ge=LIVE_PRIORITY,
        le=OFFLINE_PRIORITY,
        description="vLLM's scheduling priority, lower first: LIVE_PRIORITY, or OFFLINE_PRIORITY for a batch's lines "
        "(an engine with the fcfs scheduling policy ignores it)",
    )

    @model_validator(mode="after")
    def _min_within_max(self) -> EngineRequest:
        check_min_tokens(self.min_tokens, self.max_tokens)
        return self


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = Field(0, description="Prompt tokens whose KV came from the prefix cache (vLLM's count)")


FinishReason = Literal["stop", "length", "abort"]


class TopLogprob(BaseModel):
    """One of the most likely tokens at a position."""

    token_id: int
    token: str = Field(description="The token's text ('' where the engine has no tokenizer)")
    logprob: float


class TokenLogprob(BaseModel):
    """A generated token's log-probability under the model (its logits before sampling's penalties and
    temperature), and the `logprobs` most likely tokens at its position, most likely first."""

    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob] = Field(default_factory=list)


class EngineChunk(BaseModel):
    """A streamed piece of output; the last one carries finish_reason and usage. `logprobs`: one per token id, where
    the request asked for them; `prompt_logprobs`: in the first chunk, one per prompt token but the first, where
    asked."""

    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


class EngineResponse(BaseModel):
    """The whole output of a non-streaming request."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason
    usage: Usage


class EngineError(BaseModel):
    """Body of an error answer."""

    type: Literal["invalid_request", "unavailable", "internal", "unauthenticated"]
    message: str
