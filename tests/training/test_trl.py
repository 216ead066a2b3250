"""TRL 1.16's SFTTrainer and GRPOTrainer train a PreFT adapter through preft.training's prefill-only forward.

Each trainer is given ``PreftModel.model``; the log-probs it computes (its own fused LM head, its own batch
layout) are checked against ``PreftModel.completion_logprobs`` and against another mode's, then a few CPU steps
must move the adapter (SFT: lower the completion loss).
"""

from __future__ import annotations

import random

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

from preft.adapters import ModelShape, check_adapter
from preft.devtools.tiny import WORDS
from preft.training import DireftConfig, PositionMode, PreftModel, mask_from_labels
from preft.training.trl import ADAPTER_SUBDIR, SaveAdapterCallback, check_trl_version

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")


def _policy(model_dir, method: str, mode: str = "prefill") -> PreftModel:
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if method == "lora":
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
        return PreftModel.for_lora(base, config, mode=mode)
    return PreftModel.for_direft(base, DireftConfig(rank=4, layers=(0, 1), init_std=0.2, seed=0), mode=mode)


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _common_args(tmp_path) -> dict:
    return dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        learning_rate=5e-2,
        lr_scheduler_type="constant",
        dataloader_num_workers=0,
        seed=0,
        bf16=False,  # (TRL's default on a CPU with bf16 wraps the model's forward in autocast: float32 compared here)
    )


def test_trl_version_is_the_tested_one():
    assert check_trl_version() == "1.16.0"


@pytest.mark.parametrize("method", ["lora", "direft"])
def test_sft_trainer_trains_the_prefill_only_adapter(model_dirs, tmp_path, method):
    """The answer to every prompt is the same sentence: SFT must raise its probability, the PreFT way."""
    model_dir = model_dirs["llama"]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(0)
    answer = " " + _sentence(rng, 4)
    rows = [{"prompt": _sentence(rng, rng.randint(3, 8)), "completion": answer} for _ in range(16)]
    policy = _policy(model_dir, method)
    args = trl.SFTConfig(
        **_common_args(tmp_path), max_steps=12, per_device_train_batch_size=8, save_steps=12, max_length=64
    )
    args.save_strategy = "steps"
    trainer = trl.SFTTrainer(
        model=policy.model,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[SaveAdapterCallback(policy)],
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    prompt = mask_from_labels(batch["labels"])

    def nll() -> float:
        with torch.no_grad():
            lp = policy.completion_logprobs(batch["input_ids"], batch["attention_mask"], prompt_mask=prompt)
        return float(-lp.sum() / (batch["labels"][:, 1:] != -100).sum())

    # TRL's own scoring (its fused LM head, its labels) is preft.training's prefill-only one
    with torch.no_grad():
        trl_lp = trainer.model(**batch, fused_lm_head=True).log_probs
        ours = policy.completion_logprobs(batch["input_ids"], batch["attention_mask"], prompt_mask=prompt)
    torch.testing.assert_close(trl_lp, ours, atol=1e-5, rtol=0)
    before = nll()
    trainer.train()
    after = nll()
    assert after < before - 0.5, (before, after)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses[-1] < losses[0]
    saved = tmp_path / "out" / "checkpoint-12" / ADAPTER_SUBDIR
    assert check_adapter(saved, ModelShape.from_model_dir(model_dir), max_rank=64).method.value == method
    reloaded = PreftModel.from_model_dir(model_dir, saved, mode="prefill")
    with torch.no_grad():
        trained = policy.eval().completion_logprobs(batch["input_ids"], batch["attention_mask"], prompt_mask=prompt)
        again = reloaded.completion_logprobs(batch["input_ids"], batch["attention_mask"], prompt_mask=prompt)
    torch.testing.assert_close(again, trained, atol=1e-5, rtol=0)


@pytest.mark.parametrize("method", ["lora", "direft"])
def test_grpo_trainer_steps_with_local_generation(model_dirs, tmp_path, method):
    """Two GRPO steps, TRL's own sampling (no vLLM), a toy reward: the adapter moves, and TRL's per-token log-probs
    of its samples are preft.training's prefill-only ones (not the all-mode ones)."""
    model_dir = model_dirs["qwen2"]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(1)
    rows = [{"prompt": _sentence(rng, rng.randint(3, 7))} for _ in range(8)]
    policy = _policy(model_dir, method)
    start = {n: p.detach().clone() for n, p in policy.trainable_parameters().items()}

    def reward_short_words(completions, **kwargs):
        return [-float(len(c)) / 10 for c in completions]

    args = trl.GRPOConfig(
        **_common_args(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        beta=0.0,
    )
    trainer = trl.GRPOTrainer(
        model=policy.model,
        reward_funcs=reward_short_words,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    trainer.train()
    moved = [n for n, p in policy.trainable_parameters().items() if not torch.equal(p, start[n])]
    assert moved, "no adapter parameter changed"

    # TRL's scoring of a left-padded prompt + right-padded completion batch, as _compute_loss calls it
    policy.eval()
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in rows[:3]]
    completions = [policy.generate_greedy(p, 5) for p in prompts]
    p_len = max(map(len, prompts))
    ids = torch.tensor([[2] * (p_len - len(p)) + p + c for p, c in zip(prompts, completions, strict=True)])
    mask = (torch.arange(ids.shape[1]) >= torch.tensor([p_len - len(p) for p in prompts])[:, None]).long()
    with torch.no_grad():
        trl_lp, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, logits_to_keep=5)
        ours = policy.completion_logprobs(ids, mask, prompt_lengths=[p_len] * 3)[:, -5:]
    torch.testing.assert_close(trl_lp, ours, atol=1e-5, rtol=0)
    policy.gate.mode = PositionMode.ALL
    with torch.no_grad():
        everywhere = policy.completion_logprobs(ids, mask, prompt_lengths=[p_len] * 3)[:, -5:]
    assert (everywhere[:, 1:] - ours[:, 1:]).abs().max() > 1e-4
