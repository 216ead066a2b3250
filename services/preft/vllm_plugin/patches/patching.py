"""Idempotent method wrapping: the plugin's register() runs in every vLLM process, possibly more than once."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_MARK = "__preft_original__"


def wrap_method(owner: Any, name: str, make_wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``owner.name`` by ``make_wrapper(original)`` unless it is already ours."""
    original = getattr(owner, name)
    if hasattr(original, _MARK):
        return
    wrapper = make_wrapper(original)
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, _MARK, original)
    setattr(owner, name, wrapper)


def is_wrapped(owner: Any, name: str) -> bool:
    return hasattr(getattr(owner, name), _MARK)
