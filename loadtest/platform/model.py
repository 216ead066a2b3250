"""Benchmark base models: a real architecture's config.json with random (dummy) weights, and a word tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from loadtest.engine.bench_engine import ARCH_CONFIGS
from preft.devtools.tiny import build_word_tokenizer

CPU_TINY = {  # a Llama small enough for vLLM on 2 CPU cores, large enough for rank-16 adapters
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "vocab_size": 1024,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "hidden_act": "silu",
}


@dataclass(frozen=True)
class BenchModel:
    """A benchmark model directory and what the rest of the run needs to know of it."""

    preset: str
    path: Path
    dtype: str
    words: list[str]  # the tokenizer's words: a prompt of n of them is n tokens
    num_layers: int


def build(preset: str, root: Path) -> BenchModel:
    """config.json (+ a generation config naming the tokenizer's special ids) and the word tokenizer in root/preset."""
    config = {**(CPU_TINY if preset == "cpu-tiny" else ARCH_CONFIGS[preset]), "bos_token_id": 0, "eos_token_id": 1}
    path = root / preset
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    words = build_word_tokenizer(path, config["vocab_size"])
    dtype = "float32" if preset == "cpu-tiny" else "bfloat16"
    return BenchModel(preset, path, dtype, words, config["num_hidden_layers"])
