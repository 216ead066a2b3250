"""The LoRA kernels for GPU, one per module, over a step's groups of adapted tokens, and the policy that picks them.

- ``policy``: which kernel serves a step (``PREFT_LORA_KERNELS`` through ``settings``), pure decisions;
- ``shrink``: z = x·A[slot]ᵀ for all of a module's slices in one launch; ``expand``: y += z·B[slot]ᵀ likewise;
  ``split``: a LoRA linear as the two, planned once per module; ``fused``: a LoRA linear in one launch;
- ``act``: the MLP's activation with the gate/up LoRA folded in; ``fold_gluon``: that fold in Gluon for Hopper;
- ``common``: the jit helpers and launch arguments they share; ``plans``: what they keep between calls
  (``PlanCache``, owned by the worker's slot state); ``staging``: host arrays to the device in one copy;
- ``triton_launch``: launching their compiled variants directly (the one touch point on Triton's internals);
  ``variants``: how many variants were compiled.

"""
