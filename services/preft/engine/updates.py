"""What an in-place adapter weight update answers, and how its tensors travel from the engine's client to vLLM's
workers: one safetensors file in shared memory, written here and read once by each worker, in place of pushing the
tensors through vLLM's request channels (msgpack over ZeroMQ, then the executor's queue), which would copy them
several times and whose utility calls do not decode the tensors in their arguments back into tensors.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHARED_MEMORY = Path("/dev/shm")


@dataclass(frozen=True)
class AdapterUpdate:
    """An applied update: the adapter's new version (its prefix-cache key; versions only grow), how long it took,
    and whether it waited for prompts of that adapter already running (a request runs its prompt on one set of
    weights)."""

    version: int
    seconds: float  # from the call to the new weights serving
    waited_for: int  # the adapter's requests part-way through their prompt when it arrived
    waited_steps: int  # engine steps it waited for them


def staging_dir(size_bytes: int) -> Path:
    """Shared memory where it has room for the file (twice over), else the temporary directory."""
    try:
        if shutil.disk_usage(SHARED_MEMORY).free > 2 * size_bytes:
            return SHARED_MEMORY
    except OSError:
        pass
    return Path(tempfile.gettempdir())


def stage_tensors(tensors: Mapping[str, Any]) -> Path:
    """Write the tensors (moved to the CPU) to a new safetensors file only this user can read; the caller removes it."""
    from safetensors.torch import save_file

    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    size = sum(t.numel() * t.element_size() for t in cpu.values())
    fd, name = tempfile.mkstemp(prefix="preft-update-", suffix=".safetensors", dir=staging_dir(size))
    os.close(fd)
    path = Path(name)
    try:
        save_file(cpu, str(path))
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path
