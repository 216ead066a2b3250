"""Request bodies of the OpenAI-compatible routes (the subset the engine can honour) and their PreFT extensions.

Fields the engine cannot honour are refused with a 400 naming them when they ask for something (n > 1,
logprobs, penalties, tools, ...), rather than silently ignored. Unknown fields are ignored, as OpenAI clients
send new optional fields over time. Extensions, sent by OpenAI clients through `extra_body`:
- `preft_mode`: "prefill" | "all", the adapter's position mode (only where the operator allows it),
- `ignore_eos`: keep generating after the end-of-sequence token (benchmarks).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from preft.common.errors import InvalidArgument
from preft.vllm_plugin.modes import PositionMode

MAX_STOP_SEQUENCES = 4


class StreamOptions(BaseModel):
    """`stream_options`: with include_usage, a last chunk carries the token counts."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class GenerationBody(BaseModel):
    """What completions and chat requests share."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=256, description="Base model name or adapter reference")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="Sampling temperature; default 1")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus sampling mass; default 1")
    seed: int | None = Field(None, description="Sampling seed")
    stop: str | list[str] | None = Field(None, description=f"Up to {MAX_STOP_SEQUENCES} stop strings")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = Field(None, ge=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    preft_mode: PositionMode | None = Field(None, description="PreFT extension: the adapter's position mode")
    ignore_eos: bool = Field(False, description="PreFT extension: do not stop at the end-of-sequence token")

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
        asks = {
            "n": (self.n or 1) > 1,
            "presence_penalty": bool(self.presence_penalty),
            "frequency_penalty": bool(self.frequency_penalty),
            "logit_bias": bool(self.logit_bias),
            **self._unsupported(),
        }
        for name, asked in asks.items():
            if asked:
                raise InvalidArgument(f"{name} is not supported by this server")

    def _unsupported(self) -> dict[str, bool]:
        return {}


class CompletionBody(GenerationBody):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(description="Text or token ids (one prompt)")
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise InvalidArgument("prompt: send one prompt per request (batches are not supported)")
            return p[0]  # type: ignore[return-value]
        return p  # type: ignore[return-value]

    def _unsupported(self) -> dict[str, bool]:
        return {
            "echo": bool(self.echo),
            "logprobs": self.logprobs is not None,
            "best_of": (self.best_of or 1) > 1,
            "suffix": bool(self.suffix),
        }


class ContentPart(BaseModel):
    """One part of a message's content; only text parts are accepted."""

    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One turn of a conversation."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(p.type != "text" or p.text is None for p in self.content):
            raise InvalidArgument("messages: only text content parts are supported")
        return "\n".join(p.text for p in self.content if p.text is not None)


class ChatBody(GenerationBody):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="Newer name of max_tokens")
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def _unsupported(self) -> dict[str, bool]:
        return {
            "logprobs": bool(self.logprobs) or self.top_logprobs is not None,
            "tools": bool(self.tools) or bool(self.functions),
            "tool_choice": self.tool_choice not in (None, "none"),
            "response_format": bool(self.response_format) and self.response_format.get("type") != "text",
        }

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
