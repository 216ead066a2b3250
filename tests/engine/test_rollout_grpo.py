"""TRL 1.16's GRPOTrainer (``use_vllm=True``, ``vllm_mode="server"``) trains a PreFT LoRA through ``preft
rollout-serve`` (the CLI in a subprocess: real vLLM on CPU, updates over HTTP): after every weight sync the server's
greedy rollouts equal, token for token, the HF + peft reference on the trainer's adapter of that moment (saved,
reloaded, prefill mode). The run is loadtest.rl.grpo_cpu's, shortened; that script writes the curves docs cite."""

from __future__ import annotations

import pytest
from loadtest.rl import grpo_cpu

pytestmark = pytest.mark.engine

STEPS = 3


def test_grpo_through_the_rollout_server_is_token_exact_after_every_update(model_dirs, tmp_path):
    result = grpo_cpu.train(model_dirs["llama"], "lora", tmp_path, steps=STEPS)
    checks = result.checks
    assert [c.step for c in checks] == list(range(STEPS)), "a sync per step, each checked"
    assert [c.version for c in checks] == list(range(1, STEPS + 1)), "each sync did not apply one update"
    for c in checks:
        assert c.server == c.reference, f"update {c.update} (step {c.step}): served tokens are not the reference's"
    assert checks[0].reference != checks[-1].reference, "the adapter never changed the greedy tokens: nothing checked"
    assert len(result.losses) == len(result.rewards) == STEPS
