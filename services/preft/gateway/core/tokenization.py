"""Prompts to token ids with the base model's tokenizer, chat messages through the model's own chat template.

The engine receives token ids, so the gateway knows the prompt's length before anything is admitted (rate
limits, the 413 for long prompts). Long texts are tokenized in a worker thread so they do not stall the event
loop (the routes go through ``prompt_guard``, which bounds their size and each tenant's share of the threads);
short ones (almost all) inline, which is cheaper than a thread hop. A tokenizer without a chat template refuses
chat requests (400) rather than guessing a format the model was not trained on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio

from preft.common.errors import InvalidArgument

INLINE_MAX_CHARS = 8192  # tokenizing ~8k characters takes well under a millisecond


class PromptTokenizer:
    """Owns the base model's tokenizer (a Hugging Face tokenizer object)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        # The Rust tokenizer under a "fast" HF tokenizer gives the same ids without the Python wrapper's cost.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self.vocab_size = len(tokenizer)
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        # (templates that show tools to the model read the `tools` variable)
        self.takes_tools = self.has_chat_template and "tools" in str(tokenizer.chat_template)

    @classmethod
    def load(cls, path: Path) -> PromptTokenizer:
        from transformers import AutoTokenizer  # heavy import: only when the app starts

        return cls(AutoTokenizer.from_pretrained(str(path)))

    def encode_now(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text, in this thread. A long text goes through the Rust tokenizer's batch call, which
        releases the GIL while it works (its one-text call holds it throughout: 2 MB held every thread ~1.7 s)."""
        if self._backend is None:
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens))
        if len(text) <= INLINE_MAX_CHARS:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a completion prompt (with the tokenizer's BOS, if it adds one)."""
        if len(text) <= INLINE_MAX_CHARS:
            return self.encode_now(text, add_special_tokens)
        return await anyio.to_thread.run_sync(self.encode_now, text, add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        """The text of token ids, special tokens included (an echoed token-id prompt, a prompt token's text)."""
        return self._tok.decode(token_ids, skip_special_tokens=False)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        continue_final: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text for a conversation, ending where the assistant's answer starts (`continue_final`: inside
        the last message, an assistant turn the answer continues); `tools` shown to the model where the template
        takes them; `template_kwargs`: more of the template's variables."""
        if not self.has_chat_template:
            raise InvalidArgument("this base model has no chat template; use /v1/completions with a prompt")
        from jinja2 import TemplateError

        try:
            return self._tok.apply_chat_template(
                messages,
                tools=tools if self.takes_tools else None,
                tokenize=False,
                add_generation_prompt=not continue_final,
                continue_final_message=continue_final,
                **(template_kwargs or {}),
            )
        except TemplateError as e:
            raise InvalidArgument(f"the conversation does not fit the model's chat template: {e}") from None

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        continue_final: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        # The template writes any special tokens itself.
        text = self.render_chat(messages, tools, continue_final=continue_final, template_kwargs=template_kwargs)
        return await self.encode(text, add_special_tokens=False)
