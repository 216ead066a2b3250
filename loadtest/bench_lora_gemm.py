"""A layer's LoRA linears in one GEMM each (``lora_gemm``: the LoRA's product in the GEMM's epilogue) against
cuBLAS then the LoRA (the engine's order), on a full prefill step of each model.

    python3 -m loadtest.bench_lora_gemm --out $OUT/gpu-lora-gemm   # on the GPU machine

Shapes marked tma are persistent and load x's and W's tiles through TMA descriptors.
The step: 16,384 tokens in groups of 1,024, 512 slots, rank 8, every token adapted, a decoder layer's four
linears. Per launch shape of the GEMM: the Triton GEMM without LoRA tokens (its own speed against cuBLAS) and
with them (the shrink, then the GEMM); per module, cuBLAS, cuBLAS then the LoRA, and the best shape's GEMM.
Whether it would pay in the engine: `fused_speedup` (the engine's order over the best shape's, per layer).
"""

from __future__ import annotations

import numpy as np
import torch

from loadtest.bench_lora_kernels import _timed, max_rel_diff, step
from loadtest.bench_lora_launch import per_model_main
from preft.vllm_plugin import groups as g
from preft.vllm_plugin import lora_gemm, lora_kernels
from preft.vllm_plugin.lora_gemm import GemmTiles

SHAPES = (
    GemmTiles(128, 128, 64, 8, 8, 3),
    GemmTiles(128, 128, 64, 8, 4, 4),
    GemmTiles(128, 128, 64, 8, 8, 4),
    GemmTiles(64, 128, 64, 8, 4, 4),
    GemmTiles(128, 128, 128, 8, 8, 3),
    GemmTiles(256, 128, 64, 8, 8, 3),
    GemmTiles(128, 128, 64, 8, 8, 3, tma=True),
    GemmTiles(128, 128, 64, 8, 4, 4, tma=True),
    GemmTiles(128, 128, 128, 8, 8, 3, tma=True),
    GemmTiles(256, 128, 64, 8, 8, 3, tma=True),
    GemmTiles(256, 128, 64, 8, 8, 4, tma=True),
)


def _name(t: GemmTiles) -> str:
    return f"{t.rows}x{t.cols}x{t.depth} g{t.group} w{t.warps} s{t.stages}{' tma' if t.tma else ''}"


def bench(model: str, rank: int, iters: int, tokens: int = 16384, device: str = "cuda") -> dict:
    """ms per layer of each order and launch shape (`tokens`, `device`: a smaller run, e.g. under Triton's
    interpreter)."""
    device = torch.device(device)
    modules, ys, groups = step(model, rank, tokens, min(1024, tokens), 512, device)
    none = g.SlotGroups.build(np.full(tokens, -1), device, slot_ranks=np.zeros(512, dtype=np.int64), max_rank=rank)
    splits = [lora_kernels.split_plan(y, x, a, b, s) for (x, _, a, b, s), y in zip(modules, ys, strict=True)]

    def cublas(i: int) -> None:
        x, w, *_ = modules[i]
        torch.matmul(x, w.t(), out=ys[i])

    def engine(i: int) -> None:
        cublas(i)
        lora_kernels.split_linear(ys[i], modules[i][0], splits[i], 1.0, groups)

    def layer(fn) -> callable:
        return lambda: [fn(i) for i in range(len(modules))]

    def outputs(fn) -> list[torch.Tensor]:
        layer(fn)()
        return [y.to(torch.float32, copy=True) for y in ys]

    row: dict = {"model": model, "rank": rank, "tokens": tokens}
    row["cublas_ms"] = _timed(layer(cublas), device, iters)[0] * 1e3
    row["engine_ms"] = _timed(layer(engine), device, iters)[0] * 1e3
    expected = outputs(engine)
    shapes, best = {}, None
    for tiles in SHAPES:
        plans = [lora_gemm.gemm_plan(s, y.shape[1], tiles.cols) for s, y in zip(splits, ys, strict=True)]
        if any(p is None for p in plans):
            continue

        def fused(i: int, tiles=tiles, plans=plans, groups=groups) -> None:
            x, w, *_ = modules[i]
            lora_gemm.gemm_lora(ys[i], x, w, None, plans[i], groups, tiles)

        try:
            plain = _timed(layer(lambda i, fused=fused: fused(i, groups=none)), device, iters)[0] * 1e3
            with_lora = _timed(layer(fused), device, iters)[0] * 1e3
        except Exception as e:  # a shape this Triton or device cannot compile: say so, time the others
            shapes[_name(tiles)] = {"error": repr(e)[:300]}
            continue
        diff = max_rel_diff(outputs(fused), expected)
        shapes[_name(tiles)] = {"gemm_ms": plain, "gemm_lora_ms": with_lora, "max_rel_diff": diff}
        if best is None or with_lora < shapes[_name(best[0])]["gemm_lora_ms"]:
            best = (tiles, fused)
    row["shapes"] = shapes
    if best is not None:
        tiles, fused = best
        row["best_shape"] = _name(tiles)
        row["fused_ms"] = shapes[_name(tiles)]["gemm_lora_ms"]
        row["fused_speedup"] = row["engine_ms"] / row["fused_ms"]
        row["per_module_ms"] = [
            {
                name: _timed(lambda fn=fn, i=i: fn(i), device, iters)[0] * 1e3
                for name, fn in (("cublas", cublas), ("engine", engine), ("fused", fused))
            }
            for i in range(len(modules))
        ]
    return row


def main() -> None:
    with lora_kernels.using("expand", "shrink"):
        per_model_main(__doc__, bench)


if __name__ == "__main__":
    main()
