"""TRL 1.16's GRPOTrainer (``use_vllm=True``, ``vllm_mode="server"``) generating on a PreFT rollout server
(``preft rollout-serve``), its adapter updated in place after every step.

Unchanged TRL: ``GRPOTrainer`` and its config; its generation (``VLLMClient.generate``: token-id prompts posted to
/v1/completions, n per prompt); when it syncs weights (``VLLMGeneration.sync_weights``: once per optimizer step,
then ``reset_prefix_cache``); the endpoints it calls and their bodies; on CUDA, its NCCL group and packed broadcast.

Ours, two things TRL cannot do for a PreFT adapter:
- *what* a sync sends: the adapter's own tensors, named as in its ``adapter_model.safetensors``. TRL merges a PEFT
  LoRA into the base weights and sends those (``VLLMGeneration._iter_named_params``), and sends a DiReFT (no PEFT
  model) as the whole model's parameters; served in prefill mode, the adapter must stay apart from the base model.
- *how* it travels off CUDA: TRL's client refuses to sync without CUDA (NCCL); ours posts one safetensors body to
  the server's /preft/update_weights between TRL's own /start_weight_update and /finish_weight_update calls.

Both ride TRL's classes as small subclasses (``PreftVLLMClient``, ``PreftVLLMGeneration``), which
``rollout_server(policy)`` puts in place while the trainer is built::

    policy = PreftModel.for_lora(base, LoraConfig(...), mode="prefill")
    policy.save_pretrained("adapter0/")   # the server starts on these weights: preft rollout-serve --adapter adapter0
    with rollout_server(policy):
        trainer = GRPOTrainer(model=policy.model, args=GRPOConfig(use_vllm=True, vllm_mode="server",
                              vllm_server_base_url="http://127.0.0.1:8000", ...), ...)
    trainer.train()

Tested with trl 1.16.0 (and vLLM 0.28.0 for TRL's client imports) on CPU, over HTTP; the NCCL path is TRL's.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from trl.generation.vllm_client import VLLMClient
from trl.generation.vllm_generation import VLLMGeneration

from preft.common.rollout_contract import HTTP_UPDATE_PATH, SAFETENSORS_MEDIA_TYPE
from preft.training.model import PreftModel


def adapter_tensors(policy: PreftModel) -> dict[str, torch.Tensor]:
    """The adapter's tensors as the server holds them: named as in its ``adapter_model.safetensors``, detached."""
    if policy.is_lora:
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(policy.model, adapter_name=policy.model.active_adapter)
        return {name: tensor.detach() for name, tensor in state.items()}
    edits = policy.direft.edits
    return {
        f"layers.{layer}.{part}": getattr(edits[str(layer)], part).detach()
        for layer in policy.direft.layers
        for part in ("A", "B", "b")
    }


class PreftVLLMClient(VLLMClient):
    """TRL's client; off CUDA, weight updates go over HTTP as one safetensors body (the server must say it takes
    them: its /server_info weight_transfer_config is ``{"backend": "http"}``). The last update's answer (the
    served version) is kept in `last_update`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.http_updates = False
        self.last_update: dict[str, Any] | None = None
        super().__init__(*args, **kwargs)

    def init_communicator(self, device: torch.device | str | int = 0) -> None:
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.type == "cuda":
            return super().init_communicator(device)
        transfer = self.get_server_info()["weight_transfer_config"]
        if transfer != {"backend": "http"}:
            raise RuntimeError(
                f"the trainer runs on {device}, without CUDA, but the server at {self.base_url} takes weight updates "
                f"by {transfer}: serve rollouts with `preft rollout-serve --weight-transport http`"
            )
        self.http_updates = True

    def update_named_params(self, metadata: list[tuple[str, str, list[int]]], named_params: Iterator[Any]) -> None:
        if not self.http_updates:
            return super().update_named_params(metadata, named_params)
        from safetensors.torch import save

        body = save({name: tensor.detach().to("cpu").contiguous() for name, tensor in named_params})
        if not self._updating_weights:
            self._start_weight_update()
        headers = {"Content-Type": SAFETENSORS_MEDIA_TYPE}
        self._post(f"{self.base_url}{HTTP_UPDATE_PATH}", data=body, headers=headers)
        if not self._updating_weights:
            self._finish_weight_update()

    def _finish_weight_update(self) -> None:
        self.last_update = self._post(f"{self.base_url}/finish_weight_update", json={})


class PreftVLLMGeneration(VLLMGeneration):
    """TRL's vLLM generation for a PreftModel: server mode only, through PreftVLLMClient, syncing the adapter's own
    tensors; `on_update` (when given) is called on the main process after each sync has been applied."""

    def __init__(
        self, *args: Any, policy: PreftModel, on_update: Callable[[dict[str, Any] | None], None] | None, **kwargs: Any
    ) -> None:
        self.policy, self.on_update = policy, on_update
        super().__init__(*args, **kwargs)

    def _init_vllm(self) -> None:
        if self.mode != "server":
            raise ValueError(f"PreFT rollouts need vllm_mode='server' (a `preft rollout-serve`), not {self.mode!r}")
        if self.accelerator.is_main_process:
            base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
            self.vllm_client = PreftVLLMClient(
                base_url=base_url, group_port=self.group_port, connection_timeout=self.server_timeout
            )
            self.vllm_client.init_communicator(device=self.accelerator.device)
        self.accelerator.wait_for_everyone()

    def _iter_named_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from adapter_tensors(self.policy).items()

    def sync_weights(self) -> None:
        super().sync_weights()
        if self.on_update is not None and self.accelerator.is_main_process:
            self.on_update(self.vllm_client.last_update)


@contextlib.contextmanager
def rollout_server(
    policy: PreftModel, *, on_update: Callable[[dict[str, Any] | None], None] | None = None
) -> Iterator[None]:
    """While open, a ``GRPOTrainer`` built with ``use_vllm=True, vllm_mode="server"`` generates through
    PreftVLLMGeneration for `policy` (the trainer keeps it after the block). TRL's trainer module names the class
    it builds; it is swapped there for the block's duration only."""
    from trl.trainer import grpo_trainer

    from preft.training.trl import check_trl_version

    check_trl_version()
    original = grpo_trainer.VLLMGeneration
    grpo_trainer.VLLMGeneration = functools.partial(PreftVLLMGeneration, policy=policy, on_update=on_update)
    try:
        yield
    finally:
        grpo_trainer.VLLMGeneration = original
