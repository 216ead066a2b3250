"""Generate the Python gRPC stubs from proto/ (a build output: `python -m preft.common.protogen`).

The stubs land in services/preft/api/v1/ (package `preft.api.v1`, ignored by git) and are never edited by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PROTO_ROOT = REPO / "proto"
OUT_ROOT = REPO / "services"


def generate() -> list[Path]:
    """Run protoc over every .proto file under proto/; return the generated files."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={OUT_ROOT}",
        f"--pyi_out={OUT_ROOT}",
        f"--grpc_python_out={OUT_ROOT}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos}")
    generated = []
    for proto in protos:
        package_dir = OUT_ROOT / Path(proto).parent
        for d in [package_dir, *package_dir.parents]:
            if d == OUT_ROOT or OUT_ROOT not in d.parents:
                break
            init = d / "__init__.py"
            if not init.exists():
                init.write_text('"""Generated from proto/ by `python -m preft.common.protogen`; do not edit."""\n')
        generated += sorted(package_dir.glob(f"{Path(proto).stem}_pb2*.py*"))
    return generated


if __name__ == "__main__":
    for path in generate():
        print(path.relative_to(REPO))
    sys.exit(0)
