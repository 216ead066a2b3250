"""triton_launch: each key's first launch goes through Triton, later ones straight to the compiled launcher."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from preft.vllm_plugin import settings
from preft.vllm_plugin.kernels import triton_launch


class FakeCompiled:
    """A compiled variant: records what its launcher was called with."""

    def __init__(self) -> None:
        self.function, self.packed_metadata, self.launches = object(), object(), []

    def run(self, *args) -> None:
        self.launches.append(args)


class FakeKernel:
    """A JIT function: `fn[grid](*args, ...)` compiles (a new variant per distinct args) and launches it."""

    __name__ = "fake_kernel"

    def __init__(self) -> None:
        self.variants: dict[tuple, FakeCompiled] = {}
        self.through_triton: list[tuple] = []

    def __getitem__(self, grid):
        def launch(*args, num_warps, num_stages):
            self.through_triton.append((grid, args, num_warps, num_stages))
            return self.run(*args, grid=grid, warmup=True, num_warps=num_warps, num_stages=num_stages)

        return launch

    def run(self, *args, grid, warmup, num_warps, num_stages):
        return self.variants.setdefault((args[0] % 16, num_warps, num_stages), FakeCompiled())


class EmptyHookChain:
    """What Triton 3.6+ keeps as a launch hook where none is set (``knobs.HookChain``)."""

    def __init__(self) -> None:
        self.calls: list = []


@pytest.fixture
def launcher(monkeypatch):
    """A Launcher over FakeKernel, as on a tested Triton with a GPU (device 0, stream 7, no launch hook)."""
    active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 7)
    monkeypatch.setattr(triton_launch, "driver", SimpleNamespace(active=active), raising=False)
    hooks = SimpleNamespace(launch_enter_hook=EmptyHookChain(), launch_exit_hook=None)
    monkeypatch.setattr(triton_launch, "knobs", SimpleNamespace(runtime=hooks), raising=False)
    launch = triton_launch.Launcher(FakeKernel())
    launch.direct = True
    return launch


def test_a_key_goes_through_triton_once_then_straight_to_its_variant(launcher):
    fn = launcher.fn
    launcher((3, 2), ("a",), (32, 5, True), 4, 3)
    launcher((5, 2), ("a",), (48, 6, True), 4, 3)
    assert len(fn.through_triton) == 1
    (compiled,) = fn.variants.values()
    # the second launch: the grid, a z of 1, the stream, the variant's handles, no hook, then every argument
    assert compiled.launches == [
        (5, 2, 1, 7, compiled.function, compiled.packed_metadata, None, None, None, 48, 6, True)
    ]
    launcher((3, 2), ("b",), (33, 5, True), 4, 3)  # another key: through Triton again, its own variant
    assert len(fn.through_triton) == 2 and len(fn.variants) == 2


def test_triton_mode_and_a_launch_hook_always_go_through_triton(launcher):
    launcher((1, 1), ("a",), (16,), 4, 3)
    with triton_launch.launching("triton"):
        launcher((1, 1), ("a",), (16,), 4, 3)
    triton_launch.knobs.runtime.launch_enter_hook.calls.append(print)  # e.g. a profiler's
    launcher((1, 1), ("a",), (16,), 4, 3)
    triton_launch.knobs.runtime.launch_enter_hook, triton_launch.knobs.runtime.launch_exit_hook = None, print
    launcher((1, 1), ("a",), (16,), 4, 3)
    assert len(launcher.fn.through_triton) == 4
    assert all(not c.launches for c in launcher.fn.variants.values())


def test_check_mode_fails_when_a_key_holds_another_variant_than_triton_picks(launcher):
    launcher((1, 1), ("a",), (16,), 4, 3)
    with triton_launch.launching("check"):
        launcher((1, 1), ("a",), (32,), 4, 3)  # 32 % 16 == 16 % 16: the same variant, launched directly
        assert len(launcher.fn.through_triton) == 1
        with pytest.raises(AssertionError, match="fake_kernel: key \\('a',\\) holds another variant"):
            launcher((1, 1), ("a",), (17,), 4, 3)  # a key too coarse for what Triton specializes on


def test_without_a_compiled_kernel_every_launch_goes_through_triton(monkeypatch):
    """The interpreter (its kernels are not JITFunctions) or a Triton whose launch convention is untested."""
    fn = FakeKernel()
    launch = triton_launch.Launcher(fn)
    assert not launch.direct
    for _ in range(2):
        launch((1, 1), ("a",), (16,), 4, 3)
    assert len(fn.through_triton) == 2


def test_a_bad_setting_stops_the_settings_load_with_what_is_wrong(monkeypatch):
    monkeypatch.setenv("PREFT_TRITON_LAUNCH", "fast")
    importlib.reload(triton_launch)  # (read at the settings' load, never at import)
    with pytest.raises(ValueError, match="PREFT_TRITON_LAUNCH must be one of direct, triton, check, not 'fast'"):
        settings.load()
    monkeypatch.delenv("PREFT_TRITON_LAUNCH")
    settings.load()
    assert triton_launch.mode() == "direct"
    with pytest.raises(ValueError, match="not 'fast'"), triton_launch.launching("fast"):
        pass
    assert triton_launch.mode() == "direct"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="direct launches need CUDA")
def test_direct_launches_match_tritons_on_cuda():
    """The LoRA kernels compiled, through both launch paths: the same bits, every key fine by the check mode,
    and the torch path's result."""
    from loadtest.engine.bench_lora_kernels import step

    from preft.vllm_plugin.kernels import expand, fused, shrink
    from preft.vllm_plugin.kernels.plans import PlanCache
    from preft.vllm_plugin.step import lora
    from preft.vllm_plugin.step.state import using

    assert shrink._SHRINK.direct, "this Triton's launches are not direct: see triton_launch.TESTED"
    modules, ys, groups = step("qwen05", 8, 2048, 256, 64, torch.device("cuda"))

    def run(*kernels: str) -> list[torch.Tensor]:
        for y in ys:
            y.zero_()
        with using(*kernels):
            for (x, _, a, b, slices), y in zip(modules, ys, strict=True):
                lora.lora_linear(y, x, a, b, slices, 1.0, groups, plans=plans)
        return [y.clone() for y in ys]

    plans = PlanCache()
    reference = run()  # the torch path
    results = {}
    for launcher in (shrink._SHRINK, expand._EXPAND, fused._FUSED):
        launcher.variants.clear()  # (what earlier tests launched)
    for kernels in (("expand", "shrink"), ("fused",)):
        for mode in ("triton", "direct", "check"):  # (check: the direct pass's variants, each asked of Triton)
            with triton_launch.launching(mode):
                results[kernels, mode] = run(*kernels)
        launchers = (shrink._SHRINK, expand._EXPAND) if "shrink" in kernels else (fused._FUSED,)
        assert all(launcher.variants for launcher in launchers), "the direct pass launched nothing directly"
        for mode in ("direct", "check"):
            assert all(
                torch.equal(d, t) for d, t in zip(results[kernels, mode], results[kernels, "triton"], strict=True)
            )
        for k, t in zip(results[kernels, "direct"], reference, strict=True):  # (bf16: as bench_lora_kernels allows)
            assert float((k - t).abs().max()) <= 0.02 * float(t.abs().max()), f"{kernels} against the torch path"
