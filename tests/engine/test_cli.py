"""`preft generate` end to end: a requests file with mixed adapters, modes and bad lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reference import reference_generate

pytestmark = pytest.mark.engine

PREFT = Path(sys.executable).with_name("preft")


def test_generate_file_mixed_requests(model_dirs, adapters, tmp_path):
    model, ads = model_dirs["llama"], adapters["llama"]
    lines = [
        {"id": "base", "prompt_ids": [5, 9, 13, 17, 21, 25], "adapter": None, "mode": "prefill", "max_tokens": 6},
        {
            "id": "lora-p",
            "prompt_ids": [5, 9, 13, 17, 21, 25],
            "adapter": str(ads["lora_a"]),
            "mode": "prefill",
            "max_tokens": 6,
            "comment": "unknown keys are ignored",
        },
        {
            "id": "direft-a",
            "prompt_ids": [5, 9, 13, 17, 21, 25],
            "adapter": str(ads["direft_b"]),
            "mode": "all",
            "max_tokens": 6,
        },
        {"id": "text", "prompt": "hello world the adapter", "adapter": str(ads["lora_b"]), "max_tokens": 4},
        {"id": "missing-adapter", "prompt_ids": [5, 6], "adapter": str(tmp_path / "nope"), "max_tokens": 4},
    ]
    req_file, out_file = tmp_path / "req.jsonl", tmp_path / "out.jsonl"
    req_file.write_text("\n".join(json.dumps(x) for x in lines) + "\n{broken\n")
    proc = subprocess.run(
        [
            str(PREFT),
            "generate",
            "--model",
            str(model),
            "--requests",
            str(req_file),
            "--output",
            str(out_file),
            "--dtype",
            "float32",
            "--max-loras",
            "2",
            "--max-num-batched-tokens",
            "16",
            "--max-model-len",
            "256",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 1, proc.stderr[-3000:]  # two requests fail, the rest succeed
    out = {o["id"]: o for o in map(json.loads, out_file.read_text().splitlines())}
    assert set(out) == {"base", "lora-p", "direft-a", "text", "missing-adapter", "line-6"}
    for rid in ("base", "lora-p", "direft-a"):
        req = next(x for x in lines if x["id"] == rid)
        assert out[rid]["token_ids"] == reference_generate(model, req["prompt_ids"], req["adapter"], req["mode"], 6)
        assert isinstance(out[rid]["text"], str)
    assert len(out["text"]["token_ids"]) == 4
    assert "does not exist" in out["missing-adapter"]["error"]
    assert "not valid JSON" in out["line-6"]["error"]
    assert "4 of 6 requests succeeded" in proc.stderr


def test_usage_errors_exit_2(model_dirs, tmp_path):
    proc = subprocess.run(
        [str(PREFT), "generate", "--model", str(model_dirs["llama"])], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "--requests" in proc.stderr
    proc = subprocess.run(
        [str(PREFT), "generate", "--model", str(tmp_path), "--prompt", "hi"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "not a model directory" in proc.stderr
