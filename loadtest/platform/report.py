"""The platform benchmark's report: the headline ratios, a table of every run, cold start and paging, and a plot."""

from __future__ import annotations

from pathlib import Path

TARGETS = (  # (numerator mode, denominator mode, the target)
    ("lorap", "base", 0.85),
    ("direftp", "base", 0.85),
    ("base", "vllm_base", 0.90),
    ("lorap", "vllm_lora", 5.0),
)


def _runs(data: dict) -> list[dict]:
    return [r for r in data.get("runs", []) if r.get("kind") == "run"]


def ratios(data: dict) -> list[dict]:
    """Output tokens/s of one mode over another's, per workload and popularity, for each target."""
    runs = _runs(data)
    out = []
    for num, den, target in TARGETS:
        for r in (r for r in runs if r["mode"] == num):
            base = [
                d
                for d in runs
                if d["mode"] == den
                and (d["prompt_tokens"], d["output_tokens"]) == (r["prompt_tokens"], r["output_tokens"])
                and (d["popularity"] in ("none", r["popularity"]))
            ]
            if base and base[0]["output_tok_s"]:
                value = r["output_tok_s"] / base[0]["output_tok_s"]
                out.append({
                    "ratio": f"{num} / {den}",
                    "workload": f"{r['prompt_tokens']}+{r['output_tokens']}",
                    "popularity": r["popularity"],
                    "value": round(value, 3),
                    "target": target,
                    "met": value >= target,
                })  # fmt: skip
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def markdown(data: dict) -> str:
    lines = [
        f"# Platform under load: {data.get('device', '?')}",
        "",
        "Gateway → Ray Serve replica → PreFT vLLM, adapters paged from S3; `vllm serve` peers on the same machine. "
        "Every number is read from Prometheus over the run's measured window (`python -m loadtest.platform`).",
        "",
        "| ratio (output tok/s) | workload | popularity | value | target | met |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['ratio']} | {r['workload']} | {r['popularity']} | {r['value']:.3f} | ≥ {r['target']} | "
        f"{'yes' if r['met'] else 'no'} |"
        for r in ratios(data)
    ]
    lines += [
        "",
        "| model | mode | popularity | workload | adapters | GPU slots | concurrency | output tok/s | total tok/s "
        "| TTFT p50 / p95 (ms) | ITL p50 / p95 (ms) | requests | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(data.get("runs", []), key=lambda r: (r["prompt_tokens"], r["kind"] != "sweep", r["mode"])):
        lines.append(
            f"| {r['model']} | {r['mode']}{' (sweep)' if r['kind'] == 'sweep' else ''} | {r['popularity']} | "
            f"{r['prompt_tokens']}+{r['output_tokens']} | {r['adapters']} | {r['gpu_slots']} | {r['concurrency']} | "
            f"{r['output_tok_s']:.0f} | {r['total_tok_s']:.0f} | {_ms(r['ttft_p50_s'])} / {_ms(r['ttft_p95_s'])} | "
            f"{_ms(r['itl_p50_s'])} / {_ms(r['itl_p95_s'])} | {r['requests']} | {r['failed']} |"
        )
    if data.get("cold_start"):
        lines += ["", "| cold start from | p50 (ms) | p95 (ms) | adapters |", "|---|---|---|---|"]
        lines += [f"| {c['tier']} | {_ms(c['p50_s'])} | {_ms(c['p95_s'])} | {c['n']} |" for c in data["cold_start"]]
    paged = [r for r in data.get("runs", []) if r.get("paging")]
    if paged:
        lines += ["", "| paging in the window | workload | adapters loaded into host memory | of them from S3 "
                  "| host load p50 / p95 (ms) |", "|---|---|---|---|---|"]  # fmt: skip
        lines += [
            f"| {r['mode']} {r['popularity']} | {r['prompt_tokens']}+{r['output_tokens']} | "
            f"{r['paging']['host_loads']} | {r['paging']['s3_fetches']} | "
            f"{_ms(r['paging']['host_load_p50_s'])} / {_ms(r['paging']['host_load_p95_s'])} |"
            for r in paged
        ]
    probes = [(r, p) for r in data.get("runs", []) for p in r.get("probes", [])]
    if probes:
        lines += ["", "Adapters with a broken blob, asked for under the load (outside the measured window):", ""]
        lines += [
            f"- `{p['model']}` during {r['mode']} {r['popularity']} {r['prompt_tokens']}+{r['output_tokens']}: "
            f"{p['status']} in {p['seconds']:.2f} s ({p['error'][:120]})"
            for r, p in probes
        ]
    if data.get("paging"):
        lines += ["", "Paging over the platform phase (engine counters):", ""]
        lines += [f"- `{name}`: {values}" for name, values in data["paging"].items()]
    return "\n".join(lines) + "\n"


def write(data: dict, out: Path) -> None:
    if not data.get("runs"):
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(markdown(data))
    _plot(data, out.with_suffix(".png"))


def _plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = _runs(data)
    workloads = sorted({(r["prompt_tokens"], r["output_tokens"]) for r in runs})
    fig, axes = plt.subplots(1, max(1, len(workloads)), figsize=(7 * max(1, len(workloads)), 4.5), squeeze=False)
    for ax, (p, o) in zip(axes[0], workloads, strict=False):
        rows = [r for r in runs if (r["prompt_tokens"], r["output_tokens"]) == (p, o)]
        labels = [f"{r['mode']}\n{r['popularity']}" if r["popularity"] != "none" else r["mode"] for r in rows]
        colors = ["tab:gray" if r["mode"].startswith("vllm") else "tab:blue" for r in rows]
        ax.bar(range(len(rows)), [r["output_tok_s"] for r in rows], color=colors)
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{rows[0]['model'] if rows else ''} {p}+{o} on {data.get('device', '?')} (gray: vllm serve)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
