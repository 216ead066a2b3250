"""Every vLLM internal listed in compat exists in the installed vLLM, and the plugin installs idempotently."""

from __future__ import annotations

import importlib

import pytest

from preft.vllm_plugin import compat


@pytest.mark.parametrize("point", compat.TOUCH_POINTS, ids=lambda p: p.symbol)
def test_touch_point_exists(point):
    module_name, attr_path = point.symbol.split(":")
    obj = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    assert obj is not None
    importlib.import_module(f"preft.vllm_plugin.{point.ours}")


def test_each_touch_point_is_listed_once_and_resolves_its_owner():
    symbols = [point.symbol for point in compat.TOUCH_POINTS]
    assert len(symbols) == len(set(symbols))
    for point in compat.TOUCH_POINTS:
        assert getattr(point.owner(), point.attr) is point.resolve()


def test_installed_vllm_is_a_tested_release():
    assert compat.check_version() in compat.TESTED_VLLM_VERSIONS


def test_register_is_idempotent():
    from preft import vllm_plugin
    from preft.vllm_plugin.patches.patching import is_wrapped

    vllm_plugin.register()
    vllm_plugin.register()
    scheduler = compat.scheduler_cls()
    assert is_wrapped(scheduler, "schedule")
    original = scheduler.schedule.__preft_original__
    assert not hasattr(original, "__preft_original__"), "wrapped twice"
