"""The plugin's settings, read from the environment once: at ``register()`` (which runs in every vLLM process) or
at first use, never at import.

``PREFT_LORA_KERNELS`` picks the LoRA kernels (``kernels.policy``), ``PREFT_LORA_TILES`` their launch shapes
(``tiles``), ``PREFT_TRITON_LAUNCH`` how they are launched (``kernels.triton_launch``). An engine core forked from
its client inherits the client's settings with its registration, as it inherited the kernels' modules before.
``PREFT_GC_FREEZE`` is the exception: ``patches.gc_freeze`` asks ``gc_freeze_enabled`` at each idle moment, so
that an engine started after the setting changed in its client's process follows the new value.

Benchmarks and tests change the current settings for a while with ``override`` (``kernels.policy``'s and
``step.warmup``'s ``using``, ``tiled``, ``launching``, ``rank_vectors`` wrap it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

from preft.vllm_plugin.tiles import DEFAULT_KERNELS, DEFAULT_TILES, KERNELS, Tiles, fold_lacks_its_kernels, parse_tiles

logger = logging.getLogger(__name__)

TRITON_LAUNCH_MODES = ("direct", "triton", "check")


def parse_kernels(setting: str) -> frozenset[str]:
    """``PREFT_LORA_KERNELS``' names: unknown ones and a fold without its kernels logged (and left out or idle)."""
    names = {n.strip() for n in setting.split(",")} - {"", "none", "0"}
    if names - set(KERNELS):
        logger.warning("PREFT_LORA_KERNELS: unknown %s (known: %s)", sorted(names - set(KERNELS)), KERNELS)
    if fold_lacks_its_kernels(names):
        logger.warning("PREFT_LORA_KERNELS: 'fold' serves only beside 'act' and 'shrink', 'gluon' beside 'fold'")
    return frozenset(names & set(KERNELS))


def check_triton_launch(setting: str) -> str:
    if setting not in TRITON_LAUNCH_MODES:
        raise ValueError(f"PREFT_TRITON_LAUNCH must be one of {', '.join(TRITON_LAUNCH_MODES)}, not {setting!r}")
    return setting


@dataclasses.dataclass(frozen=True)
class PluginSettings:
    """What the plugin's kernels run with in this process."""

    lora_kernels: frozenset[str]  # the kernels picked (PREFT_LORA_KERNELS; empty: the torch path)
    lora_tiles: Mapping[str, Tiles]  # each kernel's launch shape (PREFT_LORA_TILES over ``DEFAULT_TILES``)
    triton_launch: str = "direct"  # PREFT_TRITON_LAUNCH: ``TRITON_LAUNCH_MODES``
    rank_vectors: bool = True  # the kernels' RANK_ALIGNED variants where they apply (off: the benchmarks' baseline)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> PluginSettings:
        """The settings the environment names; a bad PREFT_LORA_TILES or PREFT_TRITON_LAUNCH raises ValueError."""
        return cls(
            lora_kernels=parse_kernels(environ.get("PREFT_LORA_KERNELS", DEFAULT_KERNELS)),
            lora_tiles=MappingProxyType({**DEFAULT_TILES, **parse_tiles(environ.get("PREFT_LORA_TILES", ""))}),
            triton_launch=check_triton_launch(environ.get("PREFT_TRITON_LAUNCH", "direct")),
        )


_current: PluginSettings | None = None


def load(environ: Mapping[str, str] = os.environ) -> PluginSettings:
    """Read the settings from the environment (``register()`` does, once a process) and make them current."""
    global _current
    _current = PluginSettings.from_env(environ)
    return _current


def current() -> PluginSettings:
    """The settings in force (read from the environment on first use if ``load`` has not run)."""
    return _current if _current is not None else load()


def replace(**changes: Any) -> PluginSettings:
    """Change the current settings for good (e.g. no kernels, when they cannot compile)."""
    global _current
    _current = dataclasses.replace(current(), **changes)
    return _current


@contextlib.contextmanager
def override(**changes: Any) -> Iterator[PluginSettings]:
    """These settings for everything run in this process meanwhile, then those before (benchmarks, tests)."""
    global _current
    before = current()
    _current = dataclasses.replace(before, **changes)
    try:
        yield _current
    finally:
        _current = before


def gc_freeze_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """``PREFT_GC_FREEZE`` (on unless 0, false, no or off), read at each call (see the module's note)."""
    return environ.get("PREFT_GC_FREEZE", "1").strip().lower() not in ("0", "false", "no", "off")


def allow_untested_vllm(environ: Mapping[str, str] = os.environ) -> bool:
    """``PREFT_ALLOW_UNTESTED_VLLM=1``: run on a vLLM release the plugin was not tested on (``compat``)."""
    return environ.get("PREFT_ALLOW_UNTESTED_VLLM") == "1"
