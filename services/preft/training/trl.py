"""TRL's trainers on a PreFT adapter: what is trained is what is served.

No trainer subclass is needed. TRL 1.16's trainers score a completion by calling the model they were given as
``model(input_ids=…, attention_mask=…, labels=…, fused_lm_head=True)``, with labels -100 on every position
but the completion's tokens (``GRPOTrainer._get_per_token_logps_and_entropies``: prompts left-padded, labels
-100 on the first ``-logits_to_keep`` columns and on padding; ``SFTTrainer.compute_loss`` with prompt-completion
data: the collator's labels are -100 over the prompt, ``completion_only_loss``); and they sample with
``model.generate(…)``. ``PreftModel``'s hooks on ``PreftModel.model`` read the prompt from those labels and gate
generation by the KV cache, so ``PreftModel.model`` is passed to the trainer as the model (with no
``peft_config``)::

    policy = PreftModel.for_lora(base, LoraConfig(...), mode="prefill")  # or PreftModel.for_direft(...)
    trainer = SFTTrainer(model=policy.model, args=SFTConfig(...), train_dataset=prompt_completion_data,
                         callbacks=[SaveAdapterCallback(policy)])
    trainer.train()
    policy.save_pretrained("adapter/")  # the registry's format, checked as the registry checks it

Within that protocol:
- SFT needs prompt-completion rows (a row whose first token is scored has no prompt: refused) and no packing or
  ``padding_free`` (several prompts in one row: refused); ``compute_loss_func`` and label smoothing call the model
  without labels, so the adapter would apply everywhere there: not supported.
- GRPO's generation is TRL's own (``use_vllm=False``); its log-probs, those of the "ref" adapter TRL adds when
  ``beta != 0``, and its samples are all PreFT's.
- Gradient checkpointing (TRL's default) works: the gate of a forward is kept until the next one, so layers
  recomputed in its backward see it.

Tested with trl 1.16.0 (transformers 5.24.0, peft 0.21.2, torch 2.13 CPU).
"""

from __future__ import annotations

import warnings
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from preft.training.model import PreftModel

TESTED_TRL_VERSIONS = ("1.16.0",)
ADAPTER_SUBDIR = "preft_adapter"  # where SaveAdapterCallback writes in each checkpoint directory


def check_trl_version() -> str | None:
    """The installed TRL's version; warns when it is not one this protocol was read from and tested with."""
    try:
        installed = version("trl")
    except PackageNotFoundError:
        return None
    if installed not in TESTED_TRL_VERSIONS:
        warnings.warn(
            f"trl {installed} is untested with preft.training (tested: {', '.join(TESTED_TRL_VERSIONS)}); check that "
            "its trainers still score completions through model(..., labels=...) with -100 over the prompt",
            stacklevel=2,
        )
    return installed


class SaveAdapterCallback(TrainerCallback):
    """Writes the adapter, in the registry's format, into each checkpoint (``checkpoint-N/preft_adapter``).

    The trainer's own checkpoint of a DiReFT model is the whole base model plus ``preft_direft.*`` weights,
    which the registry does not serve; this is the servable copy."""

    def __init__(self, policy: PreftModel) -> None:
        self.policy = policy
        check_trl_version()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self.policy.save_pretrained(Path(args.output_dir) / f"checkpoint-{state.global_step}" / ADAPTER_SUBDIR)
