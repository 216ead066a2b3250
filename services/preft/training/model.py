"""A causal LM with one PreFT adapter, applied only at the positions its mode says, in one forward pass.

``PreftModel`` wraps a Hugging Face causal LM carrying either a peft LoRA (a ``PeftModel``) or a DiReFT adapter
(``DireftAdapter``, attached to the model as ``preft_direft``) and installs hooks that gate the adapter per
position (``preft.training.positions``):

- on every LoRA ``lora_B`` module: its output (the LoRA delta before scaling) is multiplied by the gate;
- on every decoder layer a DiReFT edits: Bᵀ(A·h + b) is added to the layer's output where the gate is open;
- on the top-level module (the one a trainer calls): ``prompt_mask=`` / ``prompt_lengths=`` are taken out of the
  call, or the prompt is read from ``labels`` (positions before the first scored one), as TRL's trainers pass them;
- on the decoder stack: the gate of the pass is decided — the caller's mask, else (generation) ON for the prompt
  pass and, in prefill mode, OFF once the KV cache holds tokens.

The hooks live on ``PreftModel.model``, so that module itself — the ``PeftModel`` or the HF model — can be handed
to TRL's trainers, whose calls (``model(input_ids=…, attention_mask=…, labels=…)``, ``model.generate(…)``) then
run the PreFT way with nothing else changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from preft.adapters.formats import AdapterMethod, ModelShape, check_adapter
from preft.common.modes import PositionMode
from preft.training.direft import DireftAdapter, DireftConfig
from preft.training.positions import (
    OFF,
    PositionGate,
    PromptSplitError,
    check_unpacked,
    gate_delta,
    mask_from_labels,
    mask_from_lengths,
)

DIREFT_ATTRIBUTE = "preft_direft"  # where the DiReFT module hangs on the HF model (so trainers see its parameters)
DEFAULT_MAX_RANK = 4096  # the format check's rank limit on save and load; the registry applies its own


class UnsupportedAdapterError(ValueError):
    """An adapter configuration that PreFT's per-position gating cannot apply exactly (merged, DoRA, …)."""


def _hf_model(model: nn.Module) -> nn.Module:
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


def _backbone(hf_model: nn.Module) -> nn.Module:
    backbone = getattr(hf_model, getattr(hf_model, "base_model_prefix", "model"), None)
    if backbone is None or not hasattr(backbone, "layers"):
        raise UnsupportedAdapterError(f"{type(hf_model).__name__} has no decoder stack with .layers")
    return backbone


def _input_shape(args: tuple, kwargs: dict[str, Any]) -> tuple[int, int]:
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs["inputs_embeds"][..., 0]
    return ids.shape[0], ids.shape[1]


class PreftModel(nn.Module):
    """Owns one adapter's position gating on a causal LM: the hooks, the gate, saving and loading the adapter.

    ``mode`` is ``prefill`` (the adapter on prompt positions only, as PreFT serves it) or ``all`` (every
    position, classic PEFT). ``forward`` takes the prompt as ``prompt_lengths`` [batch] or ``prompt_mask``
    [batch, seq] (True on prompt positions) or, without either, reads it from ``labels``.
    """

    def __init__(self, model: nn.Module, *, mode: PositionMode | str = PositionMode.PREFILL) -> None:
        super().__init__()
        from peft import PeftModel

        self.model = model
        self.gate = PositionGate(PositionMode(mode))
        # (kept out of nn.Module's registry: they are parts of self.model, not extra submodules)
        self.__dict__["hf_model"] = _hf_model(model)
        self.__dict__["backbone"] = _backbone(self.hf_model)
        self.__dict__["direft"] = getattr(self.hf_model, DIREFT_ATTRIBUTE, None)
        self.is_lora = isinstance(model, PeftModel)
        if self.is_lora == (self.direft is not None):
            raise UnsupportedAdapterError("a PreftModel needs exactly one adapter: a peft LoRA or a DiReFT")
        self._handles: list[Any] = []
        self._lora_layers: list[nn.Module] = []
        self._hooked_lora_b: set[int] = set()
        self._lora_adapters: frozenset[str] = frozenset()
        self._handles.append(model.register_forward_pre_hook(self._top_pre_hook, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._top_post_hook, always_call=True))
        self._handles.append(self.backbone.register_forward_pre_hook(self._stack_pre_hook, with_kwargs=True))
        if self.is_lora:
            self._hook_lora()
        else:
            for layer in self.direft.layers:
                self._handles.append(self.backbone.layers[layer].register_forward_hook(self._direft_hook(layer)))

    # ---- construction -------------------------------------------------------------------------------------------

    @classmethod
    def for_lora(cls, model: nn.Module, lora_config: Any = None, *, mode: PositionMode | str) -> PreftModel:
        """A new trainable LoRA (peft ``get_peft_model(model, lora_config)``), or a given ``PeftModel`` as is."""
        from peft import PeftModel, get_peft_model

        if not isinstance(model, PeftModel):
            if lora_config is None:
                raise ValueError("a LoraConfig is needed to add a LoRA to a plain model")
            model = get_peft_model(model, lora_config)
        return cls(model, mode=mode)

    @classmethod
    def for_direft(
        cls, model: nn.Module, config: DireftConfig, *, mode: PositionMode | str, dtype: torch.dtype = torch.float32
    ) -> PreftModel:
        """A new trainable DiReFT on `model`, whose own parameters are frozen."""
        model.requires_grad_(False)
        shape = ModelShape.from_config(model.config.to_dict())
        adapter = DireftAdapter(config, shape.hidden_size, dtype=dtype)
        _check_layers(config.layers, shape)
        model.add_module(DIREFT_ATTRIBUTE, adapter.to(next(model.parameters()).device))
        return cls(model, mode=mode)

    @classmethod
    def from_pretrained(
        cls,
        model: nn.Module,
        adapter_dir: str | Path,
        *,
        mode: PositionMode | str,
        is_trainable: bool = False,
        max_rank: int = DEFAULT_MAX_RANK,
        direft_dtype: torch.dtype = torch.float32,
    ) -> PreftModel:
        """A saved adapter (either format the registry serves) on `model`, validated first by the registry's checks.

        `direft_dtype`: the dtype a DiReFT's parameters and arithmetic use (the reference uses float64)."""
        shape = ModelShape.from_config(model.config.to_dict())
        check = check_adapter(adapter_dir, shape, max_rank=max_rank)
        if check.method is AdapterMethod.LORA:
            from peft import PeftModel

            return cls(PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=is_trainable), mode=mode)
        model.requires_grad_(False)
        adapter = DireftAdapter.from_pretrained(adapter_dir, shape, max_rank=max_rank, dtype=direft_dtype)
        adapter.requires_grad_(is_trainable)
        model.add_module(DIREFT_ATTRIBUTE, adapter.to(next(model.parameters()).device))
        return cls(model, mode=mode)

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        adapter_dir: str | Path,
        *,
        mode: PositionMode | str,
        dtype: torch.dtype = torch.float32,
        **kwargs: Any,
    ) -> PreftModel:
        """Load a base model (transformers ``AutoModelForCausalLM``, in `dtype`, eval mode) and a saved adapter."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
        return cls.from_pretrained(model, adapter_dir, mode=mode, **kwargs).eval()

    # ---- the PreFT forward --------------------------------------------------------------------------------------

    @property
    def mode(self) -> PositionMode:
        return self.gate.mode

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        prompt_lengths: torch.Tensor | Sequence[int] | None = None,
        prompt_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        """The wrapped model's forward (its output: logits, loss, …) with the adapter on the prompt positions only
        (prefill mode) or everywhere (all mode): one teacher-forced pass over prompt + completion."""
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            prompt_lengths=prompt_lengths,
            prompt_mask=prompt_mask,
            **kwargs,
        )

    def completion_logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        prompt_lengths: torch.Tensor | Sequence[int] | None = None,
        prompt_mask: torch.Tensor | None = None,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """[batch, seq - 1]: column t holds log p(input_ids[:, t + 1] | input_ids[:, :t + 1]) where token t + 1 is
        a completion token (not prompt, not padding), 0 elsewhere — TRL's per-token log-prob layout."""
        prompt = _prompt_mask(input_ids, prompt_lengths, prompt_mask)
        out = self(input_ids, attention_mask, prompt_mask=prompt, use_cache=False)
        logps = (out.logits[:, :-1].float() / temperature).log_softmax(-1)
        logps = logps.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        scored = ~prompt[:, 1:]
        if attention_mask is not None:
            scored &= attention_mask[:, 1:].bool()
        return logps.masked_fill(~scored, 0.0)

    @torch.no_grad()
    def generate_greedy(self, prompt_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Greedy tokens over one KV cache, prompt pass with the adapter, decoding as the mode says."""
        from preft.training.generate import greedy_generate

        return greedy_generate(self.model, prompt_ids, max_tokens)

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        return {name: p for name, p in self.model.named_parameters() if p.requires_grad}

    # ---- saving -------------------------------------------------------------------------------------------------

    def save_pretrained(self, out_dir: str | Path, *, max_rank: int = DEFAULT_MAX_RANK) -> Path:
        """Write the adapter in the format the registry accepts, then check it as the registry would."""
        out = Path(out_dir)
        if self.is_lora:
            adapter = self.model.active_adapter
            self.model.save_pretrained(str(out), safe_serialization=True, selected_adapters=[adapter])
            if adapter != "default":  # peft writes other adapters under a subdirectory of their name
                out = out / adapter
        else:
            self.direft.save_pretrained(out)
        check_adapter(out, ModelShape.from_config(self.hf_model.config.to_dict()), max_rank=max_rank)
        return out

    def remove_hooks(self) -> None:
        """Take the gating hooks off (the wrapped model then runs as plain peft / without the DiReFT)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ---- hooks --------------------------------------------------------------------------------------------------

    def _top_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        prompt_mask, prompt_lengths = kwargs.pop("prompt_mask", None), kwargs.pop("prompt_lengths", None)
        self.gate.explicit = None
        if self.gate.mode is PositionMode.ALL:
            return args, kwargs
        if prompt_mask is not None or prompt_lengths is not None:
            _, seq_len = _input_shape(args, kwargs)
            mask = prompt_mask if prompt_mask is not None else mask_from_lengths(prompt_lengths, seq_len)
            self.gate.explicit = mask.to(torch.bool).to(_device(args, kwargs))
        elif kwargs.get("labels") is not None:
            check_unpacked(kwargs.get("position_ids"), kwargs)
            self.gate.explicit = mask_from_labels(kwargs["labels"])
        return args, kwargs

    def _top_post_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.gate.explicit = None

    def _stack_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if self.is_lora:
            self._hook_lora()
        batch, seq_len = _input_shape(args, kwargs)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # (`cache` since transformers 5.2x)
        self.gate.decide(batch, seq_len, cache.get_seq_length() if cache is not None else 0)

    def _direft_hook(self, layer: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            if self.gate.active is OFF:
                return output
            h = output[0] if isinstance(output, tuple) else output
            h = h + gate_delta(self.direft.delta(layer, h), self.gate.active)
            return (h, *output[1:]) if isinstance(output, tuple) else h

        return hook

    def _lora_b_hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return gate_delta(output, self.gate.active)

    def _hook_lora(self) -> None:
        """Gate every LoRA adapter's lora_B, including adapters added since (TRL adds a "ref" copy for GRPO)."""
        from peft.tuners.lora import LoraLayer

        adapters = frozenset(self.model.peft_config)
        if adapters != self._lora_adapters:
            self._lora_layers = [m for m in self.model.modules() if isinstance(m, LoraLayer)]
            for layer in self._lora_layers:
                for name, lora_b in layer.lora_B.items():
                    if name in getattr(layer, "lora_variant", {}):
                        raise UnsupportedAdapterError(f"LoRA variant {type(layer.lora_variant[name]).__name__}")
                    if id(lora_b) not in self._hooked_lora_b:
                        self._handles.append(lora_b.register_forward_hook(self._lora_b_hook))
                        self._hooked_lora_b.add(id(lora_b))
            self._lora_adapters = adapters
        if self.gate.mode is PositionMode.PREFILL and any(layer.merged for layer in self._lora_layers):
            raise UnsupportedAdapterError("a merged LoRA applies everywhere: unmerge it for prefill mode")


def _device(args: tuple, kwargs: dict[str, Any]) -> torch.device:
    ids = kwargs.get("input_ids", args[0] if args else None)
    return (ids if ids is not None else kwargs["inputs_embeds"]).device


def _prompt_mask(
    input_ids: torch.Tensor, prompt_lengths: torch.Tensor | Sequence[int] | None, prompt_mask: torch.Tensor | None
) -> torch.Tensor:
    if (prompt_lengths is None) == (prompt_mask is None):
        raise PromptSplitError("pass exactly one of prompt_lengths and prompt_mask")
    if prompt_mask is not None:
        return prompt_mask.to(device=input_ids.device, dtype=torch.bool)
    return mask_from_lengths(prompt_lengths, input_ids.shape[1], device=input_ids.device)


def _check_layers(layers: Sequence[int], shape: ModelShape) -> None:
    bad = [layer for layer in layers if not 0 <= layer < shape.num_layers]
    if bad:
        raise ValueError(f"layers {bad} are out of range: the model has layers 0..{shape.num_layers - 1}")
