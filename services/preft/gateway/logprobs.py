"""OpenAI's two shapes of logprobs, made from the engine's (`contract.TokenLogprob`, one per generated token)."""

from __future__ import annotations

from typing import Any

from preft.engine.contract import TokenLogprob


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
