"""`preft generate` end to end: a requests file with mixed adapters, modes, sampling options and bad lines."""

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
    """Each line's adapter, mode and sampling options hold (--sampling's are every line's default: logprobs here);
    lines that cannot run, one vLLM refuses among them (a regex it cannot compile), fail alone."""
    model, ads = model_dirs["llama"], adapters["llama"]
    prompt, lora = [5, 9, 13, 17, 21, 25], str(ads["lora_a"])
    greedy = reference_generate(model, prompt, lora, "prefill", 8)
    sampled = {"prompt_ids": prompt, "adapter": lora, "max_tokens": 8}
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
        {"id": "stopped", **sampled, "stop_token_ids": [greedy[2]], "logprobs": 2},
        {"id": "penalized", **sampled, "repetition_penalty": 1.8},
        {"id": "refused", **sampled, "constraint": {"regex": "(unclosed"}},
        {"id": "bad-top-p", **sampled, "top_p": 0},
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
            "--sampling",
            '{"logprobs": 1}',
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 1, proc.stderr[-3000:]  # four requests fail, the rest succeed
    out = {o["id"]: o for o in map(json.loads, out_file.read_text().splitlines())}
    assert set(out) == {x["id"] for x in lines} | {"line-10"}
    for rid in ("base", "lora-p", "direft-a"):
        req = next(x for x in lines if x["id"] == rid)
        assert out[rid]["token_ids"] == reference_generate(model, req["prompt_ids"], req["adapter"], req["mode"], 6)
        assert isinstance(out[rid]["text"], str) and out[rid]["finish_reason"] == "length"
        assert [lp["token_id"] for lp in out[rid]["logprobs"]] == out[rid]["token_ids"]
        assert all(len(lp["top"]) == 1 for lp in out[rid]["logprobs"])
    assert len(out["text"]["token_ids"]) == 4
    stopped = out["stopped"]
    assert stopped["token_ids"] == greedy[:3] and stopped["finish_reason"] == "stop"
    assert [len(lp["top"]) for lp in stopped["logprobs"]] == [2, 2, 2]  # (the line's own logprobs win)
    penalized = reference_generate(model, prompt, lora, "prefill", 8, repetition_penalty=1.8)
    assert out["penalized"]["token_ids"] == penalized != greedy
    assert "does not exist" in out["missing-adapter"]["error"]
    assert "the engine refused the request" in out["refused"]["error"]
    assert "top_p" in out["bad-top-p"]["error"]
    assert "not valid JSON" in out["line-10"]["error"]
    assert "6 of 10 requests succeeded" in proc.stderr


def test_usage_errors_exit_2(model_dirs, tmp_path):
    proc = subprocess.run(
        [str(PREFT), "generate", "--model", str(model_dirs["llama"])], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "--requests" in proc.stderr
    proc = subprocess.run(
        [str(PREFT), "generate", "--model", str(tmp_path), "--prompt", "hi"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "not a model directory" in proc.stderr
    for sampling, says in (("{not json", "not JSON"), ('{"max_tokens": 3}', "sampling options")):
        proc = subprocess.run(
            [str(PREFT), "generate", "--model", str(model_dirs["llama"]), "--prompt", "hi", "--sampling", sampling],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr
