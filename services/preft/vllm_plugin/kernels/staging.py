"""Host arrays to the device through one staging buffer: the step's groups, the kernels' per-step tables and vLLM's
LoRA metadata are built on the host with numpy and copied in one transfer each."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def staged(arrays: Sequence[np.ndarray], pinned: bool) -> torch.Tensor:
    """Host arrays end to end in one new int64 host tensor (pinned: for a copy to CUDA), written by numpy.

    One allocation and one pass: ``pin_memory()`` of an array allocates and copies again, and torch splits a
    long CPU copy across its thread pool, whose threads then spin, on every adapted step.
    """
    sizes = [np.size(a) for a in arrays]
    host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=pinned)
    np.concatenate([np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays], out=host.numpy())
    return host


def to_device(arrays: tuple[np.ndarray, ...], device: torch.device) -> list[torch.Tensor]:
    """int64 host arrays as device tensors, through one staging buffer and one copy.

    On CUDA the buffer is pinned: a copy from pageable memory first waits for all work queued on the stream,
    and with vLLM's async scheduling the next step is prepared while the current one runs on the GPU.
    """
    host = staged(arrays, pinned=device.type == "cuda")
    if device.type != "cpu":
        host = host.to(device, non_blocking=True)
    return list(torch.split(host, [len(a) for a in arrays]))
