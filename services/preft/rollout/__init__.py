"""A TRL-compatible rollout server (`preft rollout-serve`): TRL's vLLM server protocol over the PreFT engine, one
adapter served in prefill mode and updated in place by the trainer (`preft.training.rollouts` is the trainer's side).
"""
