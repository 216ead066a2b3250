"""The LoRA kernel benchmark on CPU: every path runs, on the same step, and agree."""

from __future__ import annotations

import argparse

import pytest
import torch
from loadtest.engine import bench_lora_kernels


def test_bench_times_both_paths_and_they_agree(lora_kernels_interpreted):
    row = bench_lora_kernels.bench("qwen05", 16, 128, 64, 8, torch.device("cpu"), 1)
    paths = ("expand", "expand+shrink", "fused")
    assert row["lora_torch_ms"] > 0 and all(row[f"lora_{path}_ms"] > 0 for path in paths)
    assert all(row[f"{path}_max_rel_diff"] < 1e-5 for path in paths)


def test_a_step_can_hold_prompts_without_adapters():
    """bench_lora_act's mixed step: every other group of 64 tokens without an adapter, the rest as before."""
    cpu = torch.device("cpu")
    every = bench_lora_kernels.step_groups(8, 256, 64, 8, cpu)
    mixed = bench_lora_kernels.step_groups(8, 256, 64, 8, cpu, base_every=2)
    assert (mixed.token_slots[64:128] == -1).all() and (mixed.token_slots[192:] == -1).all()
    assert (mixed.token_slots[:64] == every.token_slots[:64]).all() and (every.token_slots >= 0).all()
    assert (mixed.token_slots[128:192] == every.token_slots[128:192]).all()


def test_tiles_sweep_times_each_kernel_per_linear_and_checks_every_shape(lora_kernels_interpreted, monkeypatch):
    """On a layer of small widths, two shapes per kernel: every linear gets a time and a check per shape."""
    from loadtest.engine import bench_lora_kernels as kernels
    from loadtest.engine import bench_lora_tiles

    from preft.vllm_plugin import settings
    from preft.vllm_plugin.tiles import Tiles, parse_tiles

    monkeypatch.setitem(kernels.SHAPES, "tiny", (64, (64, 16, 16), 128))
    other = Tiles(rows=32, cols=32, warps=4, stages=2)
    monkeypatch.setattr(bench_lora_tiles, "shapes", lambda kernel: [settings.current().lora_tiles[kernel], other])
    row = bench_lora_tiles.sweep("tiny", 8, 256, 128, 4, torch.device("cpu"), 1)
    assert list(row["linears"]) == ["qkv", "o", "gate_up", "down"]
    for linear in row["linears"].values():
        for kernel in ("shrink", "expand"):
            shapes = linear[kernel]["shapes"]
            assert set(shapes) == {linear[kernel]["default"], "32x32 w4 s2"}
            assert all(s["us"] > 0 and s["max_rel_diff"] < 1e-5 for s in shapes.values())
    summary = row["summary"]
    assert summary["shrink"]["per_linear_best_us"] <= summary["shrink"]["uniform_best_us"]
    assert summary["expand"]["uniform_best_us"] <= summary["expand"]["default_us"]
    tiles = parse_tiles(bench_lora_tiles.fastest_overall([row, row]))
    assert set(tiles) == {"shrink", "expand"}
    assert all(tiles[k].label in row["linears"]["qkv"][k]["shapes"] for k in tiles)


def test_shrink_bench_times_each_width_per_linear_and_checks_it(lora_kernels_interpreted, monkeypatch, tmp_path):
    """Widths that put one, two and all of q/k/v's three slices in a program: each times every linear, each
    computes the same z as one slice a program, and the report and its plot are written."""
    from loadtest.engine import bench_lora_kernels as kernels
    from loadtest.engine import bench_lora_shrink

    from preft.vllm_plugin.kernels import shrink

    monkeypatch.setitem(kernels.SHAPES, "tiny", (64, (64, 16, 16), 128))
    width = shrink.SHRINK_WIDTH
    row = bench_lora_shrink.bench("tiny", 16, 256, 128, 4, torch.device("cpu"), 1, [0, 32, 64], 2)
    assert width == shrink.SHRINK_WIDTH  # (restored)
    assert list(row["linears"]) == ["qkv", "o", "gate_up", "down"]
    qkv = row["linears"]["qkv"]
    assert qkv["slices_per_program"] == {0: 1, 32: 2, 64: 4}
    assert row["linears"]["o"]["slices_per_program"] == {0: 1, 32: 1, 64: 1}
    for linear in row["linears"].values():
        assert all(len(t) == 2 and min(t) > 0 for t in linear["rounds_us"].values())
        assert all(d < 1e-5 for d in linear["max_rel_diff_from_one_slice_a_program"].values())
    assert row["layer_us"][32] == sum(e["us"][32] for e in row["linears"].values())
    assert bench_lora_shrink.width_list("0,128") == [0, 128]
    for bad in ("abc", "64,-1", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="whole numbers, 0 or more"):
            bench_lora_shrink.width_list(bad)
    out = tmp_path / "shrink"
    bench_lora_shrink.write_plot({"device": "cpu", "widths": [0, 32, 64], "rows": [row, row]}, out)
    assert out.with_suffix(".png").stat().st_size > 0


def test_bench_options_refuse_unknown_models_and_bad_ranks(capsys):
    """The kernel benches' --models and --ranks are checked as they are parsed: a clear usage error, not a
    traceback after the GPU work has started."""
    ap = argparse.ArgumentParser()
    bench_lora_kernels.add_step_arguments(ap, ranks="8,16", group_size=64, iters=1)
    picked = bench_lora_kernels.models_and_ranks(ap.parse_args(["--models", "llama8b", "--ranks", "64"]))
    assert list(picked) == [("llama8b", 64)]
    assert len(list(bench_lora_kernels.models_and_ranks(ap.parse_args([])))) == 4  # both models at each default rank
    for bad in (["--models", "qwen05,nosuch"], ["--models", ","], ["--ranks", "8,x"], ["--ranks", "0"]):
        with pytest.raises(SystemExit) as exit_:
            ap.parse_args(bad)
        assert exit_.value.code == 2
        assert bad[1] in capsys.readouterr().err


def test_ncu_step_runs_the_layers_lora_kernels_once_per_call():
    """ncu_lora_step's call (what Nsight Compute profiles on the GPU) adds every LoRA linear's product."""
    from loadtest.engine import ncu_lora_step

    args = argparse.Namespace(tokens=128, group_size=64, slots=8)
    run, ys, out = ncu_lora_step.layer("qwen05", 8, args, torch.device("cpu"))
    out.fill_(float("nan"))
    run()
    assert all(y.abs().sum() > 0 for y in ys)  # (gate/up's too: off CUDA its LoRA is added, not folded)
    assert not out.isnan().any()
