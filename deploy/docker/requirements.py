"""Print the pinned requirements of the package's core and of the given extras, one per line, from pyproject.toml.

The Dockerfiles install these before copying the code, so a code change rebuilds only the last layer:

    python requirements.py engine gpu > requirements.txt && pip install -r requirements.txt
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    name, optional = project["name"], project.get("optional-dependencies", {})
    wanted, seen, out = list(extras), set(), list(project["dependencies"])
    while wanted:
        extra = wanted.pop()
        if extra in seen:
            continue
        if extra not in optional:
            raise SystemExit(f"unknown extra {extra!r} (known: {', '.join(sorted(optional))})")
        seen.add(extra)
        for req in optional[extra]:
            own = re.fullmatch(rf"{re.escape(name)}\[([\w,\s-]+)\]", req)
            if own:  # (an extra that names others of this package)
                wanted += [e.strip() for e in own.group(1).split(",")]
            elif req not in out:
                out.append(req)
    return out


if __name__ == "__main__":
    print("\n".join(requirements(Path(__file__).resolve().parents[2] / "pyproject.toml", sys.argv[1:])))
