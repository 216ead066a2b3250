"""The OpenAI generation routes' settings: how the base model writes tool calls and thinks. One part of
`preft.gateway.settings.GatewaySettings` (flat `PREFT_GATEWAY__*` names)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from preft.gateway.openai.reasoning import ReasoningFormat
from preft.gateway.openai.tools import ToolCallFormat


class OpenAISettings(BaseModel):
    """The base model's output formats: tool calls and thinking."""

    tool_call_format: ToolCallFormat = Field(
        "hermes",
        description="How the base model writes tool calls: hermes (Qwen2.5, Qwen3), llama3_json (Llama 3.1), mistral "
        "or pythonic (Llama 3.2, Llama 4)",
    )
    reasoning_format: ReasoningFormat = Field(
        "none",
        description="How the base model thinks before it answers: none, or think (<think>…</think>: Qwen3, QwQ, "
        "DeepSeek-R1), told apart as the answer's reasoning",
    )
