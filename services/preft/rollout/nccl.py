"""The rollout server's end of TRL's NCCL weight-update group (CUDA only): the server process joins as the one rank
after the trainer's and receives TRL's packed broadcast into CUDA tensors, which the service then stages.

Adapter tensors are small, so they are received here, in the process that answers HTTP, and handed to the engine's
in-place update (a file in shared memory), rather than into vLLM's workers as vLLM's own weight-transfer engine
does for base weights. Not yet run on a GPU: the CPU tests cover the HTTP transport only.
"""

from __future__ import annotations

from typing import Any

from preft.common.rollout_contract import InitInfo, UpdateInfo

# The vLLM symbols used (vLLM 0.28.0: the consumers of what TRL 1.16's client sends with vLLM's producers)
VLLM_API = (
    "vllm.distributed.weight_transfer.nccl_common:stateless_init_process_group",
    "vllm.distributed.weight_transfer.packed_tensor:packed_nccl_broadcast_consumer",
)


class NcclReceiver:
    """Owns this process's communicator in the trainer's group (rank `rank_offset`, the trainer being rank 0)."""

    def __init__(self, info: InitInfo) -> None:
        import torch
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

        self.device = torch.device("cuda", torch.cuda.current_device())
        self.extra = info.model_extra or {}  # (a trainer's packed-buffer geometry, when it sends one)
        self.packed = info.packed
        self.group = stateless_init_process_group(
            info.master_address, info.master_port, info.rank_offset, info.world_size, device=self.device
        )

    def receive(self, info: UpdateInfo) -> dict[str, Any]:
        """Every tensor `info` announces, in its order, copied out of the receive buffers."""
        import torch
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

        specs = zip(info.names, info.dtype_names, info.shapes, strict=True)
        announced = [(name, (shape, getattr(torch, dtype))) for name, dtype, shape in specs]
        received: dict[str, Any] = {}
        if not self.packed:
            for name, (shape, dtype) in announced:
                tensor = torch.empty(shape, dtype=dtype, device=self.device)
                self.group.broadcast(tensor, src=0, stream=torch.cuda.current_stream())
                received[name] = tensor
            return received

        def keep(items: list[tuple[str, Any]]) -> None:
            received.update((name, tensor.clone()) for name, tensor in items)  # (the buffers are reused)

        wire = {"packed_buffer_size_bytes": "buffer_size_bytes", "packed_num_buffers": "num_buffers"}
        geometry = {ours: self.extra[theirs] for theirs, ours in wire.items() if theirs in self.extra}
        packed_nccl_broadcast_consumer(iter(announced), self.group, 0, keep, device=self.device, **geometry)
        torch.cuda.synchronize(self.device)
        return received
