"""Broken adapter directories, each made from a good one, with the words its error message must contain."""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

from safetensors.torch import load_file, save_file

from preft.devtools.tiny import TinyModelSpec, build_lora, build_model


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(d: Path, edit: Callable[[dict], None]) -> None:
    tensors = load_file(str(d / "adapter_model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "adapter_model.safetensors"))


def _edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


LORA_Q0_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def make_bad_adapters(lora: Path, direft: Path, root: Path) -> dict[str, tuple[Path, tuple[str, ...]]]:
    """name -> (adapter dir, substrings the error must contain). `lora` targets all 7 projections."""
    root.mkdir(parents=True, exist_ok=True)
    cases: dict[str, tuple[Path, tuple[str, ...]]] = {}

    def case(name: str, src: Path, *expect: str) -> Path:
        d = _copy(src, root / name)
        cases[name] = (d, expect)
        return d

    cases["missing-directory"] = (root / "does-not-exist", ("does not exist",))
    d = case("missing-weights", lora, "adapter_model.safetensors", "missing")
    (d / "adapter_model.safetensors").unlink()
    d = case("missing-config", direft, "adapter_config.json", "preft_config.json")
    (d / "preft_config.json").unlink()
    d = case("pickle-bin", lora, "adapter_model.bin", "pickle")
    (d / "adapter_model.safetensors").unlink()
    (d / "adapter_model.bin").write_bytes(pickle.dumps({"x": 1}))
    d = case("corrupt-header", lora, "adapter_model.safetensors", "corrupt")
    raw = (d / "adapter_model.safetensors").read_bytes()
    (d / "adapter_model.safetensors").write_bytes(raw[:8] + b"{not json" + raw[17:])
    d = case("truncated", lora, "adapter_model.safetensors", "truncated")
    raw = (d / "adapter_model.safetensors").read_bytes()
    (d / "adapter_model.safetensors").write_bytes(raw[: len(raw) - 100])
    d = case("garbage-file", lora, "adapter_model.safetensors")
    (d / "adapter_model.safetensors").write_bytes(b"\x00\x01garbage")
    d = case("config-not-json", lora, "adapter_config.json", "JSON")
    (d / "adapter_config.json").write_text("{'r': 8")
    d = case("lora-wrong-shape", lora, "adapter_model.safetensors", LORA_Q0_A, "shape")
    _edit_tensors(d, lambda t: t.__setitem__(LORA_Q0_A, t[LORA_Q0_A][:, :-4].contiguous()))
    d = case("lora-missing-tensor", lora, "lora_B", "missing")
    _edit_tensors(d, lambda t: t.pop(LORA_Q0_A.replace("lora_A", "lora_B")))
    d = case("lora-rank-over-limit", lora, "adapter_config.json", "rank 32", "limit")
    _edit_json(d / "adapter_config.json", lambda c: c.__setitem__("r", 32))
    d = case("lora-layer-out-of-range", lora, "layers.7", "out of range")
    _edit_tensors(d, lambda t: t.__setitem__(LORA_Q0_A.replace("layers.0", "layers.7"), t[LORA_Q0_A].clone()))
    d = case("lora-unknown-target", lora, "adapter_config.json", "lm_head")
    _edit_json(d / "adapter_config.json", lambda c: c.__setitem__("target_modules", ["q_proj", "lm_head"]))
    d = case("lora-dora", lora, "adapter_config.json", "use_dora")
    _edit_json(d / "adapter_config.json", lambda c: c.__setitem__("use_dora", True))
    d = case("lora-int-dtype", lora, LORA_Q0_A, "dtype")
    _edit_tensors(d, lambda t: t.__setitem__(LORA_Q0_A, t[LORA_Q0_A].to(dtype=__import__("torch").int32)))
    d = case("direft-layer-out-of-range", direft, "preft_config.json", "layer 9", "out of range")
    _edit_json(d / "preft_config.json", lambda c: c.__setitem__("layers", [0, 9]))
    d = case("direft-wrong-shape", direft, "layers.0.B", "shape")
    _edit_tensors(d, lambda t: t.__setitem__("layers.0.B", t["layers.0.B"][:, :-1].contiguous()))
    d = case("direft-missing-bias", direft, "layers.0.b", "missing")
    _edit_tensors(d, lambda t: t.pop("layers.0.b"))
    d = case("direft-rank-over-limit", direft, "preft_config.json", "rank 64")
    _edit_json(d / "preft_config.json", lambda c: c.__setitem__("rank", 64))
    d = case("direft-wrong-method", direft, "preft_config.json", "direft")
    _edit_json(d / "preft_config.json", lambda c: c.__setitem__("method", "loreft"))
    # An adapter trained for another model: hidden size 96 instead of 64.
    other = build_model(root / "_other_model", TinyModelSpec(hidden_size=96, num_heads=3, intermediate_size=160))
    cases["other-model"] = (build_lora(root / "other-model", other), ("adapter_model.safetensors", "shape"))
    return cases
