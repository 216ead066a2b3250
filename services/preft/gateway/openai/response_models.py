"""What the OpenAI generation routes answer, for /openapi.json (``core.response_models`` says why models only
document answers the routes build as dicts): completions, chat completions, models, tokenize and detokenize."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from preft.gateway.core.response_models import Documented
from preft.gateway.openai.schemas import FunctionCall, ServedTier


class CompletionUsage(Documented):
    prompt_tokens: int = Field(description="Each prompt's tokens, once")
    completion_tokens: int = Field(description="Every sample's generated tokens")
    total_tokens: int


class ReasoningTokens(Documented):
    reasoning_tokens: int = Field(description="The answer's tokens spent thinking")


class ChatUsage(CompletionUsage):
    completion_tokens_details: ReasoningTokens | None = Field(None, description="Where the model thinks")


class CompletionLogprobs(Documented):
    """/v1/completions' logprobs: per token its text, logprob, most likely tokens and offset (with `echo`, the first
    prompt token's logprob and top tokens are null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Documented):
    index: int = Field(description="prompt index × n + the sample's")
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"]


class Completion(Documented):
    """A whole text completion (streamed: `text_completion` chunks of the same shape, then `data: [DONE]`)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


class TopLogprob(Documented):
    token: str
    logprob: float
    bytes: list[int] = Field(description="The token's UTF-8 bytes")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Documented):
    content: list[TokenLogprob]


class ToolCallFunction(Documented):
    name: str
    arguments: str = Field(description="JSON text (as the model wrote it, where a call was cut short)")


class ToolCall(Documented):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatCompletionMessage(Documented):
    """The answer's message: its content (null where it only calls tools), its thinking apart where the model thinks
    (`reasoning`, with PREFT_GATEWAY__REASONING_FORMAT), its calls as `tool_calls`, or the deprecated `function_call`
    where the request gave `functions`."""

    role: Literal["assistant"]
    content: str | None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None


ChatFinishReason = Literal["stop", "length", "tool_calls", "function_call"]


class ChatChoice(Documented):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason


class ChatCompletion(Documented):
    """A whole chat completion (streamed: `chat.completion.chunk` events with deltas, then `data: [DONE]`)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: ChatUsage
    service_tier: ServedTier


class Model(Documented):
    """The base model (owned by preft) or an adapter: the tenant's own by name, a shared one as owner/name."""

    id: str = Field(description="A valid `model` for the generation routes")
    object: Literal["model"]
    created: int = Field(description="Unix seconds (0: the base model)")
    owned_by: str


class ModelList(Documented):
    object: Literal["list"]
    data: list[Model]


class Tokens(Documented):
    count: int
    max_model_len: int = Field(description="The context length a prompt and its answer share")
    tokens: list[int]


class Detokenized(Documented):
    prompt: str
