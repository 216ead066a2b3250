"""Gateway overhead: the same requests sent to the engine stub directly and through the gateway, in one run.

    .venv/bin/python -m loadtest.bench_gateway [--requests 1000] [--duration-s 5] [--concurrency 1,4,16,64]

Starts Redis, SeaweedFS and the registry (one tenant, one published LoRA for a generated tiny Llama), the engine
stub (`preft.gateway.testing`, zero delay, its own uvicorn process) and the gateway (`python -m preft.gateway`,
its own process), all on 127.0.0.1. The client (this process, asyncio + aiohttp: httpx's pool collapses at a few
dozen concurrent requests and would measure itself) then measures:
- latency: sequential requests, interleaved round-robin over the variants (stub direct, gateway with the adapter,
  gateway with the base model, and streaming stub vs streaming gateway), so drift hits all of them alike; the
  added latency is gateway minus direct at p50 and p99;
- throughput: closed-loop clients at each concurrency for a fixed time, stub direct and gateway (adapter);
  the CPU time the gateway and the stub processes used, per request, is read from /proc.
Every component shares this machine's cores with the client, so req/s is a floor; CPU per request is the cost.
Prints one JSON report and writes it (and a plot) to loadtest/results/gateway-overhead.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np

from preft.api.v1 import adapter_pb2 as apb
from preft.api.v1 import registry_pb2 as pb
from preft.common.engine_contract import MULTIPLEX_HEADER, AdapterFileSpec, AdapterSpec, EngineRequest, bearer
from preft.common.redis_acl import new_passwords
from preft.devtools.tiny import TinyModelSpec, build_lora, build_model
from preft.gateway.testing import STUB_ENGINE_TOKEN
from preft.registry.client import RegistryClient, scan_adapter_dir
from preft.stack import RedisServer, SeaweedS3, free_port, wait_until

TOKEN = "bench-admin-token"
BASE = "tiny-llama"
PROMPT = "the adapter serve tenant request batch cache block slot layer weight rank prompt output stream"
MAX_TOKENS = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000, help="Sequential requests per latency variant")
    ap.add_argument("--duration-s", type=float, default=5.0, help="Length of each throughput step")
    ap.add_argument("--concurrency", default="1,4,16,64", help="Closed-loop client counts for throughput")
    ap.add_argument("--out", type=Path, default=Path("loadtest/results/gateway-overhead"))
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    with tempfile.TemporaryDirectory(prefix="preft-gateway-bench-") as tmp_name:
        tmp = Path(tmp_name)
        with (
            RedisServer(tmp / "redis", free_port(), persist=False, passwords=new_passwords()) as redis_server,
            SeaweedS3(tmp / "s3", free_port(), access_key="bench", secret_key="bench-secret") as s3,
        ):
            report = run(args, levels, tmp, redis_server, s3.endpoint_url)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    samples = report.pop("_samples_s")
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    plot(samples, report, args.out.with_suffix(".png"))
    print(json.dumps(report, indent=2))


def spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    out = log.open("w")
    return subprocess.Popen(argv, env={**os.environ, **env}, stdout=out, stderr=out)


def run(args: argparse.Namespace, levels: list[int], tmp: Path, redis: RedisServer, s3_url: str) -> dict[str, Any]:
    model = build_model(tmp / "model", TinyModelSpec(arch="llama", seed=1))
    lora = build_lora(tmp / "lora", model, rank=8, seed=2)
    registry_port, stub_port, gateway_port, metrics_port = free_port(), free_port(), free_port(), free_port()
    procs = {
        "registry": spawn(
            [sys.executable, "-m", "preft.registry.server"],
            {
                "PREFT_REGISTRY__LISTEN_ADDRESS": f"127.0.0.1:{registry_port}",
                "PREFT_REGISTRY__ADMIN_TOKEN": TOKEN,
                "PREFT_REGISTRY__REDIS__URL": redis.url_for("registry"),  # (its own ACL user)
                "PREFT_REGISTRY__S3__ENDPOINT_URL": s3_url,
                "PREFT_REGISTRY__S3__ACCESS_KEY": "bench",
                "PREFT_REGISTRY__S3__SECRET_KEY": "bench-secret",
            },
            tmp / "registry.log",
        ),
        "stub": spawn(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "--factory",
                "preft.gateway.testing:create_stub_engine",
                "--host",
                "127.0.0.1",
                "--port",
                str(stub_port),
                "--no-access-log",
                "--log-level",
                "warning",
            ],
            {},
            tmp / "stub.log",
        ),
    }
    try:
        client = RegistryClient(f"127.0.0.1:{registry_port}", TOKEN, timeout_s=30)
        wait_until(lambda: client.call("ListTenants", pb.ListTenantsRequest()) is not None, timeout_s=30, what="reg")
        client.call(
            "RegisterBaseModel", pb.RegisterBaseModelRequest(id=BASE, config_json=(model / "config.json").read_text())
        )
        limits = pb.TenantLimits(requests_per_min=10**9, tokens_per_min=10**12)
        client.call("CreateTenant", pb.CreateTenantRequest(id="bench", limits=limits))
        key = client.call("IssueKey", pb.IssueKeyRequest(tenant="bench", label="bench")).secret
        manifest = client.upload_adapter(
            scan_adapter_dir(lora), tenant="bench", name="chat", mode=apb.POSITION_MODE_PREFILL
        ).manifest
        procs["gateway"] = spawn(
            [sys.executable, "-m", "preft.gateway"],
            {
                "PREFT_GATEWAY__PORT": str(gateway_port),
                "PREFT_GATEWAY__METRICS_ADDRESS": f"127.0.0.1:{metrics_port}",
                "PREFT_GATEWAY__ACCESS_LOG": "false",
                "PREFT_GATEWAY__REDIS__URL": redis.url_for("gateway"),  # (its own ACL user)
                "PREFT_GATEWAY__REGISTRY_ADDRESS": f"127.0.0.1:{registry_port}",
                "PREFT_GATEWAY__REGISTRY_TOKEN": TOKEN,
                "PREFT_GATEWAY__ENGINE_URL": f"http://127.0.0.1:{stub_port}",
                "PREFT_GATEWAY__ENGINE_TOKEN": STUB_ENGINE_TOKEN,
                "PREFT_GATEWAY__MODEL_DIR": str(model),
                "PREFT_GATEWAY__SERVED_MODEL_NAME": BASE,
            },
            tmp / "gateway.log",
        )
        gateway_url, stub_url = f"http://127.0.0.1:{gateway_port}", f"http://127.0.0.1:{stub_port}"
        for name, url in (("gateway", f"{gateway_url}/readyz"), ("stub", f"{stub_url}/generate")):
            wait_until(lambda u=url: httpx.get(u).status_code in (200, 405), timeout_s=60, what=name)
        from transformers import AutoTokenizer

        prompt_ids = AutoTokenizer.from_pretrained(str(model)).encode(PROMPT)
        adapter = AdapterSpec(
            digest=manifest.digest,
            method="lora",
            files=[AdapterFileSpec(path=f.path, sha256=f.sha256, size_bytes=f.size_bytes) for f in manifest.files],
            ref="bench/chat@v1",
        )
        variants = make_variants(gateway_url, stub_url, key, prompt_ids, adapter)
        load_before = os.getloadavg()[0]
        report = asyncio.run(measure(args, levels, variants, procs, f"http://127.0.0.1:{metrics_port}/metrics"))
        report["setup"] = {
            "machine": f"{os.cpu_count()} cores shared by the client, gateway, stub, Redis, registry, SeaweedFS",
            # other work on the machine skews req/s and tails; CPU ms per request is the steadier number
            "load_average_1m": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
            "prompt_tokens": len(prompt_ids),
            "max_tokens": MAX_TOKENS,
            "client": "one asyncio process, aiohttp (HTTP/1.1 keep-alive)",
            "gateway": "python -m preft.gateway: uvicorn, 1 worker, access log off; auth cached, resolve cached",
        }
        return report
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(15)


def make_variants(
    gateway_url: str, stub_url: str, key: str, prompt_ids: list[int], adapter: AdapterSpec
) -> dict[str, dict[str, Any]]:
    auth = {"authorization": f"Bearer {key}"}

    def engine(stream: bool) -> dict[str, Any]:
        req = EngineRequest(
            request_id="bench", prompt_token_ids=prompt_ids, max_tokens=MAX_TOKENS, stream=stream, adapter=adapter
        )
        return {
            "url": f"{stub_url}/generate",
            "content": req.model_dump_json(exclude_none=True).encode(),
            "headers": {
                MULTIPLEX_HEADER: adapter.digest,
                "authorization": bearer(STUB_ENGINE_TOKEN),
                "content-type": "application/json",
            },
            "stream": stream,
        }

    def gateway(model: str, stream: bool) -> dict[str, Any]:
        body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
        return {
            "url": f"{gateway_url}/v1/completions",
            "content": json.dumps(body).encode(),
            "headers": {**auth, "content-type": "application/json"},
            "stream": stream,
        }

    return {
        "direct": engine(False),
        "gateway_adapter": gateway("chat", False),
        "gateway_base": gateway(BASE, False),
        "direct_stream": engine(True),
        "gateway_adapter_stream": gateway("chat", True),
    }


async def send(session: aiohttp.ClientSession, v: dict[str, Any]) -> None:
    async with session.post(v["url"], data=v["content"], headers=v["headers"]) as resp:
        if v["stream"]:
            async for _ in resp.content.iter_any():
                pass
        else:
            await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{v['url']}: HTTP {resp.status}: {(await resp.text())[:300]}")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def measure(
    args: argparse.Namespace, levels: list[int], variants: dict[str, dict[str, Any]], procs: dict, metrics_url: str
) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=max(levels) * 2)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as client:
        for _ in range(200):  # warm up connections, caches, code paths
            for v in variants.values():
                await send(client, v)
        samples: dict[str, list[float]] = {name: [] for name in variants}
        before = await overhead_sums(client, metrics_url)
        for _ in range(args.requests):
            for name, v in variants.items():
                start = time.perf_counter()
                await send(client, v)
                samples[name].append(time.perf_counter() - start)
        after = await overhead_sums(client, metrics_url)
        latency = {name: pcts(s) for name, s in samples.items()}
        added = {
            "gateway_adapter": diff(latency["gateway_adapter"], latency["direct"]),
            "gateway_base": diff(latency["gateway_base"], latency["direct"]),
            "gateway_adapter_stream": diff(latency["gateway_adapter_stream"], latency["direct_stream"]),
        }

        throughput: dict[str, list[dict[str, float]]] = {"direct": [], "gateway_adapter": []}
        for concurrency in levels:
            for name in throughput:
                throughput[name].append(await closed_loop(client, variants[name], concurrency, args.duration_s, procs))
    best = {name: max(steps, key=lambda s: s["req_per_s"]) for name, steps in throughput.items()}
    return {
        "latency_ms": latency,
        "added_latency_ms": added,
        # preft_gateway_overhead_seconds over the sequential phase: arrival to the engine call, inside the gateway
        "in_gateway_before_engine_mean_ms": round(1000 * (after[0] - before[0]) / (after[1] - before[1]), 3),
        "throughput": throughput,
        "max_req_per_s": {name: round(s["req_per_s"], 1) for name, s in best.items()},
        "_samples_s": samples,
    }


async def closed_loop(
    client: aiohttp.ClientSession, v: dict[str, Any], concurrency: int, duration_s: float, procs: dict
) -> dict[str, float]:
    done = 0
    stop_at = time.perf_counter() + duration_s

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await send(client, v)
            done += 1

    cpu0 = {n: cpu_s(p.pid) for n, p in procs.items() if n in ("gateway", "stub")}
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    cpu = {n: cpu_s(procs[n].pid) - c for n, c in cpu0.items()}
    return {
        "concurrency": concurrency,
        "requests": done,
        "req_per_s": done / wall,
        "gateway_cpu_ms_per_req": 1000 * cpu["gateway"] / done,
        "stub_cpu_ms_per_req": 1000 * cpu["stub"] / done,
    }


def pcts(samples_s: list[float]) -> dict[str, float]:
    ms = np.array(samples_s) * 1000
    return {q: round(float(np.percentile(ms, p)), 3) for q, p in (("p50", 50), ("p90", 90), ("p99", 99))} | {
        "mean": round(float(ms.mean()), 3)
    }


def diff(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: round(a[k] - b[k], 3) for k in ("p50", "p99", "mean")}


async def overhead_sums(client: aiohttp.ClientSession, metrics_url: str) -> tuple[float, float]:
    """(sum, count) of preft_gateway_overhead_seconds as the gateway exports them now."""
    async with client.get(metrics_url) as resp:
        text = await resp.text()
    values = {}
    for line in text.splitlines():
        for part in ("sum", "count"):
            if line.startswith(f"preft_gateway_overhead_seconds_{part} "):
                values[part] = float(line.split()[1])
    return values["sum"], values["count"]


def plot(samples: dict[str, list[float]], report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, s in samples.items():
        ms = np.sort(np.array(s) * 1000)
        left.plot(ms, np.arange(1, len(ms) + 1) / len(ms), label=name)
    left.set_xscale("log")
    left.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    left.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.set_xlabel("request latency, sequential (ms)")
    left.set_ylabel("fraction of requests")
    added = report["added_latency_ms"]["gateway_adapter"]
    left.set_title(f"gateway adds p50 {added['p50']:.2f} ms, p99 {added['p99']:.2f} ms (adapter, non-streaming)")
    left.legend(fontsize=8)
    for name, steps in report["throughput"].items():
        right.plot([s["concurrency"] for s in steps], [s["req_per_s"] for s in steps], marker="o", label=name)
    right.set_xscale("log", base=2)
    right.set_xlabel("concurrent clients")
    right.set_ylabel("requests/s")
    right.set_title("closed-loop throughput (all processes share the cores)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
