"""Generation requests and results, and their JSON-lines form (the ``preft generate`` file format)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from preft.common.engine_contract import SamplingOptions, TokenLogprob, check_min_tokens
from preft.common.modes import PositionMode

# The keys of a request line that are not sampling options; all others are SamplingOptions' (unknown ones ignored)
REQUEST_KEYS = ("id", "prompt_ids", "prompt", "adapter", "mode", "max_tokens")


def greedy() -> SamplingOptions:
    """The offline engine's default: greedy, the end-of-sequence token ignored (every request runs max_tokens)."""
    return SamplingOptions(ignore_eos=True)


class RequestError(ValueError):
    """A request that cannot be run; the message says why."""


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: a prompt (token ids or text), an optional adapter directory and its mode, and how its tokens
    are picked (greedy by default, EOS ignored)."""

    id: str
    prompt_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    adapter: str | None = None
    mode: PositionMode = PositionMode.PREFILL
    max_tokens: int = 16
    sampling: SamplingOptions = field(default_factory=greedy)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", PositionMode(self.mode))
        check_min_tokens(self.sampling.min_tokens, self.max_tokens)

    @classmethod
    def from_json(cls, data: Any, *, line_no: int | None = None) -> GenerationRequest:
        where = f"line {line_no}: " if line_no is not None else ""
        if not isinstance(data, dict):
            raise RequestError(f"{where}each line must be a JSON object")
        rid = data.get("id", str(line_no) if line_no is not None else None)
        if not isinstance(rid, (str, int)) or isinstance(rid, bool):
            raise RequestError(f"{where}'id' must be a string")
        prompt_ids, prompt = data.get("prompt_ids"), data.get("prompt")
        if (prompt_ids is None) == (prompt is None):
            raise RequestError(f"{where}give exactly one of 'prompt_ids' or 'prompt'")
        if prompt_ids is not None and (
            not isinstance(prompt_ids, list)
            or not prompt_ids
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt_ids)
        ):
            raise RequestError(f"{where}'prompt_ids' must be a non-empty list of non-negative integers")
        if prompt is not None and (not isinstance(prompt, str) or not prompt):
            raise RequestError(f"{where}'prompt' must be a non-empty string")
        adapter = data.get("adapter")
        if adapter is not None and (not isinstance(adapter, str) or not adapter):
            raise RequestError(f"{where}'adapter' must be a directory path or null")
        try:
            mode = PositionMode(data.get("mode", PositionMode.PREFILL.value))
        except ValueError:
            raise RequestError(f"{where}'mode' must be 'prefill' or 'all', got {data.get('mode')!r}") from None
        max_tokens = data.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise RequestError(f"{where}'max_tokens' must be a positive integer")
        try:
            sampling = SamplingOptions.model_validate(
                greedy().model_dump(exclude_defaults=True) | {k: v for k, v in data.items() if k not in REQUEST_KEYS}
            )
            return cls(
                id=str(rid),
                prompt_ids=tuple(prompt_ids) if prompt_ids is not None else None,
                prompt=prompt,
                adapter=adapter,
                mode=mode,
                max_tokens=max_tokens,
                sampling=sampling,
            )
        except ValidationError as e:
            first = e.errors()[0]
            at = ".".join(str(p) for p in first["loc"])
            raise RequestError(f"{where}{at + ': ' if at else ''}{first['msg']}") from None
        except ValueError as e:
            raise RequestError(f"{where}{e}") from None


@dataclass(frozen=True)
class GenerationResult:
    """Generated token ids and text (with why the generation ended, and logprobs where asked), or the error that
    failed the request."""

    id: str
    token_ids: tuple[int, ...] = field(default=())
    text: str = ""
    finish_reason: str | None = None  # "stop" (end-of-sequence, a stop string or token) or "length"
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # (every prompt token's but the first)
    error: str | None = None
    first_token_latency_s: float | None = None  # arrival to first token (engine stats), when recorded

    def to_json(self) -> dict[str, Any]:
        if self.error is not None:
            return {"id": self.id, "error": self.error}
        out = {"id": self.id, "token_ids": list(self.token_ids), "text": self.text, "finish_reason": self.finish_reason}
        for name in ("logprobs", "prompt_logprobs"):
            if (value := getattr(self, name)) is not None:
                out[name] = [lp.model_dump() for lp in value]
        return out


def read_requests(
    lines: list[str], defaults: Mapping[str, Any] | None = None
) -> tuple[list[GenerationRequest], list[GenerationResult]]:
    """Parse JSON lines (`defaults`: keys each line has unless it gives them); a malformed line becomes a failed result
    (with its id when one can be read)."""
    requests: list[GenerationRequest] = []
    failed: list[GenerationResult] = []
    for no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            failed.append(GenerationResult(id=f"line-{no}", error=f"line {no}: not valid JSON ({e.msg})"))
            continue
        try:
            if isinstance(data, dict):
                data = {**(defaults or {}), **data}
            requests.append(GenerationRequest.from_json(data, line_no=no))
        except RequestError as e:
            rid = data.get("id") if isinstance(data, dict) and isinstance(data.get("id"), str) else f"line-{no}"
            failed.append(GenerationResult(id=rid, error=str(e)))
    return requests, failed
