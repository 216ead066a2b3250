"""An in-place adapter weight update's latency in the serving engine, on a model of Llama-3.1-8B's widths.

    .venv/bin/python -m loadtest.engine.bench_weight_update --layers 2 --dtype float32 --gpu-memory-utilization 0.25
    python3 -m loadtest.engine.bench_weight_update --layers 32 --out $OUT/gpu-weight-update.json      # one GPU

A config.json of Llama-3.1-8B's widths (hidden 4096, MLP 14336, 32 query and 8 KV heads) with --layers decoder layers
and random weights (vLLM's dummy load), served by AsyncPreftEngine; a rank --rank LoRA on its seven projections in
--dtype (at rank 16 and 32 layers: Llama-3.1-8B's, 80 MB in bfloat16). The adapter is put in a slot by one request,
then updated --repeats times with two sets of weights in turn, each update followed by a one-token request on it.
Reports each update's seconds from the call to the new weights serving (``AdapterUpdate.seconds``: the tensors staged
in shared memory, the engine core's utility, every worker's check and writes into host memory and the slot) and,
measured apart in this process, the staging's share; the next request's time to its token, which adds its prefill.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128)


def write_model(out: Path, layers: int, vocab: int) -> Path:
    """config.json alone (the engine loads dummy weights): Llama-3.1-8B's widths, `layers` layers."""
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        **LLAMA_8B,
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


async def run(args: argparse.Namespace, root: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    from preft.common.engine_contract import EngineRequest
    from preft.devtools.tiny import build_lora
    from preft.engine.async_engine import AsyncPreftEngine
    from preft.engine.updates import stage_tensors
    from preft.engine.vllm_engine import EngineOptions

    model = write_model(root / "model", args.layers, args.vocab)
    adapters = [build_lora(root / f"lora{k}", model, rank=args.rank, seed=k, dtype=args.dtype) for k in (1, 2)]
    weights = [load_file(str(d / "adapter_model.safetensors")) for d in adapters]
    size = sum(t.numel() * t.element_size() for t in weights[0].values())
    options = EngineOptions(
        model=str(model),
        dtype=args.dtype,
        load_format="dummy",
        tokenizer=False,
        max_loras=2,
        max_lora_rank=args.rank,
        max_model_len=512,
        gpu_memory_utilization=args.gpu_memory_utilization,
        scheduling_policy="priority",
    )
    engine = AsyncPreftEngine(options)
    await engine.start()
    try:
        info = await engine.add_lora(adapters[0])

        async def first_token(rid: str) -> float:
            req = EngineRequest(request_id=rid, prompt_token_ids=list(range(3, 35)), max_tokens=1)
            started = time.perf_counter()
            async for _ in engine.generate(req, adapters[0]):
                pass
            return time.perf_counter() - started

        await first_token("warm")  # (into a slot)
        updates, nexts, staging = [], [], []
        for k in range(args.repeats):
            tensors = weights[(k + 1) % 2]
            started = time.perf_counter()
            path = stage_tensors(tensors)
            staging.append(time.perf_counter() - started)
            path.unlink()
            updates.append((await engine.update_adapter_weights(info.digest, tensors)).seconds)
            nexts.append(await first_token(f"next-{k}"))
    finally:
        await engine.shutdown()
    ms = lambda xs: {"p50": round(statistics.median(xs) * 1e3, 2), "max": round(max(xs) * 1e3, 2)}  # noqa: E731
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "layers": args.layers,
        "rank": args.rank,
        "dtype": args.dtype,
        "adapter_bytes": size,
        "repeats": args.repeats,
        "update_ms": ms(updates),
        "staging_ms": ms(staging),
        "next_request_ms": ms(nexts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, help="KV cache share (CPU: of a node)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="preft-bench-update-") as tmp:
        report = asyncio.run(run(args, Path(tmp)))
    print(json.dumps(report, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
