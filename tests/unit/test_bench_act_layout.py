"""``loadtest/bench_act_layout``'s layouts hold gate and up where its kernel reads them: every layout's result is
silu(gate) · up (Triton's interpreter on CPU tensors)."""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("triton")


@pytest.fixture
def layout_bench(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (read as the kernel is decorated: at import)
    from loadtest import bench_act_layout

    yield importlib.reload(bench_act_layout)
    monkeypatch.undo()
    importlib.reload(bench_act_layout)


def test_every_layout_and_launch_shape_computes_the_activation(layout_bench):
    rows, inter = 70, 256  # (rows past the last full block; every interleave divides the width)
    row = layout_bench.bench("qwen05", iters=1, rows=rows, inter=inter, device="cpu")
    names = [name for name, *_ in layout_bench.layouts(torch.zeros(rows, inter), torch.zeros(rows, inter))]
    assert len(names) == 1 + 2 * len(layout_bench.PADS) + 1 + len(layout_bench.INTERLEAVE)
    for name in names:
        shapes = row[name]["shapes"]
        assert shapes, name
        assert all(cell["max_rel_diff"] < 1e-6 for cell in shapes.values()), (name, shapes)


def test_the_layouts_place_gate_and_up_as_named(layout_bench):
    gate, up = torch.arange(128.0).view(1, 128), 1000 + torch.arange(128.0).view(1, 128)
    layouts = {name: (base, stride, tile) for name, base, _, stride, tile in layout_bench.layouts(gate, up)}
    assert layouts["halves"][0].flatten().tolist() == [*gate[0].tolist(), *up[0].tolist()]
    padded, stride, _ = layouts["halves, rows padded by 64"]
    assert stride == 2 * 128 + 64 and padded[0, :256].tolist() == layouts["halves"][0][0].tolist()
    shifted, stride, _ = layouts["halves, up shifted by 64"]
    assert stride == 2 * 128 + 64 and shifted[0, :128].tolist() == gate[0].tolist()
    assert shifted[0, 128 + 64 :].tolist() == up[0].tolist()
    mixed, stride, tile = layouts["interleaved 64"]
    assert (stride, tile) == (256, 64)
    assert mixed[0].tolist() == torch.cat((gate[0, :64], up[0, :64], gate[0, 64:], up[0, 64:])).tolist()
    assert "interleaved 256" not in layouts  # (it does not divide the width)
