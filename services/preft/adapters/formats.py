"""Detect, validate and digest adapter directories without executing anything they contain.

Two methods are served:
- ``lora``: PEFT LoRA as PEFT saves it (``adapter_config.json`` + ``adapter_model.safetensors``).
- ``direft``: ``preft_config.json`` = ``{"method": "direft", "rank": r, "layers": [...]}`` and
  ``adapter_model.safetensors`` holding ``layers.{l}.A`` [r, hidden], ``layers.{l}.B`` [r, hidden],
  ``layers.{l}.b`` [r] for each listed layer.

Validation reads only the JSON files and the safetensors header (never a pickle), and checks every tensor's
name, dtype and shape against the base model, so a bad adapter fails its own request with a message that
names the file and tensor instead of failing inside the engine.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from preft.adapters.errors import AdapterError
from preft.common.digests import file_sha256

LORA_CONFIG = "adapter_config.json"
DIREFT_CONFIG = "preft_config.json"
WEIGHTS = "adapter_model.safetensors"
ADAPTER_FILES = (LORA_CONFIG, DIREFT_CONFIG, WEIGHTS)  # the files the engine reads
PICKLE_WEIGHTS = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth", "pytorch_model.bin")
MAX_HEADER_BYTES = 100 * 1024 * 1024
FLOAT_DTYPES = {"F32", "F16", "BF16"}
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
LORA_TENSOR = re.compile(
    r"^base_model\.model\.model\.layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<proj>\w+)"
    r"\.lora_(?P<ab>[AB])\.weight$"
)
DIREFT_TENSOR = re.compile(r"^layers\.(?P<layer>\d+)\.(?P<part>A|B|b)$")


class AdapterMethod(StrEnum):
    """How an adapter changes the model."""

    LORA = "lora"
    DIREFT = "direft"


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a base model that an adapter must fit (read from its config.json)."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        heads = config["num_attention_heads"]
        return cls(
            architecture=(config.get("architectures") or ["unknown"])[0],
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelShape:
        return cls.from_config(json.loads((Path(model_dir) / "config.json").read_text()))

    def projection_shape(self, proj: str) -> tuple[int, int]:
        """(in_features, out_features) of a Llama-family linear projection."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "q_proj": (self.hidden_size, q),
            "k_proj": (self.hidden_size, kv),
            "v_proj": (self.hidden_size, kv),
            "o_proj": (q, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }[proj]


@dataclass(frozen=True)
class AdapterInfo:
    """What validation learned about an adapter directory."""

    path: Path
    method: AdapterMethod
    rank: int
    digest: str
    targets: tuple[str, ...] = field(default=())  # LoRA target modules
    layers: tuple[int, ...] = field(default=())  # layers the adapter touches
    size_bytes: int = 0


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise AdapterError("file is missing", file=path.name) from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"not valid JSON ({e})", file=path.name) from e
    if not isinstance(data, dict):
        raise AdapterError("must hold a JSON object", file=path.name)
    return data


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """Parse and check a safetensors header: tensor name -> {dtype, shape, data_offsets}; no data is read."""
    name = path.name
    if not path.is_file():
        raise AdapterError("file is missing", file=name)
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise AdapterError("not a safetensors file (shorter than its 8-byte header length)", file=name)
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise AdapterError(f"corrupt safetensors header (length {header_len} > file size {size})", file=name)
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"corrupt safetensors header ({e})", file=name) from e
    if not isinstance(header, dict):
        raise AdapterError("corrupt safetensors header (not an object)", file=name)
    header.pop("__metadata__", None)
    data_len = size - 8 - header_len
    covered = 0
    for tensor, meta in header.items():
        try:
            _dtype, shape, (start, end) = meta["dtype"], meta["shape"], meta["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise AdapterError("corrupt safetensors entry", file=name, tensor=tensor) from e
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise AdapterError(f"corrupt shape {shape!r}", file=name, tensor=tensor)
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= data_len):
            raise AdapterError(
                f"data range [{start}, {end}) lies outside the file's {data_len} data bytes (truncated file?)",
                file=name,
                tensor=tensor,
            )
        covered += end - start
    if covered != data_len:
        raise AdapterError(f"corrupt or truncated: tensors cover {covered} of {data_len} data bytes", file=name)
    return header


def _weights_path(adapter_dir: Path) -> Path:
    weights = adapter_dir / WEIGHTS
    if not weights.is_file():
        pickled = [p for p in PICKLE_WEIGHTS if (adapter_dir / p).exists()]
        if pickled:
            raise AdapterError(
                "pickled weights are refused (loading them can run code); save the adapter as safetensors",
                file=pickled[0],
            )
        raise AdapterError("file is missing", file=WEIGHTS)
    return weights


def detect_method(adapter_dir: str | Path) -> AdapterMethod:
    """Tell the method from the directory's config file."""
    d = Path(adapter_dir)
    if not d.is_dir():
        raise AdapterError(f"adapter directory {str(d)!r} does not exist")
    if (d / DIREFT_CONFIG).exists():
        return AdapterMethod.DIREFT
    if (d / LORA_CONFIG).exists():
        return AdapterMethod.LORA
    raise AdapterError(f"neither {LORA_CONFIG} (PEFT LoRA) nor {DIREFT_CONFIG} (DiReFT) is in the adapter")


def _positive_rank(value: Any, file: str, max_rank: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise AdapterError(f"rank must be a positive integer, got {value!r}", file=file)
    if value > max_rank:
        raise AdapterError(f"rank {value} is over the limit of {max_rank}", file=file)
    return value


def _check_dtype(meta: dict[str, Any], tensor: str) -> None:
    if meta["dtype"] not in FLOAT_DTYPES:
        raise AdapterError(f"dtype {meta['dtype']} is not one of F32, F16, BF16", file=WEIGHTS, tensor=tensor)


def _check_shape(meta: dict[str, Any], tensor: str, expected: list[int]) -> None:
    if meta["shape"] != expected:
        raise AdapterError(
            f"has shape {meta['shape']}, expected {expected} for this base model", file=WEIGHTS, tensor=tensor
        )


def _inspect_lora(d: Path, shape: ModelShape, max_rank: int) -> tuple[int, tuple[str, ...], tuple[int, ...]]:
    cfg = _read_json(d / LORA_CONFIG)
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(f"peft_type {peft_type!r} is not LORA", file=LORA_CONFIG)
    rank = _positive_rank(cfg.get("r"), LORA_CONFIG, max_rank)
    alpha = cfg.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"lora_alpha must be a number, got {alpha!r}", file=LORA_CONFIG)
    for key, allowed in (("bias", (None, "none")), ("use_dora", (None, False)), ("fan_in_fan_out", (None, False))):
        if cfg.get(key) not in allowed:
            raise AdapterError(f"{key}={cfg.get(key)!r} is not supported", file=LORA_CONFIG)
    if cfg.get("modules_to_save"):
        raise AdapterError("modules_to_save (fully trained layers) is not supported", file=LORA_CONFIG)
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise AdapterError("per-module rank_pattern/alpha_pattern is not supported", file=LORA_CONFIG)
    supported = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
    targets = cfg.get("target_modules")
    if isinstance(targets, str) or not isinstance(targets, list) or not targets:
        raise AdapterError(f"target_modules must be a non-empty list of names, got {targets!r}", file=LORA_CONFIG)
    unknown = sorted({t for t in targets if t not in supported})
    if unknown:
        raise AdapterError(
            f"target_modules {unknown} are not projections of this model (supported: {list(supported)})",
            file=LORA_CONFIG,
        )

    header = read_safetensors_header(_weights_path(d))
    seen: dict[tuple[int, str], set[str]] = {}
    for tensor, meta in header.items():
        m = LORA_TENSOR.match(tensor)
        if not m:
            raise AdapterError("is not a LoRA weight of a decoder-layer projection", file=WEIGHTS, tensor=tensor)
        layer, proj, ab = int(m["layer"]), m["proj"], m["ab"]
        block = "self_attn" if proj in ATTENTION_PROJECTIONS else "mlp"
        if proj not in supported or m["block"] != block:
            raise AdapterError(f"names an unknown module {m['block']}.{proj}", file=WEIGHTS, tensor=tensor)
        if proj not in targets:
            raise AdapterError(f"module {proj} is not in target_modules {targets}", file=WEIGHTS, tensor=tensor)
        if layer >= shape.num_layers:
            raise AdapterError(
                f"layer {layer} is out of range: the model has {shape.num_layers} layers", file=WEIGHTS, tensor=tensor
            )
        _check_dtype(meta, tensor)
        fan_in, fan_out = shape.projection_shape(proj)
        _check_shape(meta, tensor, [rank, fan_in] if ab == "A" else [fan_out, rank])
        seen.setdefault((layer, proj), set()).add(ab)
    if not seen:
        raise AdapterError("holds no LoRA tensors", file=WEIGHTS)
    for (layer, proj), parts in sorted(seen.items()):
        if parts != {"A", "B"}:
            missing = ({"A", "B"} - parts).pop()
            name = f"base_model.model.model.layers.{layer}.{'self_attn' if proj in ATTENTION_PROJECTIONS else 'mlp'}"
            raise AdapterError("is missing", file=WEIGHTS, tensor=f"{name}.{proj}.lora_{missing}.weight")
    return rank, tuple(targets), tuple(sorted({layer for layer, _ in seen}))


def _inspect_direft(d: Path, shape: ModelShape, max_rank: int) -> tuple[int, tuple[int, ...]]:
    cfg = _read_json(d / DIREFT_CONFIG)
    if cfg.get("method") != "direft":
        raise AdapterError(f"method must be 'direft', got {cfg.get('method')!r}", file=DIREFT_CONFIG)
    rank = _positive_rank(cfg.get("rank"), DIREFT_CONFIG, max_rank)
    layers = cfg.get("layers")
    if (
        not isinstance(layers, list)
        or not layers
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
    ):
        raise AdapterError(f"layers must be a non-empty list of integers, got {layers!r}", file=DIREFT_CONFIG)
    if len(set(layers)) != len(layers):
        raise AdapterError(f"layers {layers} lists a layer twice", file=DIREFT_CONFIG)
    for layer in layers:
        if not 0 <= layer < shape.num_layers:
            raise AdapterError(
                f"layer {layer} is out of range: the model has layers 0..{shape.num_layers - 1}", file=DIREFT_CONFIG
            )
    header = read_safetensors_header(_weights_path(d))
    expected = {
        f"layers.{layer}.{part}": ([rank] if part == "b" else [rank, shape.hidden_size])
        for layer in layers
        for part in ("A", "B", "b")
    }
    for tensor, meta in header.items():
        if tensor not in expected:
            why = "its layer is not listed in preft_config.json" if DIREFT_TENSOR.match(tensor) else "unknown name"
            raise AdapterError(f"is not part of this DiReFT adapter ({why})", file=WEIGHTS, tensor=tensor)
        _check_dtype(meta, tensor)
        _check_shape(meta, tensor, expected[tensor])
    for tensor in expected:
        if tensor not in header:
            raise AdapterError("is missing", file=WEIGHTS, tensor=tensor)
    return rank, tuple(sorted(layers))


def content_digest(file_digests: Mapping[str, str]) -> str:
    """An adapter's content identity from its files' sha256 digests (name -> hex).

    Only the files the engine reads count (a README does not change what the adapter computes), so the registry,
    which knows each blob's sha256, and the engine, which hashes the directory it loads, agree on the digest.
    """
    h = hashlib.sha256()
    for name in sorted(n for n in file_digests if n in ADAPTER_FILES):
        h.update(f"{name}\0{file_digests[name]}\n".encode())
    return h.hexdigest()


def adapter_digest(adapter_dir: str | Path) -> str:
    """The content digest of an adapter directory (see `content_digest`)."""
    d = Path(adapter_dir)
    return content_digest({name: file_sha256(d / name) for name in ADAPTER_FILES if (d / name).is_file()})


@dataclass(frozen=True)
class AdapterCheck:
    """What validation learned from an adapter's configs and safetensors header."""

    method: AdapterMethod
    rank: int
    targets: tuple[str, ...] = field(default=())  # LoRA target modules
    layers: tuple[int, ...] = field(default=())  # layers the adapter touches


def check_adapter(adapter_dir: str | Path, shape: ModelShape, *, max_rank: int) -> AdapterCheck:
    """Validate an adapter directory against a base model, reading only JSON files and the safetensors header.

    Raises AdapterError naming the file and tensor. The weights' data bytes are never read, so a sparse file of the
    right size holding just the header validates the same as the real one.
    """
    d = Path(adapter_dir)
    method = detect_method(d)
    if method is AdapterMethod.LORA:
        rank, targets, layers = _inspect_lora(d, shape, max_rank)
        return AdapterCheck(method, rank, targets, layers)
    rank, layers = _inspect_direft(d, shape, max_rank)
    return AdapterCheck(method, rank, (), layers)


def inspect_adapter(adapter_dir: str | Path, shape: ModelShape, *, max_rank: int) -> AdapterInfo:
    """Validate an adapter directory against a base model and digest it; raise AdapterError naming file and tensor."""
    d = Path(adapter_dir)
    check = check_adapter(d, shape, max_rank=max_rank)
    return AdapterInfo(
        path=d.resolve(),
        method=check.method,
        rank=check.rank,
        digest=adapter_digest(d),
        targets=check.targets,
        layers=check.layers,
        size_bytes=sum((d / n).stat().st_size for n in ADAPTER_FILES if (d / n).is_file()),
    )


def load_direft_tensors(
    adapter_dir: str | Path, shape: ModelShape, *, max_rank: int
) -> dict[int, tuple[Any, Any, Any]]:
    """Validate then load a DiReFT adapter: layer -> (A [r, H], B [r, H], b [r]) as float32 CPU tensors."""
    from safetensors.torch import load_file

    d = Path(adapter_dir)
    _, layers = _inspect_direft(d, shape, max_rank)
    tensors = load_file(str(d / WEIGHTS), device="cpu")
    return {layer: tuple(tensors[f"layers.{layer}.{part}"].float() for part in ("A", "B", "b")) for layer in layers}
