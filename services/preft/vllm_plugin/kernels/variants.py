"""How many variants of the LoRA kernels this process has compiled: benchmarks compare it before and after a timed
pass, where a compile is a stall inside the pass."""

from __future__ import annotations

from preft.vllm_plugin.kernels import act, expand, fused, shrink
from preft.vllm_plugin.kernels.common import triton


def compiled_variants() -> int | None:
    """How many variants of these kernels this process has compiled (None where Triton does not say)."""
    if triton is None:
        return None
    try:
        kernels = (shrink._shrink_kernel, expand._expand_kernel, fused._lora_kernel, act._silu_mul_lora_kernel)
        kernels += (act._FOLD.fn,) if hasattr(act, "_FOLD") else ()
        return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())
    except (AttributeError, IndexError, TypeError):  # another Triton's JIT layout
        return None
