"""`preft rollout-serve`: a rollout server for TRL's trainers (TRL's vLLM server protocol, `preft.rollout`)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.console import Console

from preft.common.modes import PositionMode

err = Console(stderr=True, soft_wrap=True)


def _transport(choice: str) -> Literal["nccl", "http"]:
    """`auto`: NCCL where there is a CUDA device (as TRL's own server), else HTTP."""
    if choice != "auto":
        return "nccl" if choice == "nccl" else "http"
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # (asks NVML: leaves fork usable for vLLM)
    import torch

    return "nccl" if torch.cuda.is_available() else "http"


def rollout_serve(
    model: Annotated[Path, typer.Option("--model", help="Base model directory (config.json, weights, tokenizer).")],
    adapter: Annotated[
        Path, typer.Option("--adapter", help="The adapter served (PEFT LoRA or DiReFT dir): its starting weights.")
    ],
    mode: Annotated[PositionMode, typer.Option("--mode", help="Adapter positions.")] = PositionMode.PREFILL,
    name: Annotated[
        str | None, typer.Option("--served-model-name", help="The model id answered (default: the adapter dir's name).")
    ] = None,
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535)] = 8000,
    weight_transport: Annotated[
        str, typer.Option("--weight-transport", help="auto | nccl | http (auto: nccl where CUDA is).")
    ] = "auto",
    dtype: Annotated[str, typer.Option("--dtype", help="float32 | bfloat16 | float16 | auto")] = "auto",
    max_lora_rank: Annotated[int, typer.Option("--max-lora-rank", min=1)] = 64,
    max_model_len: Annotated[int | None, typer.Option("--max-model-len", min=1)] = None,
    max_num_seqs: Annotated[int, typer.Option("--max-num-seqs", min=1, help="Sequences per engine step.")] = 64,
    max_num_batched_tokens: Annotated[int | None, typer.Option("--max-num-batched-tokens", min=1)] = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option("--gpu-memory-utilization", min=0.01, max=1)] = None,
    log_level: Annotated[str, typer.Option("--log-level")] = "info",
) -> None:
    """Serve one adapter to TRL's GRPOTrainer (use_vllm=True, vllm_mode="server"), updated in place as it trains.

    The trainer side is `preft.training.rollouts.rollout_server(policy)` around the trainer's construction.
    """
    import uvicorn

    from preft.engine.async_engine import AsyncPreftEngine
    from preft.engine.vllm_engine import EngineOptions
    from preft.rollout.app import create_app
    from preft.rollout.service import RolloutService, ServedAdapter

    if weight_transport not in ("auto", "nccl", "http"):
        err.print(f"[red]error:[/red] --weight-transport must be auto, nccl or http, not {weight_transport!r}")
        raise typer.Exit(2)
    for what, path, needs in (("--model", model, "config.json"), ("--adapter", adapter, None)):
        if not path.is_dir() or (needs and not (path / needs).is_file()):
            err.print(f"[red]error:[/red] {what} {path} is not a {'model' if needs else 'adapter'} directory")
            raise typer.Exit(2)
    transport = _transport(weight_transport)
    options = EngineOptions(
        model=str(model),
        dtype=dtype,
        max_loras=1,
        max_lora_rank=max_lora_rank,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        logprobs_mode="processed_logprobs",
    )
    nccl_factory = None
    if transport == "nccl":
        from preft.rollout.nccl import NcclReceiver

        nccl_factory = NcclReceiver
    served = ServedAdapter(path=adapter.resolve(), name=name or adapter.resolve().name, mode=mode)
    engine = AsyncPreftEngine(options)
    service = RolloutService(engine=engine, adapter=served, transport=transport, nccl_factory=nccl_factory)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    err.print(f"rollout server: {served.name} ({mode.value}) on {model}, updates by {transport}, http://{host}:{port}")
    uvicorn.run(create_app(service), host=host, port=port, log_level=log_level)
