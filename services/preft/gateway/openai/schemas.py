"""Request bodies of the OpenAI-compatible routes (the subset the engine can honour) and their PreFT extensions.

Fields the engine cannot honour are refused with a 400 naming them when they ask for something (suffix,
functions, ...), rather than silently ignored; numbers are bounded to what the engine takes (outside: a 400 naming
the field). Unknown fields are ignored, as OpenAI clients send new optional fields over time. Extensions, sent by
OpenAI clients through `extra_body`:
- `preft_mode`: "prefill" | "all", the adapter's position mode (only where the operator allows it),
- `ignore_eos`: keep generating after the end-of-sequence token (benchmarks),
- `structured_outputs`: vLLM's constraint object (one of json, json_object, regex, choice, grammar), where
  OpenAI's `response_format` (JSON only) is not enough,
- `service_tier` on completions (OpenAI's field of chat and Responses requests): see `ServiceTier`.
"""

from __future__ import annotations

import dataclasses
import json
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from preft.common.engine_contract import (
    LIVE_PRIORITY,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_COUNT,
    MAX_LOGIT_BIASES,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_STOP_TOKEN_IDS,
    OFFLINE_PRIORITY,
    BadWord,
    JsonSchema,
    LogitBias,
    OutputConstraint,
)
from preft.common.errors import InvalidArgument
from preft.common.modes import PositionMode
from preft.gateway.openai.tools import (
    MAX_TOOLS,
    FunctionName,
    FunctionSpec,
    NamedToolChoice,
    ToolChoice,
    ToolPlan,
    ToolSpec,
)

MAX_STOP_SEQUENCES = 4
EXAMPLE_MODEL = "my-adapter"  # the `model` of the request bodies' examples in /openapi.json
MAX_CHOICES = 8  # n (and best_of) at most: each sample is an engine request of its own
MAX_SAMPLES = 256  # engine requests one request may make (a batch of prompts × their samples)
# vLLM's request fields that change what is generated and that this server does not implement, with vLLM's default:
# a request that asks for other than the default is refused (400), not served as if the field were not there
VLLM_FIELDS_NOT_SUPPORTED: dict[str, Any] = {
    "guided_json": None,  # (vLLM's former constraint fields: structured_outputs now)
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
    "guided_json_object": None,
    "use_beam_search": False,
    "length_penalty": 1.0,
    # (the gateway sets each tenant's own, preft.gateway.core.cache_salt: a client asking for a salt of its choosing is
    # refused, not served as if its prompts were cached apart as it asked)
    "cache_salt": None,
}


# OpenAI's processing tier of a request (its values; scale, priority and fast are tiers this server does not have)
ServiceTier = Annotated[
    Literal["auto", "default", "flex", "scale", "priority", "fast"] | None,
    Field(
        description="flex: the request's engine requests wait behind other live requests at the engine (slower when "
        "the engine is busy; rate limits as any); the others, or none, are served as default"
    ),
]
ServedTier = Literal["default", "flex"]


def tier_served(asked: str | None) -> ServedTier:
    """The tier a request is served in, as its answer names it: flex where it asked for flex, else default (scale,
    priority and fast too, as OpenAI serves projects without those tiers)."""
    return "flex" if asked == "flex" else "default"


class StreamOptions(BaseModel):
    """`stream_options`: with include_usage, a last chunk carries the token counts."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: a named JSON Schema for the answer."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: JsonSchema | None = Field(None, alias="schema", description="None: any JSON object")
    strict: bool | None = Field(None, description="Accepted; the schema is always enforced")


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON satisfying a schema."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> OutputConstraint | None:
        if self.type == "text":
            return None
        if self.type == "json_schema":
            if self.json_schema is None:
                raise InvalidArgument("response_format: type json_schema needs a json_schema object")
            if self.json_schema.schema_ is not None:
                return OutputConstraint(json=self.json_schema.schema_)
        return OutputConstraint(json_object=True)


class GenerationBody(BaseModel):
    """What completions and chat requests share (fields it does not know are kept aside, and ignored unless they are
    vLLM's that ask for what this server does not do: `refuse_unsupported`)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=256, description="Base model name or adapter reference")
    max_tokens: int | None = Field(None, ge=1, le=MAX_COUNT, description="Most tokens to generate")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="Sampling temperature; default 1")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus sampling mass; default 1")
    seed: int | None = Field(
        None,
        ge=0,
        le=MAX_SEED,
        description="Sampling seed, 0 to 2**63 - 1 (vLLM's -1 would mean none); the j-th of n samples takes seed + j "
        "(modulo 2**63). The CPU engine's sampler (torch's CPU generator) uses only its low 32 bits",
    )
    stop: str | list[str] | None = Field(None, description=f"Up to {MAX_STOP_SEQUENCES} stop strings")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES, description="Choices to generate, each its own sample")
    presence_penalty: float | None = Field(
        None, ge=-2.0, le=2.0, description="Lowers the logit of each token already generated by this much"
    )
    frequency_penalty: float | None = Field(
        None, ge=-2.0, le=2.0, description="Lowers each token's logit by this much per time it was generated"
    )
    repetition_penalty: float | None = Field(
        None,
        gt=0.0,
        le=MAX_REPETITION_PENALTY,
        description="vLLM extension: divides the logit of each token in the prompt or generated so far (multiplies it "
        "where negative); 1: none",
    )
    top_k: int | None = Field(
        None, ge=-1, le=MAX_COUNT, description="vLLM extension: sample among the k most likely tokens (0, -1: all)"
    )
    min_p: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="vLLM extension: leave out tokens less likely than min_p × the most likely one",
    )
    min_tokens: int | None = Field(
        None,
        ge=0,
        le=MAX_COUNT,
        description="vLLM extension: tokens to generate before end-of-sequence or stop_token_ids may end it",
    )
    stop_token_ids: list[int] | None = Field(
        None, max_length=MAX_STOP_TOKEN_IDS, description="vLLM extension: token ids that end the answer (kept in it)"
    )
    include_stop_str_in_output: bool = Field(
        False, description="vLLM extension: keep the stop string that ended the answer in its text"
    )
    allowed_token_ids: list[int] | None = Field(
        None, max_length=MAX_ALLOWED_TOKEN_IDS, description="vLLM extension: the only tokens to generate"
    )
    bad_words: list[BadWord] | None = Field(
        None,
        max_length=MAX_BAD_WORDS,
        description="vLLM extension: words the answer never writes (as tokenized alone, or after a space)",
    )
    skip_special_tokens: bool = Field(True, description="vLLM extension: leave special tokens out of the text")
    spaces_between_special_tokens: bool = Field(
        True, description="vLLM extension: with skip_special_tokens false, a space between adjacent special tokens"
    )
    truncate_prompt_tokens: int | None = Field(
        None,
        ge=-1,
        le=MAX_COUNT,
        description="vLLM extension: keep only this many of the prompt's tokens (-1: as many as the server accepts)",
    )
    truncation_side: Literal["left", "right"] | None = Field(
        None,
        description="vLLM extension: with truncate_prompt_tokens, keep the last tokens (left, the default) or "
        "the first (right)",
    )
    logit_bias: dict[str, LogitBias] | None = Field(
        None, max_length=MAX_LOGIT_BIASES, description="Token id (as a string) → bias added to its logit, -100 to 100"
    )
    response_format: ResponseFormat | None = Field(None, description="text (default), json_object or json_schema")
    structured_outputs: OutputConstraint | None = Field(
        None, description="vLLM extension: what the text must match (json, json_object, regex, choice or grammar)"
    )
    preft_mode: PositionMode | None = Field(None, description="PreFT extension: the adapter's position mode")
    ignore_eos: bool = Field(False, description="PreFT extension: do not stop at the end-of-sequence token")
    service_tier: ServiceTier = None

    @property
    def tier_used(self) -> ServedTier:
        return tier_served(self.service_tier)

    def engine_priority(self, *, offline: bool) -> int:
        """vLLM's scheduling priority of the request's engine requests: a batch's line (`offline`) or a flex request
        waits behind live requests."""
        return OFFLINE_PRIORITY if offline or self.tier_used == "flex" else LIVE_PRIORITY

    def truncated(self, prompt_ids: list[int], max_prompt_tokens: int) -> list[int]:
        """The prompt's tokens as truncate_prompt_tokens keeps them (all when it is not given)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return prompt_ids
        if keep == -1:
            keep = max_prompt_tokens
        if len(prompt_ids) <= keep:
            return prompt_ids
        return prompt_ids[:keep] if self.truncation_side == "right" else prompt_ids[len(prompt_ids) - keep :]

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
            raise InvalidArgument(f"stop: at most {MAX_STOP_SEQUENCES} non-empty strings")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def refuse_unsupported(self) -> None:
        """400 naming the first field that asks for something the engine does not do."""
        extra = self.model_extra or {}
        vllms = {
            name: extra[name] not in (default, None, [])  # (null or an empty list: not asked either)
            for name, default in VLLM_FIELDS_NOT_SUPPORTED.items()
            if name in extra
        }
        for name, asked in {**self._unsupported(), **vllms}.items():
            if asked:
                raise InvalidArgument(f"{name} is not supported by this server")

    def _unsupported(self) -> dict[str, bool]:
        return {}

    def token_biases(self, vocab_size: int) -> dict[int, float]:
        """logit_bias by token id; 400 for a key that is not a token id of this model's vocabulary."""
        biases = {}
        for key, bias in (self.logit_bias or {}).items():
            token = int(key) if key.isascii() and key.isdigit() else -1
            if not 0 <= token < vocab_size:
                raise InvalidArgument(f"logit_bias: keys must be token ids in [0, {vocab_size}), not {key!r}")
            biases[token] = bias
        return biases

    def token_ids(self, field: str, vocab_size: int) -> list[int]:
        """A list of token ids the body gives (stop_token_ids, allowed_token_ids), checked against this model's
        vocabulary (400 for an id outside it)."""
        ids = list(getattr(self, field) or [])
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument(f"{field}: token ids in [0, {vocab_size}), not {bad[0]}")
        return ids

    def constraint(self) -> OutputConstraint | None:
        """What the generated text must match: `response_format` or `structured_outputs` (400 for both)."""
        by_format = self.response_format.constraint() if self.response_format is not None else None
        if by_format is not None and self.structured_outputs is not None:
            raise InvalidArgument("give response_format or structured_outputs, not both")
        return by_format or self.structured_outputs

    def samples(self) -> int:
        """Engine requests (samples) to make: one per choice."""
        return self.n or 1

    def engine_logprobs(self) -> int | None:
        """How many most likely tokens the engine returns beside each generated token's logprob (None: no
        logprobs)."""
        return None

    def engine_prompt_logprobs(self) -> int | None:
        """Likewise for the prompt's tokens (None: none)."""
        return None


class CompletionBody(GenerationBody):
    """POST /v1/completions."""

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"model": EXAMPLE_MODEL, "prompt": "Once upon a time", "max_tokens": 16}]}
    )

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="Text or token ids, or a list of such prompts (a batch: each prompt's choices in turn)"
    )
    echo: bool | None = Field(False, description="Answer the prompt's text (and with logprobs, its tokens') first")
    logprobs: int | None = Field(
        None, ge=0, le=5, description="Each token's logprob and this many most likely tokens at its position"
    )
    best_of: int | None = Field(
        None, ge=1, le=MAX_CHOICES, description="Samples to draw, of which the n most likely (per token) are answered"
    )
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts (one, or a batch); 400 where prompts × samples exceeds what one request may ask."""
        p = self.prompt
        batch = list(p) if isinstance(p, list) and p and isinstance(p[0], str | list) else [p]
        if len(batch) * self.samples() > MAX_SAMPLES:
            raise InvalidArgument(
                f"prompt: {len(batch)} prompts × {self.samples()} samples each is more than {MAX_SAMPLES} per request"
            )
        return batch  # type: ignore[return-value]

    def _unsupported(self) -> dict[str, bool]:
        return {
            "suffix": bool(self.suffix),
        }

    def samples(self) -> int:
        """best_of samples where it asks for more than n (not streamed: the best are known only at the end)."""
        n = super().samples()
        if self.best_of is None or self.best_of == n:
            return n
        if self.best_of < n:
            raise InvalidArgument(f"best_of ({self.best_of}) must be at least n ({n})")
        if self.stream:
            raise InvalidArgument("best_of: the best samples are known only at the end; it cannot be streamed")
        return self.best_of

    def engine_logprobs(self) -> int | None:
        if self.samples() > (self.n or 1):
            return self.logprobs or 0  # (the samples are ranked by their tokens' logprobs)
        return self.logprobs

    def engine_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None


class ContentPart(BaseModel):
    """One part of a message's content; only text parts are accepted."""

    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    """A call an assistant turn made: the function's name and its arguments as JSON text."""

    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str


class MessageToolCall(BaseModel):
    """One of an assistant turn's `tool_calls`."""

    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict[str, Any]:
        """As chat templates take it: the arguments as an object where they are one (templates write them as JSON)."""
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(BaseModel):
    """One turn of a conversation."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(None, description="An assistant turn's calls")
    tool_call_id: str | None = Field(None, description="A tool turn: the call it answers")
    function_call: FunctionCall | None = Field(None, description="Deprecated: an assistant turn's one call")

    def turn(self, call_id: str = "") -> dict[str, Any]:
        """The turn as chat templates take it; the deprecated function call and result as a tool call and a tool
        turn (`call_id`: the id that pairs them)."""
        if self.role == "function":
            if not self.name:
                raise InvalidArgument("messages: a function message needs the function's name")
            return {"role": "tool", "content": self.text(), "name": self.name, "tool_call_id": call_id}
        turn: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            turn["name"] = self.name  # (templates that know participants' names write it)
        calls = self.tool_calls or []
        if self.function_call is not None:
            calls = [*calls, MessageToolCall(id=call_id, function=self.function_call)]
        if calls:
            turn["tool_calls"] = [c.for_template() for c in calls]
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        return turn

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(p.type != "text" or p.text is None for p in self.content):
            raise InvalidArgument("messages: only text content parts are supported")
        return "\n".join(p.text for p in self.content if p.text is not None)


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]  # (vLLM's values)
# apply_chat_template's own arguments and the template's given variables: not for chat_template_kwargs to set
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip


def _no_reserved_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise ValueError(f"{', '.join(reserved)} cannot be set through chat_template_kwargs")
    return kwargs


TemplateKwargs = Annotated[
    dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=64)], Any],
    Field(max_length=32),
    AfterValidator(_no_reserved_kwargs),
]


class ChatBody(GenerationBody):
    """POST /v1/chat/completions."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"model": EXAMPLE_MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 16}]
        }
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_COUNT, description="Newer name of max_tokens")
    logprobs: bool | None = Field(False, description="Return each generated token's logprob")
    top_logprobs: int | None = Field(
        None, ge=0, le=20, description="With logprobs: this many most likely tokens at each position"
    )
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS, description="Functions the model may call")
    tool_choice: ToolChoice | None = Field(None, description="none, auto (the default with tools), required or a name")
    parallel_tool_calls: bool | None = Field(None, description="False: at most one call per answer")
    functions: list[FunctionSpec] | None = Field(
        None, max_length=MAX_TOOLS, description="Deprecated form of tools: one call per answer, as function_call"
    )
    function_call: Literal["none", "auto"] | FunctionName | None = Field(
        None, description="Deprecated form of tool_choice (with functions)"
    )
    continue_final_message: bool = Field(
        False, description="vLLM extension: the answer continues the last message, an assistant turn (a prefill)"
    )
    chat_template_kwargs: TemplateKwargs | None = Field(
        None, description="vLLM extension: variables for the chat template (e.g. Qwen3's enable_thinking)"
    )
    reasoning_effort: ReasoningEffort | None = Field(
        None, description="A thinking model's effort: the template's reasoning_effort, and enable_thinking unless none"
    )

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's variables: `chat_template_kwargs`, and with `reasoning_effort` (as vLLM gives it) that
        effort and `enable_thinking` (false for none), unless chat_template_kwargs set them."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        effort = {"reasoning_effort": self.reasoning_effort, "enable_thinking": self.reasoning_effort != "none"}
        return effort | (self.chat_template_kwargs or {})

    def conversation(self) -> list[dict[str, Any]]:
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise InvalidArgument("continue_final_message: the last message must be the assistant's, to continue")
        turns, call_id = [], ""
        for i, message in enumerate(self.messages):
            call_id = f"call_fn{i}" if message.function_call is not None else call_id  # (a function turn answers it)
            turns.append(message.turn(call_id))
        return turns

    @property
    def legacy_functions(self) -> bool:
        """The deprecated `functions`: the answer's call comes back as `function_call`."""
        return self.functions is not None

    @cached_property
    def tool_plan(self) -> ToolPlan | None:
        """How this request uses its tools (None: plain chat); the deprecated functions as tools, one call each."""
        if self.legacy_functions:
            if self.tools is not None or self.tool_choice is not None:
                raise InvalidArgument("functions: give tools or the deprecated functions, not both")
            tools = [ToolSpec(type="function", function=f) for f in self.functions or []]
            choice = self.function_call
            if isinstance(choice, FunctionName):
                choice = NamedToolChoice(type="function", function=choice)
            plan = ToolPlan.of(tools, choice, parallel=False)
            plan = None if plan is None else dataclasses.replace(plan, legacy=True)
        elif self.function_call is not None:
            raise InvalidArgument("function_call: give functions to choose from")
        else:
            plan = ToolPlan.of(self.tools, self.tool_choice, parallel=self.parallel_tool_calls is not False)
        return plan

    def constraint(self) -> OutputConstraint | None:
        by_tools = self.tool_plan.constraint() if self.tool_plan is not None else None
        given = super().constraint()
        if by_tools is not None and given is not None:
            raise InvalidArgument("tool_choice: required or a named function cannot go with response_format")
        return by_tools or given

    def engine_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise InvalidArgument("top_logprobs: set logprobs to true to get them")
            return None
        return self.top_logprobs or 0

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
