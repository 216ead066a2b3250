"""Build tiny random models of real architectures (Llama, Qwen2), a tokenizer, and random adapters.

Everything is generated locally from a seed: no weights or data sets are downloaded. The models use
head_dim 32 (vLLM's CPU attention refuses 16) and a larger-than-default init range so greedy decoding has
clear margins between the top logits, which keeps float32 comparisons against a reference meaningful.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from preft.adapters import ModelShape
from preft.adapters.formats import ATTENTION_PROJECTIONS, MLP_PROJECTIONS

Arch = Literal["llama", "qwen2"]

LLAMA_PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS

WORDS = (  # noqa: SIM905 (one readable string, not a 90-line list)
    "the a an of to in on for with and or but not is are was were be been have has had do does did "
    "adapter prefill decode token model serve tenant request batch cache block slot layer weight rank "
    "prompt output stream engine gateway registry metric latency throughput memory compute kernel graph "
    "alpha beta gamma delta red green blue cat dog bird fish tree river mountain city road house book one "
    "two three four five six seven eight nine ten hello world yes no why how what when where who"
).split()


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a generated model; defaults give a model vLLM's CPU backend runs in well under a second."""

    arch: Arch = "llama"
    hidden_size: int = 64
    num_layers: int = 3
    num_heads: int = 2
    num_kv_heads: int = 1
    intermediate_size: int = 128
    vocab_size: int = 384
    max_position_embeddings: int = 2048
    init_range: float = 0.2
    seed: int = 0


def build_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """Train a byte-level BPE tokenizer on generated text and save it in Hugging Face format."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(2000)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin|>", "<|end|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin|>", eos_token="<|end|>", pad_token="<|pad|>"
    )
    # turns as "role: content" lines (a newline after a block tag would be trimmed: written as an expression); with
    # tools, a system line listing them, and assistant calls as Qwen2.5 writes them (hermes: <tool_call>{"name": ...,
    # "arguments": ...}</tool_call>); the answer opened with <think> where enable_thinking is given true (as templates
    # of thinking models do: the tests' reasoning models)
    fast.chat_template = (
        "{% if tools %}system: tools:{% for t in tools %} {{ t['function'] | tojson }}{% endfor %}"
        "{{ '\\n' }}{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {% if m['tool_calls'] is defined and m['tool_calls'] %}"
        "{% for c in m['tool_calls'] %}<tool_call>{{ {'name': c['function']['name'], "
        "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}"
        "{% else %}{{ m['content'] }}{% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% if enable_thinking is defined and enable_thinking %}<think>"
        "{% endif %}{% endif %}"
    )
    fast.save_pretrained(str(out_dir))


def build_word_tokenizer(out_dir: Path, vocab_size: int) -> list[str]:
    """A word-level tokenizer over the whole vocabulary (`<|begin|>`, `<|end|>`, `<|pad|>`, then `w3` … `wN`), saved
    in Hugging Face format; returns its words.

    For benchmark models with random weights: every id the model can generate decodes, and a prompt of n words is
    exactly n tokens, through the gateway and through `vllm serve` alike.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin|>", "<|end|>", "<|pad|>"]
    words = [f"w{i}" for i in range(len(specials), vocab_size)]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + words)}, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # (joins words with spaces)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin|>", eos_token="<|end|>", pad_token="<|pad|>", unk_token="<|pad|>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(str(out_dir))
    return words


def build_model(out_dir: Path | str, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write a random model (config, safetensors weights, tokenizer) to out_dir and return it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, spec.vocab_size)
    common = dict(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.init_range,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        torch_dtype="float32",
    )
    if spec.arch == "llama":
        config = AutoConfig.for_model("llama", head_dim=spec.hidden_size // spec.num_heads, **common)
    else:
        config = AutoConfig.for_model("qwen2", use_sliding_window=False, **common)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Norm weights start at 1; jitter them so every parameter matters to the output.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def build_lora(
    out_dir: Path | str,
    model_dir: Path | str,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    targets: tuple[str, ...] = LLAMA_PROJECTIONS,
    scale: float = 0.3,
    seed: int = 1,
    dtype: str = "float32",
) -> Path:
    """Write a random PEFT LoRA adapter for the model in model_dir, in the layout PEFT itself saves."""
    import torch
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shape = ModelShape.from_model_dir(model_dir)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape.num_layers):
        for proj in targets:
            fan_in, fan_out = shape.projection_shape(proj)
            block = "self_attn" if proj in ATTENTION_PROJECTIONS else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            a = torch.randn(rank, fan_in, generator=g) * scale / fan_in**0.5
            tensors[f"{prefix}.lora_A.weight"] = a.to(getattr(torch, dtype))
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * scale).to(a.dtype)
    save_file({k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "base_model_name_or_path": str(model_dir),
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return out


def build_direft(
    out_dir: Path | str,
    model_dir: Path | str,
    *,
    rank: int = 4,
    layers: tuple[int, ...] = (0, 2),
    scale: float = 0.5,
    seed: int = 2,
    dtype: str = "float32",
) -> Path:
    """Write a random DiReFT adapter (preft_config.json + layers.{l}.A/B/b) for the model in model_dir."""
    import torch
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hidden = ModelShape.from_model_dir(model_dir).hidden_size
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in layers:
        tensors[f"layers.{layer}.A"] = torch.randn(rank, hidden, generator=g) * scale / hidden**0.5
        tensors[f"layers.{layer}.B"] = torch.randn(rank, hidden, generator=g) * scale
        tensors[f"layers.{layer}.b"] = torch.randn(rank, generator=g) * scale
    save_file({k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "preft_config.json").write_text(
        json.dumps({"method": "direft", "rank": rank, "layers": list(layers)}, indent=2)
    )
    return out
