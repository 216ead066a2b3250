"""Schemathesis hooks of the conformance run (tests/e2e/test_openapi_conformance.py, `SCHEMATHESIS_HOOKS`).

Generation requests keep their schema's shape but a small budget: a few tokens a sample, at most two samples and
two prompts. The CPU engine generates a token in tens of milliseconds, and a generated body that leaves max_tokens out
(the gateway's default, 256) or asks for thousands would take the run's time on a handful of cases. Everything else
is sent as generated.
"""

from __future__ import annotations

from typing import Any

import schemathesis

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
MAX_TOKENS = 4
MAX_SAMPLES = 2  # n and best_of
MAX_PROMPTS = 2  # a completions batch
BUDGETS = {"/v1/responses": "max_output_tokens"}  # (the field a route's budget is asked by, max_tokens elsewhere)


def _small(value: Any, most: int) -> Any:
    """An integer above `most` lowered to it; anything else (a negative case's wrong type) as it is."""
    return most if isinstance(value, int) and not isinstance(value, bool) and value > most else value


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    body, path = case.body, case.operation.path
    if path not in GENERATION_PATHS or not isinstance(body, dict):
        return
    for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if field in body:
            body[field] = _small(body[field], MAX_TOKENS)
    if not any(field in body for field in ("max_tokens", "max_completion_tokens", "max_output_tokens")):
        body[BUDGETS.get(path, "max_tokens")] = MAX_TOKENS
    for field in ("n", "best_of"):
        if field in body:
            body[field] = _small(body[field], MAX_SAMPLES)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        body["prompt"] = prompt[:MAX_PROMPTS]
