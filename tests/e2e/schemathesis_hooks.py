"""Schemathesis hooks of the conformance run (tests/e2e/test_openapi_conformance.py; the config's `hooks`).

Generation requests keep their schema's shape but a small budget: a few tokens a sample, at most two samples and
two prompts. The CPU engine generates a token in tens of milliseconds, and a generated body that leaves its budget
out or null (the gateway's default, 256 tokens) or asks for thousands would spend the run's time on a handful of
cases. Everything else is sent as generated.
"""

from __future__ import annotations

from typing import Any

import schemathesis

# The fields each generation route takes its budget from (the first where it adds one)
BUDGETS = {
    "/v1/completions": ("max_tokens",),
    "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/v1/responses": ("max_output_tokens",),
}
MAX_TOKENS = 4
MAX_SAMPLES = 2  # n and best_of
MAX_PROMPTS = 2  # a completions batch


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _small(value: Any, most: int) -> Any:
    """An integer above `most` lowered to it; anything else (a negative case's wrong type) as it is."""
    return most if _is_int(value) and value > most else value


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    body, budgets = case.body, BUDGETS.get(case.operation.path)
    if budgets is None or not isinstance(body, dict):
        return
    for field in budgets:
        if field in body:
            body[field] = _small(body[field], MAX_TOKENS)
    if not any(_is_int(body.get(field)) for field in budgets):  # (none, or null: the server's default, 256)
        body[budgets[0]] = MAX_TOKENS
    for field in ("n", "best_of"):
        if field in body:
            body[field] = _small(body[field], MAX_SAMPLES)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        body["prompt"] = prompt[:MAX_PROMPTS]
