"""Outages of the stack's Redis and S3 (runs after test_stack.py: it kills those servers and starts replacements
that serve the package's later tests)."""

from __future__ import annotations

import json
import os
import signal
import time

import openai
import pytest

from preft.api.v1 import registry_pb2 as pb
from preft.devtools.tiny import build_lora
from preft.registry.client import scan_adapter_dir
from preft.stack.local import PIDS_FILE
from preft.stack.servers import RedisServer, SeaweedS3

from .test_stack import PROMPT, client


def _kill(stack, part: str) -> None:
    pid = json.loads((stack.state_dir / PIDS_FILE).read_text())[part]
    os.killpg(pid, signal.SIGKILL)
    time.sleep(0.5)


def _until_ok(call, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except (openai.APIStatusError, openai.APIConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_s3_down_cold_adapters_503_resident_keep_serving(stack, tmp_path):
    demo = client(stack)
    demo.completions.create(model="demo-lora", prompt=PROMPT, max_tokens=2)  # resident now
    with stack.local().registry_client() as c:
        files = scan_adapter_dir(build_lora(tmp_path / "cold", stack.info.model_dir, rank=4, seed=99))
        c.upload_adapter(files, tenant="demo", name="cold")
    _kill(stack, "s3")
    try:
        with pytest.raises(openai.APIStatusError) as e:
            demo.completions.create(model="cold", prompt=PROMPT, max_tokens=2)
        assert e.value.status_code == 503
        # served (sampled: a tiny random model's tokens may decode to no text, or end at its EOS)
        assert demo.completions.create(model="demo-lora", prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1
    finally:
        s3 = SeaweedS3(
            stack.state_dir / "s3",
            stack.info.ports.s3,
            access_key="preft-local",
            secret_key=json.loads((stack.state_dir / "secrets.json").read_text())["s3_secret_key"],
        )
        stack.replacements.append(s3.start(timeout_s=60))
    # the failure was not cached: once S3 is back, the cold adapter loads
    assert _until_ok(lambda: demo.completions.create(model="cold", prompt=PROMPT, max_tokens=2)).choices


def test_redis_down_503_within_a_second_then_recovers(stack):
    demo = client(stack)
    demo.completions.create(model="demo-direft", prompt=PROMPT, max_tokens=2)
    _kill(stack, "redis")
    try:
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError) as e:
            demo.completions.create(model="demo-direft", prompt=PROMPT, max_tokens=2)
        assert e.value.status_code == 503 and time.monotonic() - start < 1.0
    finally:
        redis = RedisServer(
            stack.state_dir / "redis", stack.info.ports.redis, persist=True, passwords=stack.local().redis_passwords
        )
        stack.replacements.append(redis.start())
    assert _until_ok(lambda: demo.completions.create(model="demo-direft", prompt=PROMPT, max_tokens=2)).choices
    with stack.local().registry_client() as c:  # the data survived (append-only file)
        assert c.call("ListAdapters", pb.ListAdaptersRequest(tenant="demo")).adapters
