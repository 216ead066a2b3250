"""Registry benchmark: register N adapters, then time `Resolve` over gRPC on loopback and blob upload throughput.

    .venv/bin/python -m loadtest.bench_registry --adapters 10000

Starts its own Redis and SeaweedFS (loopback, in a temporary directory) and the registry as a separate process,
so the timing client does not share a GIL with the server. Every adapter is distinct (a small random DiReFT for a
hidden-64 base model), spread over 100 tenants; uploads and publishes run through the full path (MissingBlobs,
UploadBlob, Publish with validation). Prints one JSON report and writes it with a latency plot.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from preft.api.v1 import registry_pb2 as pb
from preft.common.redis_acl import new_passwords
from preft.registry.client import LocalFile, RegistryClient
from preft.stack import RedisServer, SeaweedS3, free_port, wait_until

TOKEN = "bench-admin-token"
BASE_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 384,
}


def make_direft(d: Path, seed: int) -> list[LocalFile]:
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True)
    tensors = {}
    for layer in (0, 2):
        tensors[f"layers.{layer}.A"] = rng.standard_normal((4, 64), dtype=np.float32)
        tensors[f"layers.{layer}.B"] = rng.standard_normal((4, 64), dtype=np.float32)
        tensors[f"layers.{layer}.b"] = rng.standard_normal(4, dtype=np.float32)
    save_file(tensors, str(d / "adapter_model.safetensors"))
    (d / "preft_config.json").write_text(json.dumps({"method": "direft", "rank": 4, "layers": [0, 2]}))
    return [local_file(p) for p in sorted(d.iterdir())]


def local_file(p: Path) -> LocalFile:
    data = p.read_bytes()
    return LocalFile(p, hashlib.sha256(data).hexdigest(), len(data))


def percentiles(samples_s: list[float]) -> dict[str, float]:
    ms = np.array(samples_s) * 1000
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p90_ms": float(np.percentile(ms, 90)),
        "p99_ms": float(np.percentile(ms, 99)),
        "p999_ms": float(np.percentile(ms, 99.9)),
        "max_ms": float(ms.max()),
        "mean_ms": float(ms.mean()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=10_000)
    ap.add_argument("--tenants", type=int, default=100)
    ap.add_argument("--resolves", type=int, default=20_000)
    ap.add_argument("--publish-threads", type=int, default=8)
    ap.add_argument("--upload-mib", type=int, default=256, help="Size of the blob for the upload throughput test")
    ap.add_argument("--out", type=Path, default=Path("loadtest/results/registry-bench"))
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="preft-registry-bench-") as tmp_name:
        tmp = Path(tmp_name)
        with (
            RedisServer(tmp / "redis", free_port(), persist=False, passwords=new_passwords()) as redis_server,
            SeaweedS3(tmp / "s3", free_port(), access_key="bench", secret_key="bench-secret") as s3,
        ):
            report = run(args, tmp, redis_server, s3.endpoint_url)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    samples = report.pop("_resolve_samples_s")
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    plot(samples, report, args.out.with_suffix(".png"))
    print(json.dumps(report, indent=2))


def run(args: argparse.Namespace, tmp: Path, redis: RedisServer, s3_url: str) -> dict:
    port = free_port()
    env = {
        **os.environ,
        "PREFT_REGISTRY__LISTEN_ADDRESS": f"127.0.0.1:{port}",
        "PREFT_REGISTRY__ADMIN_TOKEN": TOKEN,
        "PREFT_REGISTRY__REDIS__URL": redis.url_for("registry"),  # (its own ACL user)
        "PREFT_REGISTRY__S3__ENDPOINT_URL": s3_url,
        "PREFT_REGISTRY__S3__ACCESS_KEY": "bench",
        "PREFT_REGISTRY__S3__SECRET_KEY": "bench-secret",
        "PREFT_REGISTRY__MAX_ADAPTER_BYTES": str((args.upload_mib + 1) << 20),
        "PREFT_REGISTRY__DEFAULT_MAX_ADAPTERS": str(args.adapters),
    }
    log = (tmp / "registry.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "preft.registry.server"], env=env, stdout=log, stderr=log)
    try:
        client = RegistryClient(f"127.0.0.1:{port}", TOKEN, timeout_s=30)
        wait_until(
            lambda: client.call("ListTenants", pb.ListTenantsRequest()) is not None, timeout_s=30, what="registry"
        )
        return measure(args, tmp, client)
    finally:
        server.terminate()
        server.wait(15)


def measure(args: argparse.Namespace, tmp: Path, client: RegistryClient) -> dict:
    client.call("RegisterBaseModel", pb.RegisterBaseModelRequest(id="bench-base", config_json=json.dumps(BASE_CONFIG)))
    tenants = [f"t{i:03d}" for i in range(args.tenants)]
    for t in tenants:
        client.call("CreateTenant", pb.CreateTenantRequest(id=t))
    adapters = [(tenants[i % len(tenants)], f"a{i:05d}") for i in range(args.adapters)]
    t0 = time.perf_counter()
    sources = [make_direft(tmp / "adapters" / f"{i}", seed=i) for i in range(args.adapters)]
    make_s = time.perf_counter() - t0

    def publish(i: int) -> float:
        tenant, name = adapters[i]
        start = time.perf_counter()
        client.upload_adapter(sources[i], tenant=tenant, name=name, uploader="bench")
        return time.perf_counter() - start

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.publish_threads) as pool:
        publish_s = list(pool.map(publish, range(args.adapters)))
    register_wall_s = time.perf_counter() - t0

    rng = random.Random(0)
    refs = []
    for _ in range(args.resolves):
        tenant, name = rng.choice(adapters)
        refs.append((tenant, rng.choice([name, f"{name}@v1", f"{name}:latest", f"{tenant}/{name}"])))
    for tenant, ref in refs[:500]:  # warm up connections and code paths
        client.resolve(tenant, ref)
    samples = []
    t0 = time.perf_counter()
    for tenant, ref in refs:
        start = time.perf_counter()
        client.resolve(tenant, ref)
        samples.append(time.perf_counter() - start)
    resolve_wall_s = time.perf_counter() - t0

    big = tmp / "big.bin"
    with big.open("wb") as f:
        for _ in range(args.upload_mib):
            f.write(os.urandom(1 << 20))
    blob = local_file(big)
    t0 = time.perf_counter()
    client.upload_blob(blob)
    upload_s = time.perf_counter() - t0

    return {
        "adapters": args.adapters,
        "tenants": args.tenants,
        "machine": f"{os.cpu_count()} cores (client, registry, Redis and SeaweedFS share them)",
        "register": {
            "wall_s": register_wall_s,
            "adapters_per_s": args.adapters / register_wall_s,
            "threads": args.publish_threads,
            "per_adapter": percentiles(publish_s),
            "generate_adapters_s": make_s,
        },
        "resolve": {
            "calls": len(samples),
            "sequential_calls_per_s": len(samples) / resolve_wall_s,
            **percentiles(samples),
            "stdev_ms": statistics.pstdev(samples) * 1000,
            "target_p99_ms": 2.0,
        },
        "upload": {
            "bytes": blob.size_bytes,
            "seconds": upload_s,
            "mib_per_s": blob.size_bytes / upload_s / (1 << 20),
            "path": "CLI client -> gRPC stream (1 MiB messages) -> registry -> S3 multipart (8 MiB parts)",
        },
        "_resolve_samples_s": samples,
    }


def plot(samples_s: list[float], report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = np.sort(np.array(samples_s) * 1000)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms))
    r = report["resolve"]
    for q, label in ((r["p50_ms"], "p50"), (r["p99_ms"], "p99")):
        ax.axvline(q, linestyle="--", color="gray")
        ax.text(q, 0.05, f" {label} {q:.2f} ms", rotation=90)
    ax.axvline(2.0, color="red", label="target p99 2 ms")
    ax.set_xscale("log")
    ax.set_xlabel("Resolve latency over gRPC on loopback (ms)")
    ax.set_ylabel("fraction of calls")
    ax.set_title(f"Registry resolve, {report['adapters']} adapters registered")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
