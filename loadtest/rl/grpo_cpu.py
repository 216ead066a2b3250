"""A short GRPO run on CPU through the rollout server, token-exact after every update (issue 57, item 4, CPU).

    python -m loadtest.rl.grpo_cpu [--steps 8] [--methods lora,direft] [--out loadtest/results/rl-cpu-grpo]

For each adapter method: a tiny generated model, a PreFT policy (prefill mode) whose starting adapter is saved and
served by ``preft rollout-serve`` (real vLLM on CPU, updates over HTTP), and TRL 1.16's GRPOTrainer with
``use_vllm=True, vllm_mode="server"`` built inside ``preft.training.rollouts.rollout_server``; a toy reward (the
share of completion tokens among a few target words' tokens). After every weight sync the server's greedy rollouts
of fixed prompts are compared, token for token, with the HF + peft reference: the trainer's adapter at that moment,
saved in the registry's format, reloaded on the base model and decoded in prefill mode. Writes the loss and reward
curves and every check as ``<out>.json`` and ``<out>.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MAX_CHECK_TOKENS = 8
N_CHECK_PROMPTS = 4
TARGET_WORDS = ("red", "green", "blue", "cat", "dog", "bird", "fish", "tree")


@dataclass
class Check:
    """One comparison after a sync: the served version, the trainer's step, and the tokens of both sides."""

    update: int
    version: int
    step: int
    server: list[list[int]]
    reference: list[list[int]]

    @property
    def equal(self) -> bool:
        return self.server == self.reference


@dataclass
class RunResult:
    method: str
    steps: int
    seconds: float
    losses: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["checks"] = [{**asdict(c), "equal": c.equal} for c in self.checks]
        out["all_equal"] = all(c.equal for c in self.checks)
        return out


@contextlib.contextmanager
def rollout_server_process(
    model_dir: Path, adapter_dir: Path, log_path: Path, *, start_timeout_s: float = 300
) -> Iterator[str]:
    """`preft rollout-serve` (the CLI, in a subprocess: real vLLM on CPU, float32) on a free port; yields its URL."""
    from preft.common.loopback import free_port

    port = free_port()
    command = [
        sys.executable, "-m", "preft.cli.main", "rollout-serve",
        "--model", str(model_dir), "--adapter", str(adapter_dir), "--served-model-name", "policy",
        "--port", str(port), "--dtype", "float32", "--weight-transport", "http",
        "--max-model-len", "512", "--max-lora-rank", "16", "--gpu-memory-utilization", "0.1", "--log-level", "warning",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process, start_timeout_s, log_path)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_healthy(url: str, process: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the rollout server exited ({process.returncode}): {log_path.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise TimeoutError(f"the rollout server did not answer in {timeout_s} s: {log_path.read_text()[-3000:]}")


def new_policy(model_dir: Path, method: str, seed: int = 0) -> Any:
    """A fresh PreFT policy (prefill mode) on the base model: a peft LoRA or a DiReFT."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from preft.training import DireftConfig, PreftModel

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if method == "lora":
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
        return PreftModel.for_lora(base, config, mode="prefill")
    return PreftModel.for_direft(base, DireftConfig(rank=4, layers=(0, 2), init_std=0.2, seed=seed), mode="prefill")


class GreedyCheck:
    """After each sync: the server's greedy tokens for fixed prompts against the reference on the trainer's adapter
    (saved, reloaded on the base model: HF + peft, or the DiReFT in float64 as the engine tests' reference)."""

    def __init__(self, model_dir: Path, url: str, policy: Any, prompts: list[list[int]], work_dir: Path) -> None:
        from trl.generation.vllm_client import VLLMClient

        self.model_dir, self.policy, self.prompts, self.work_dir = model_dir, policy, prompts, work_dir
        self.client = VLLMClient(base_url=url, connection_timeout=30)  # (TRL's own client, for greedy rollouts)
        self.trainer: Any = None
        self.checks: list[Check] = []

    def __call__(self, answer: dict[str, Any] | None) -> None:
        import torch

        from preft.training import PreftModel

        out = self.client.generate(
            self.prompts,
            temperature=0.0,
            max_tokens=MAX_CHECK_TOKENS,
            logprobs=None,
            generation_kwargs={"ignore_eos": True},
        )
        saved = self.policy.save_pretrained(self.work_dir / f"update-{len(self.checks)}")
        reference = PreftModel.from_model_dir(self.model_dir, saved, mode="prefill", direft_dtype=torch.float64)
        expected = [reference.generate_greedy(p, MAX_CHECK_TOKENS) for p in self.prompts]
        step = self.trainer.state.global_step if self.trainer is not None else -1
        version = (answer or {}).get("version", -1)
        self.checks.append(Check(len(self.checks), version, step, out["completion_ids"], expected))


def toy_reward(target_ids: set[int]):
    """The share of a completion's tokens that are target words' tokens."""

    def reward(completions: list[Any], completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        return [sum(t in target_ids for t in ids) / max(len(ids), 1) for ids in completion_ids]

    return reward


def train(model_dir: Path, method: str, work_dir: Path, *, steps: int, seed: int = 0) -> RunResult:
    """One GRPO run of `steps` steps through a rollout server started on the policy's starting adapter."""
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer

    from preft.devtools.tiny import WORDS
    from preft.training.rollouts import rollout_server

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(seed)
    sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(64)]
    check_prompts = [tokenizer(s)["input_ids"] for s in sentences[:N_CHECK_PROMPTS]]
    targets = {t for w in TARGET_WORDS for t in tokenizer(" " + w)["input_ids"] + tokenizer(w)["input_ids"]}
    policy = new_policy(model_dir, method, seed)
    adapter0 = policy.save_pretrained(work_dir / "adapter0")
    started = time.perf_counter()
    with rollout_server_process(model_dir, adapter0, work_dir / "server.log") as url:
        check = GreedyCheck(model_dir, url, policy, check_prompts, work_dir)
        args = trl.GRPOConfig(
            output_dir=str(work_dir / "out"),
            use_cpu=True,
            bf16=False,
            report_to=[],
            logging_steps=1,
            save_strategy="no",
            seed=seed,
            max_steps=steps,
            learning_rate=5e-2,
            lr_scheduler_type="constant",
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=8,
            beta=0.0,
            gradient_checkpointing=False,
            dataloader_num_workers=0,
            use_vllm=True,
            vllm_mode="server",
            vllm_server_base_url=url,
            vllm_server_timeout=60,
        )
        with rollout_server(policy, on_update=check):
            trainer = trl.GRPOTrainer(
                model=policy.model,
                reward_funcs=toy_reward(targets),
                args=args,
                train_dataset=Dataset.from_list([{"prompt": s} for s in sentences[N_CHECK_PROMPTS:]]),
                processing_class=tokenizer,
            )
        check.trainer = trainer
        trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    return RunResult(
        method=method,
        steps=steps,
        seconds=time.perf_counter() - started,
        losses=[float(log["loss"]) for log in logs],
        rewards=[float(log["reward"]) for log in logs],
        checks=check.checks,
    )


def plot(results: list[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for r in results:
        exact = sum(c.equal for c in r.checks)
        label = f"{r.method}P ({exact}/{len(r.checks)} updates token-exact)"
        steps = range(1, len(r.losses) + 1)
        axes[0].plot(steps, r.losses, marker="o", label=label)
        axes[1].plot(steps, r.rewards, marker="o", label=label)
    axes[0].set(title="GRPO loss", xlabel="step", ylabel="loss")
    axes[1].set(title="toy reward (share of target tokens)", xlabel="step", ylabel="mean reward")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("TRL GRPOTrainer through `preft rollout-serve` (vLLM on CPU, tiny model, prefill mode)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--methods", default="lora,direft")
    parser.add_argument("--out", type=Path, default=Path("loadtest/results/rl-cpu-grpo"))
    args = parser.parse_args(argv)
    from preft.devtools.tiny import TinyModelSpec, build_model

    with tempfile.TemporaryDirectory(prefix="preft-rl-") as tmp:
        model_dir = build_model(Path(tmp) / "model", TinyModelSpec(arch="llama", seed=7))
        results = []
        for method in args.methods.split(","):
            work = Path(tmp) / method
            work.mkdir()
            results.append(train(model_dir, method, work, steps=args.steps))
            r = results[-1]
            print(f"{method}: {r.steps} steps in {r.seconds:.0f} s, losses {r.losses}, rewards {r.rewards}, "
                  f"{sum(c.equal for c in r.checks)}/{len(r.checks)} updates token-exact", flush=True)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "what": "TRL 1.16 GRPOTrainer (use_vllm, server mode) through preft rollout-serve on CPU: loss and reward per "
        "step; after every weight sync, greedy rollouts of fixed prompts from the server vs the HF + peft reference "
        "with the trainer's adapter at that moment (prefill mode)",
        "model": "tiny generated llama (preft.devtools.tiny, seed 7), float32",
        "runs": [r.to_json() for r in results],
    }
    args.out.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    plot(results, args.out.with_suffix(".png"))
    return 0 if all(c.equal for r in results for c in r.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
