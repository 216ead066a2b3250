"""Cold start through the gateway on an idle engine: time from a request for an adapter to its first token, with the
adapter in no tier (S3), in host memory only (not in a GPU slot), and on local disk only.

The tiers are set up by traffic alone: after the S3 pass the adapters hold GPU slots; requests for `gpu_slots`
other adapters take every slot (the host tier keeps them); after the host pass, requests for `host_adapters`
other adapters push them out of host memory onto the disk tier. The other adapters are small DiReFT ones (they
ride the same slots and the same host LRU), so the set-up costs seconds, not minutes.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from loadtest.platform.fleet import Target

FLUSH_THREADS = 8


def _complete(client: httpx.Client, target: Target, prompt: str) -> float:
    """Seconds until the answer of a one-token completion (its first token is its last)."""
    body = {"model": target.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    response = client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {target.api_key}"})
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{target.model}: {response.status_code} {response.text[:300]}")
    return elapsed


def _quantiles(tier: str, seconds: list[float]) -> dict:
    ordered = sorted(seconds)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {
        "tier": tier,
        "p50_s": round(statistics.median(ordered), 4),
        "p95_s": round(p95, 4),
        "n": len(ordered),
    }


def measure(
    gateway_url: str, cold: list[Target], fillers: list[Target], *, gpu_slots: int, host_adapters: int
) -> list[dict]:
    """[{tier, p50_s, p95_s, n}] for s3, host and disk; each cold adapter is requested alone, one after another."""
    needed = gpu_slots + host_adapters + 16
    if len(fillers) < needed:
        raise ValueError(f"the cold-start set-up needs {needed} filler adapters, the fleet has {len(fillers)}")
    prompt = " ".join(f"w{3 + i}" for i in range(16))
    with httpx.Client(base_url=gateway_url, timeout=300) as client:

        def timed_pass() -> list[float]:
            return [_complete(client, t, prompt) for t in cold]

        def take(targets: list[Target]) -> None:
            with ThreadPoolExecutor(FLUSH_THREADS) as pool:
                list(pool.map(lambda t: _complete(client, t, prompt), targets))

        s3 = timed_pass()
        take(fillers[: gpu_slots + 8])  # every GPU slot to another adapter
        host = timed_pass()
        take(fillers[gpu_slots + 8 : needed])  # every host-memory place to another adapter
        disk = timed_pass()
    return [_quantiles("s3", s3), _quantiles("host", host), _quantiles("disk", disk)]
