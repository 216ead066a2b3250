"""A reasoning model's thinking told apart from its answer: `<think>…</think>` (Qwen3, QwQ, DeepSeek-R1 and their
kind), where the operator names that format (`GatewaySettings.reasoning_format`).

The thinking is the text up to `</think>`, where the answer opens with `<think>` or the prompt did (chat templates
that start the assistant's turn with `<think>`, as DeepSeek-R1's and the Qwen3 thinking models' do); otherwise
the whole answer is content. The content is the text after `</think>`, as vLLM's reasoning parsers cut it. Chat
answers carry the thinking as the message's `reasoning` (vLLM's field), the Responses API as a `reasoning` item
before the answer's; tool calls are read from the content only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

ReasoningFormat = Literal["none", "think"]
OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Thinking:
    """How one request's answers begin: inside the thinking (`opened`: the prompt's last text is `<think>`) or not
    yet (an answer that opens with `<think>` thinks until `</think>`)."""

    opened: bool

    @classmethod
    def of_prompt(cls, prompt_tail: str) -> Thinking:
        """The thinking of answers to a prompt ending with `prompt_tail` (its last tokens' text)."""
        return cls(prompt_tail.rstrip().endswith(OPEN))

    def splitter(self) -> ThinkSplitter:
        return ThinkSplitter(self.opened)

    def split(self, text: str) -> tuple[str, str]:
        """A whole answer's (thinking, content)."""
        return self.splitter().feed(text, last=True)

    def tokens(self, text: str, token_ids: list[int], decode: Callable[[list[int]], str]) -> int:
        """How many of a whole answer's tokens (its `text`, its `token_ids`) are its thinking: those up to the one
        that completes `</think>` (found by decoding prefixes, a binary search), all of them where the thinking was
        cut short, none where the answer did not think."""
        splitter = self.splitter()
        splitter.feed(text, last=True)
        if not splitter.thought:
            return 0
        if splitter.thinking:
            return len(token_ids)
        low, high = 1, len(token_ids)  # (the shortest prefix whose text holds the tag)
        while low < high:
            middle = (low + high) // 2
            if CLOSE in decode(token_ids[:middle]):
                high = middle
            else:
                low = middle + 1
        return low


class ThinkSplitter:
    """Splits an answer given in pieces into (thinking, content) pieces: text that may still turn out to be a tag
    (`<thi` at the start, `</th` while thinking) waits for the next piece, or for the last."""

    def __init__(self, opened: bool) -> None:
        self._state: Literal["start", "thinking", "content"] = "thinking" if opened else "start"
        self._held = ""
        self.thought = opened  # (the answer has thought: it opened with <think>, or the prompt did)
        self.tokens = 0  # the thinking's tokens so far (a piece that closes it counts whole)
        self._undecided = 0  # tokens of the pieces before the answer showed whether it thinks

    def feed(self, text: str, *, last: bool = False, tokens: int = 0) -> tuple[str, str]:
        """The next piece's (thinking, content), `tokens` its token count; the `last` piece also lets out what was
        held back: thinking cut short, or an answer that was only whitespace or a tag's start."""
        before = self._state
        reasoning, content = self._feed(text)
        if last:
            rest_reasoning, rest_content = self._end()
            reasoning, content = reasoning + rest_reasoning, content + rest_content
        if before == "thinking":
            self.tokens += tokens
        elif before == "start":
            self._undecided += tokens
            if self._state != "start":
                self.tokens += self._undecided if self.thought else 0
                self._undecided = 0
        return reasoning, content

    def _feed(self, text: str) -> tuple[str, str]:
        held = self._held + text
        self._held = ""
        if self._state == "start":
            stripped = held.lstrip()
            if stripped.startswith(OPEN):
                self._state, held, self.thought = "thinking", stripped[len(OPEN) :], True
            elif OPEN.startswith(stripped):  # (whitespace, or a part of the tag: wait)
                self._held = held
                return "", ""
            else:
                self._state = "content"
        if self._state == "content":
            return "", held
        end = held.find(CLOSE)
        if end >= 0:
            self._state = "content"
            return held[:end], held[end + len(CLOSE) :]
        keep = _partial_tag(held)
        self._held = held[len(held) - keep :] if keep else ""
        return held[: len(held) - keep], ""

    def _end(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return (held, "") if self._state == "thinking" else ("", held)

    @property
    def thinking(self) -> bool:
        """Whether the text so far is (or may still be) thinking."""
        return self._state != "content"


def _partial_tag(text: str) -> int:
    """How many of `text`'s last characters may begin `</think>`."""
    for n in range(min(len(text), len(CLOSE) - 1), 0, -1):
        if CLOSE.startswith(text[-n:]):
            return n
    return 0
