"""Where does a LoRA-enabled engine lose base-model speed? Base requests only (no adapter), three engines in turn
in one process: vLLM without LoRA, vLLM with LoRA enabled but without our plugin, and the PreFT engine.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python3 -m loadtest.bench_base_overhead --preset qwen05 --requests 512

(In-process engines, so the plugin can be left out of the second: it is registered by hand before the third.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import asdict
from pathlib import Path

from loadtest.bench_engine import ARCH_CONFIGS, _measure, _model_dir, _requests, _timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=["cpu-small", *ARCH_CONFIGS], default="cpu-small")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-loras", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    ap.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "preft-bench")
    ap.add_argument("--out", type=Path, default=Path("loadtest/results/base-overhead"))
    args = ap.parse_args()
    os.environ["VLLM_PLUGINS"] = "none"  # vLLM loads only the plugins named here: ours stays out until asked

    from preft.engine.vllm_engine import EngineOptions, PreftEngine

    args.workdir.mkdir(parents=True, exist_ok=True)
    model, dtype, real = _model_dir(args, args.workdir)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    common = dict(
        model=str(model),
        dtype=dtype,
        max_num_seqs=args.max_num_seqs,
        max_lora_rank=16,
        max_model_len=args.prompt_len + args.output_len + 16,
        load_format="auto" if real else "dummy",
        tokenizer=real,
        enable_prefix_caching=False,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_loras=args.max_loras,
    )
    rng = random.Random(0)
    rows = []
    for name, lora, plugin in (
        ("vLLM, no LoRA", False, False),
        ("vLLM + enable_lora, no plugin", True, False),
        ("PreFT engine (plugin)", True, True),
    ):
        if plugin:
            from preft import vllm_plugin

            vllm_plugin.register()
        engine = PreftEngine(EngineOptions(**common, enable_lora=lora))
        _timed(engine, _requests(args, rng, vocab, None, "prefill", args.output_len))  # warm-up
        rows.append(asdict(_measure(engine, args, rng, vocab, name, None, None, "prefill")))
        print(
            f"{name:34s} {rows[-1]['tokens_per_s']:12.1f} tok/s  prompt-only {rows[-1]['prompt_only_seconds']} s",
            flush=True,
        )
        engine.close()
    for r in rows:
        r["ratio_to_no_lora"] = round(r["tokens_per_s"] / rows[0]["tokens_per_s"], 3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(
        json.dumps(
            {"settings": {**vars(args), "workdir": str(args.workdir), "out": str(args.out)}, "results": rows}, indent=2
        )
        + "\n"
    )
    for r in rows:
        print(f"{r['config']:34s} {r['tokens_per_s']:12.1f} {r['ratio_to_no_lora']:6.3f}")


if __name__ == "__main__":
    main()
