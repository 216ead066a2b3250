"""Position modes and how a request carries one through vLLM (``SamplingParams.extra_args``)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

MODE_KEY = "preft_mode"


class PositionMode(StrEnum):
    """Which positions an adapter is applied to."""

    PREFILL = "prefill"  # PreFT: prompt positions only; generated positions use the base model
    ALL = "all"  # classic PEFT: every position


def mode_extra_args(mode: PositionMode | str) -> dict[str, str]:
    """The ``SamplingParams.extra_args`` that select a mode."""
    return {MODE_KEY: PositionMode(mode).value}


def is_prefill_only(sampling_params: Any) -> bool:
    """True when the request's adapter applies to prompt positions only (missing means ``all``)."""
    extra = getattr(sampling_params, "extra_args", None)
    return bool(extra) and extra.get(MODE_KEY) == PositionMode.PREFILL.value
