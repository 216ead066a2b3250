"""What the Responses and Conversations routes answer, for /openapi.json (``core.response_models`` says why models
only document answers the routes build as dicts): the response object and its output items, stored input and
conversation items, conversations."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from preft.gateway.core.response_models import Documented, ItemList
from preft.gateway.openai.response_models import TokenLogprob
from preft.gateway.openai.schemas import ReasoningEffort, ServedTier
from preft.gateway.responses.protocol import FunctionChoice

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(Documented):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] = Field(description="Always empty")
    logprobs: list[TokenLogprob] = Field(description="Where asked for (include, top_logprobs)")


class MessageItem(Documented):
    type: Literal["message"]
    id: str
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputText]


class ReasoningText(Documented):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(Documented):
    """A thinking model's thinking (no summary is made)."""

    type: Literal["reasoning"]
    id: str
    summary: list[Any] = Field(description="Always empty")
    content: list[ReasoningText]
    status: ItemStatus


class FunctionCallItem(Documented):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str = Field(description="JSON text")
    status: ItemStatus


OutputItem = Annotated[MessageItem | ReasoningItem | FunctionCallItem, Field(discriminator="type")]


class TokenDetailsIn(Documented):
    cached_tokens: int = Field(description="Always 0")


class TokenDetailsOut(Documented):
    reasoning_tokens: int


class ResponseUsage(Documented):
    input_tokens: int
    input_tokens_details: TokenDetailsIn
    output_tokens: int
    output_tokens_details: TokenDetailsOut
    total_tokens: int


class ResponseError(Documented):
    code: Literal["server_error"]
    message: str


class IncompleteDetails(Documented):
    reason: Literal["max_output_tokens"]


class ReasoningEcho(Documented):
    effort: ReasoningEffort | None
    summary: None


class ConversationId(Documented):
    id: str


class TextFormatEcho(Documented):
    """The request's `text.format`, its fields that were given."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextEcho(Documented):
    format: TextFormatEcho | None = None


class ResponseTool(Documented):
    type: Literal["function"]
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseObject(Documented):
    """A response: what the request asked (echoed, as OpenAI does), its status, and its output. Streamed: the
    Responses events (response.created ... response.completed), no [DONE]."""

    id: str
    object: Literal["response"]
    background: bool
    created_at: int
    model: str
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: ReasoningEcho | None
    conversation: ConversationId | None
    store: bool = Field(description="Kept for GET /v1/responses/{id} and previous_response_id")
    temperature: float
    text: TextEcho
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice
    tools: list[ResponseTool]
    top_logprobs: int | None
    top_p: float
    truncation: Literal["auto", "disabled"]
    user: str | None
    service_tier: ServedTier
    status: Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    output: list[OutputItem]
    usage: ResponseUsage | None = Field(description="Null until it is answered")


class ResponseDeleted(Documented):
    id: str
    object: Literal["response.deleted"]
    deleted: Literal[True]


class Item(Documented):
    """An input or conversation item: a message (`content` text parts), a function call or its output, a
    reasoning item, as given (and, in a conversation, as a response's output added them), with its id."""

    model_config = ConfigDict(extra="allow")

    id: str
    type: str = Field(description="message, function_call, function_call_output, reasoning")


class ItemPage(ItemList[Item]):
    """A page of a stored response's input items, or of a conversation's items."""


class Conversation(Documented):
    id: str
    object: Literal["conversation"]
    created_at: int
    metadata: dict[str, str]


class ConversationDeleted(Documented):
    id: str
    object: Literal["conversation.deleted"]
    deleted: Literal[True]
