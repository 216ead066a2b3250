"""Closed-loop load of one fixed workload: each user sends a completion, waits for it, sends the next.

Run by `loadtest.platform` with `-u CONCURRENCY`; options from the environment:
- PREFT_SAT_TARGETS: JSON file, a list of {"api_key", "model"} to draw from (uniform or Zipf by list order);
- PREFT_SAT_POPULARITY: uniform | zipf, PREFT_SAT_ZIPF_S (default 1.0);
- PREFT_SAT_PROMPT_TOKENS, PREFT_SAT_OUTPUT_TOKENS: every prompt is that many words of the word tokenizer (one token
  each), every answer exactly that many tokens (min_tokens = max_tokens);
- PREFT_SAT_VOCAB: the tokenizer's vocabulary size (words are w3 … w{VOCAB-1});
- PREFT_SAT_EXTRA: JSON object merged into every body (e.g. {"preft_mode": "all"}).
Prompts are fresh random words, so no request reuses another's prefix-cache blocks.
"""

from __future__ import annotations

import itertools
import json
import os
import random

from locust import constant, task
from locust.contrib.fasthttp import FastHttpUser

TARGETS = json.loads(open(os.environ["PREFT_SAT_TARGETS"]).read())  # noqa: SIM115 (read once at import)
POPULARITY = os.environ.get("PREFT_SAT_POPULARITY", "uniform")
ZIPF_S = float(os.environ.get("PREFT_SAT_ZIPF_S", "1.0"))
PROMPT_TOKENS = int(os.environ["PREFT_SAT_PROMPT_TOKENS"])
OUTPUT_TOKENS = int(os.environ["PREFT_SAT_OUTPUT_TOKENS"])
WORDS = [f"w{i}" for i in range(3, int(os.environ["PREFT_SAT_VOCAB"]))]
EXTRA = json.loads(os.environ.get("PREFT_SAT_EXTRA", "{}"))
CUMULATIVE = list(
    itertools.accumulate(
        [1.0] * len(TARGETS) if POPULARITY == "uniform" else [1.0 / r**ZIPF_S for r in range(1, len(TARGETS) + 1)]
    )
)


class CompletionUser(FastHttpUser):
    wait_time = constant(0)
    network_timeout = 900.0  # (stock multi-LoRA answers a saturating load in minutes)
    connection_timeout = 60.0

    def on_start(self) -> None:
        self.rng = random.Random()

    @task
    def completion(self) -> None:
        target = self.rng.choices(TARGETS, cum_weights=CUMULATIVE)[0]
        body = {
            "model": target["model"],
            "prompt": " ".join(self.rng.choices(WORDS, k=PROMPT_TOKENS)),
            "max_tokens": OUTPUT_TOKENS,
            "min_tokens": OUTPUT_TOKENS,
            "temperature": 0,
            **EXTRA,
        }
        headers = {"Authorization": f"Bearer {target['api_key']}"}
        with self.client.post(
            "/v1/completions", json=body, headers=headers, name="completion", catch_response=True
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"{resp.status_code}: {(resp.text or '')[:200]}")
                return
            usage = resp.json().get("usage") or {}
            if usage.get("completion_tokens") != OUTPUT_TOKENS:
                resp.failure(f"answered {usage.get('completion_tokens')} tokens, not {OUTPUT_TOKENS}")
