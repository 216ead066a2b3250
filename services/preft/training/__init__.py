"""Train PreFT adapters the way they are served: the adapter on prompt positions only, in one forward pass.

``PreftModel`` wraps a causal LM with a peft LoRA or a DiReFT and gates the adapter per position (``prefill``:
prompt positions only; ``all``: every position), so teacher-forced log-probs over prompt + completion equal
those of serving's two phases (prompt prefilled with the adapter, completion decoded without it, attending to
the adapted prompt's KV). Its ``.model`` can be handed to TRL's ``SFTTrainer`` / ``GRPOTrainer`` as is
(``preft.training.trl``). Adapters save to, and load from, the formats the registry serves.

Needs torch, transformers and peft (the ``test`` extra; TRL for the trainers).
"""

from preft.common.modes import PositionMode
from preft.training.direft import DireftAdapter, DireftConfig
from preft.training.generate import greedy_generate, step_logits
from preft.training.model import DIREFT_ATTRIBUTE, PreftModel, UnsupportedAdapterError
from preft.training.positions import PromptSplitError, mask_from_labels, mask_from_lengths

__all__ = [
    "DIREFT_ATTRIBUTE",
    "DireftAdapter",
    "DireftConfig",
    "PositionMode",
    "PreftModel",
    "PromptSplitError",
    "UnsupportedAdapterError",
    "greedy_generate",
    "mask_from_labels",
    "mask_from_lengths",
    "step_logits",
]
