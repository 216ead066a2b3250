"""OpenAI's two shapes of logprobs, made from the engine's (`contract.TokenLogprob`, one per generated token)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from preft.common.engine_contract import TokenLogprob


def completion_logprobs(tokens: list[TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
    """/v1/completions' form: the tokens' text, their logprobs, per position the most likely tokens' {text: logprob},
    and each token's offset in the generated text (from `text_offset`: what earlier stream events carried)."""
    offsets = []
    for lp in tokens:
        offsets.append(text_offset)
        text_offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in tokens],
        "token_logprobs": [lp.logprob for lp in tokens],
        "top_logprobs": [{top.token: top.logprob for top in lp.top} for lp in tokens],
        "text_offset": offsets,
    }


@dataclass(frozen=True)
class Echo:
    """A completion's echoed prompt (`echo: true`): its text, and the text of its first token (which has no logprob)."""

    text: str
    first_token: str

    def logprobs(self, prompt: list[TokenLogprob], generated: list[TokenLogprob]) -> dict[str, Any]:
        """completions' form over the prompt's tokens then the generated ones: the first prompt token's logprob and
        top tokens null (as OpenAI), the generated tokens' offsets counted from the end of the echoed text."""
        head = completion_logprobs(prompt, len(self.first_token))
        tail = completion_logprobs(generated, len(self.text))
        return {
            "tokens": [self.first_token, *head["tokens"], *tail["tokens"]],
            "token_logprobs": [None, *head["token_logprobs"], *tail["token_logprobs"]],
            "top_logprobs": [None, *head["top_logprobs"], *tail["top_logprobs"]],
            "text_offset": [0, *head["text_offset"], *tail["text_offset"]],
        }


def chat_logprobs(tokens: list[TokenLogprob]) -> dict[str, Any]:
    """/v1/chat/completions' form: per token its text, logprob and UTF-8 bytes, and the most likely tokens so."""
    return {
        "content": [
            {
                **_token(lp.token, lp.logprob),
                "top_logprobs": [_token(top.token, top.logprob) for top in lp.top],
            }
            for lp in tokens
        ]
    }


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
