"""Adapter loads in two processes at once: torch thread pools sized to the whole machine vs half of it each.

    .venv/bin/python -m loadtest.engine.bench_load_threads

Each process repeats the host-side tensor work of loading a LoRA (read a safetensors file, cast, scale B,
pack q/k/v and gate/up as vLLM does; Qwen2.5-0.5B shapes, rank 8, bf16). Measured: one process alone with all
cores' threads, then two processes at once with all cores' threads each, then two with half each. On the
two-GPU machine, loads in two bench processes at once ran >10x slower than alone: this reproduces that on any
machine, and shows what sizing each process's thread pool to its share of the cores (the engine's
``cpu_num_threads``) does against it.
Results: loadtest/results/load-threads.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, INTER, LAYERS, KV, RANK = 896, 4864, 24, 128, 8
SHAPES = {"q": (HIDDEN, HIDDEN), "k": (HIDDEN, KV), "v": (HIDDEN, KV), "o": (HIDDEN, HIDDEN)}
SHAPES |= {"gate": (HIDDEN, INTER), "up": (HIDDEN, INTER), "down": (INTER, HIDDEN)}


def write_adapter(path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = {}
    for layer in range(LAYERS):
        for name, (fan_in, fan_out) in SHAPES.items():
            tensors[f"{layer}.{name}.A"] = torch.randn(RANK, fan_in).to(torch.bfloat16)
            tensors[f"{layer}.{name}.B"] = torch.randn(fan_out, RANK).to(torch.bfloat16)
    save_file(tensors, str(path))


def load_once(path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    weights = {k: (v.to(torch.bfloat16) * 2.0 if k.endswith(".B") else v) for k, v in load_file(str(path)).items()}
    for layer in range(LAYERS):
        torch.cat([weights[f"{layer}.{p}.B"] for p in ("q", "k", "v")])
        torch.cat([weights[f"{layer}.{p}.B"] for p in ("gate", "up")])


def worker(path: Path, seconds: float) -> float:
    """Milliseconds per load, repeated for `seconds` after one warm-up load."""
    load_once(path)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or n < 2:
        load_once(path)
        n += 1
    return (time.perf_counter() - start) / n * 1e3


def run(path: Path, processes: int, threads: int, seconds: float) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "loadtest.engine.bench_load_threads", "--worker", str(path), str(seconds)]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    return [round(float(p.communicate()[0].strip()), 2) for p in procs]


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        print(worker(Path(sys.argv[2]), float(sys.argv[3])))
        return
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "adapter.safetensors"
        write_adapter(path)
        cases = {
            f"1 process, {cores} threads": run(path, 1, cores, 3.0),
            f"2 processes, {cores} threads each": run(path, 2, cores, 3.0),
            f"2 processes, {max(cores // 2, 1)} threads each": run(path, 2, max(cores // 2, 1), 3.0),
        }
    alone = cases[f"1 process, {cores} threads"][0]
    report = {"cores": cores, "ms_per_load": cases, "slowdown_vs_alone": {}}
    for name, values in cases.items():
        report["slowdown_vs_alone"][name] = round(max(values) / alone, 2)
        print(f"{name:32s} {values} ms per load   {max(values) / alone:6.1f}x alone")
    out = Path("loadtest/results/load-threads.json")
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
