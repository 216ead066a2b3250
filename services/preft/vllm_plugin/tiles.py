"""The LoRA kernels' names (``PREFT_LORA_KERNELS``), a kernel's launch shape, the ``PREFT_LORA_TILES``
setting that names the shapes, and the default shapes (``kernels/``; read through ``settings``).

Torch-free, so the engine's settings can check both settings before any process starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# What PREFT_LORA_KERNELS may pick (or "none": the torch path). "act" is the MLP's activation kernel; "fold" (with
# "act" and "shrink") adds the gate/up projection's LoRA inside it instead of into gate/up by the expand; "gluon"
# (with "fold") folds it on Hopper GPUs with the Gluon kernel (``kernels.fold_gluon``) instead of Triton's; "down"
# (with "gluon") has that kernel also compute the down projection's shrink of its output on large steps.
KERNELS = ("expand", "shrink", "fused", "act", "fold", "gluon", "down")
DEFAULT_KERNELS = "expand,shrink,act,fold,gluon,down"


def fold_lacks_its_kernels(names: set[str] | frozenset[str]) -> bool:
    """Whether these kernel names pick "fold" without "act" and "shrink", which it needs (it adds the LoRA
    inside the activation kernel, from the shrink's z), "gluon" without "fold" (its kernel is a fold's), or "down"
    without "gluon" (it is that kernel's)."""
    return (
        ("fold" in names and not {"act", "shrink"} <= names)
        or ("gluon" in names and "fold" not in names)
        or ("down" in names and "gluon" not in names)
    )


@dataclass(frozen=True)
class Tiles:
    """The launch shape of the shrink, the expand or the activation kernel.

    rows: rows per program, a divisor of the groups' row block (each block gets block ÷ rows programs; more rows
    than the block runs as the whole block: the engine's is ``kernels.common.ROW_BLOCK``, 64); cols:
    the expand's output columns per program, the shrink's input columns per iteration of its loop; warps
    and stages: Triton's num_warps and num_stages (the pipeline depth of the shrink's loop); cols_first (the
    expand and the activation): the grid's first axis, the one the device launches fastest, runs over the
    column tiles (programs launched together then cover whole rows of y) instead of the row blocks.
    """

    rows: int
    cols: int
    warps: int = 4
    stages: int = 3
    cols_first: bool = False

    def __post_init__(self) -> None:
        powers = {"rows": (self.rows, 16, 128), "cols": (self.cols, 16, 256), "warps": (self.warps, 1, 16)}
        for name, (value, low, high) in powers.items():
            if not (low <= value <= high and value & (value - 1) == 0):
                raise ValueError(f"tiles: {name} must be a power of two from {low} to {high}, not {value}")
        if not 1 <= self.stages <= 8:
            raise ValueError(f"tiles: stages must be 1 to 8, not {self.stages}")

    @property
    def label(self) -> str:
        """``ROWSxCOLS wWARPS sSTAGES[ cols-first]``: how the sweep names it and ``PREFT_LORA_TILES`` takes it."""
        return f"{self.rows}x{self.cols} w{self.warps} s{self.stages}" + " cols-first" * self.cols_first

    @classmethod
    def parse(cls, label: str) -> Tiles:
        """The shape a label names (warps, stages and the order may be left out)."""
        found = re.fullmatch(r"\s*(\d+)x(\d+)(?:\s*w(\d+))?(?:\s*s(\d+))?(\s+cols-first)?\s*", label)
        if not found:
            raise ValueError(f"tiles: {label!r} is not ROWSxCOLS[ wWARPS][ sSTAGES][ cols-first], e.g. '64x64 w4 s4'")
        rows, cols, warps, stages, cols_first = found.groups()
        return cls(int(rows), int(cols), int(warps or 4), int(stages or 3), cols_first is not None)


# The fastest over a layer of Qwen2.5-0.5B's and Llama-3.1-8B's shapes at ranks 8 and 16, summed over all four
# (loadtest/engine/bench_lora_tiles sweeps them for the GPU it runs on); PREFT_LORA_TILES overrides them
DEFAULT_TILES = {
    "shrink": Tiles(rows=64, cols=64, warps=4, stages=4),
    "expand": Tiles(rows=64, cols=128, warps=8),
    "act": Tiles(rows=64, cols=64, warps=8, stages=1, cols_first=True),  # kernels.act's (the fastest in bench_lora_act)
}


def parse_tiles(setting: str) -> dict[str, Tiles]:
    """``PREFT_LORA_TILES``: ``KERNEL=LABEL`` pairs, comma-separated, for the shrink, the expand and the act."""
    tiles: dict[str, Tiles] = {}
    for part in filter(str.strip, setting.split(",")):
        kernel, sep, label = part.partition("=")
        kernel = kernel.strip()
        if not sep or kernel not in ("shrink", "expand", "act"):
            raise ValueError(f"tiles: {part.strip()!r} is not shrink=LABEL, expand=LABEL or act=LABEL")
        if kernel in tiles:
            raise ValueError(f"tiles: {kernel} given twice")
        tiles[kernel] = Tiles.parse(label)
        if kernel == "shrink" and tiles[kernel].cols_first:
            raise ValueError("tiles: the shrink's grid has one order (cols-first is the expand's and the act's)")
    return tiles
