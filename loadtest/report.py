"""Per-mode report from Prometheus metrics scraped before and after a load run.

Per position mode (prefill, all, base): throughput (prompt and generated tokens/s over the run), time to first
token and inter-token latency percentiles (from histogram bucket deltas, interpolated as Prometheus'
histogram_quantile does), and the error rate. Written as markdown plus PNG plots.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODES = ("prefill", "all", "base")
QUANTILES = (0.5, 0.9, 0.99)


def scrape(urls: list[str]) -> list[str]:
    return [httpx.get(url, timeout=10).raise_for_status().text for url in urls]


@dataclass
class Samples:
    """Counter values and histogram buckets summed over scraped endpoints, keyed by (name, mode[, le])."""

    counters: dict[tuple[str, str, str], float] = field(default_factory=lambda: defaultdict(float))
    buckets: dict[tuple[str, str, float], float] = field(default_factory=lambda: defaultdict(float))

    @classmethod
    def parse(cls, texts: list[str]) -> Samples:
        s = cls()
        for text in texts:
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    mode = sample.labels.get("mode", "")
                    if sample.name.endswith("_bucket"):
                        s.buckets[(sample.name[: -len("_bucket")], mode, float(sample.labels["le"]))] += sample.value
                    elif sample.name.endswith("_total"):
                        outcome = sample.labels.get("outcome", "")
                        s.counters[(sample.name, mode, outcome)] += sample.value
        return s

    def minus(self, before: Samples) -> Samples:
        d = Samples()
        for k, v in self.counters.items():
            d.counters[k] = v - before.counters.get(k, 0.0)
        for k, v in self.buckets.items():
            d.buckets[k] = v - before.buckets.get(k, 0.0)
        return d

    def counter(self, name: str, mode: str, outcome: str | None = None) -> float:
        return sum(v for (n, m, o), v in self.counters.items() if n == name and m == mode and outcome in (None, o))

    def quantile(self, name: str, mode: str, q: float) -> float | None:
        """histogram_quantile over the mode's cumulative buckets (None without observations)."""
        cumulative = sorted((le, v) for (n, m, le), v in self.buckets.items() if n == name and m == mode)
        if not cumulative or cumulative[-1][1] <= 0:
            return None
        total = cumulative[-1][1]
        rank = q * total
        prev_le, prev_count = 0.0, 0.0
        for le, count in cumulative:
            if count >= rank:
                if math.isinf(le):
                    return prev_le
                width = count - prev_count
                return prev_le + (le - prev_le) * ((rank - prev_count) / width if width else 0.0)
            prev_le, prev_count = le, count
        return prev_le


def summarize(delta: Samples, duration_s: float) -> dict[str, dict]:
    out = {}
    for mode in MODES:
        requests = delta.counter("preft_requests_total", mode)
        if requests <= 0:
            continue
        failed = requests - delta.counter("preft_requests_total", mode, "ok")
        prompt = delta.counter("preft_prompt_tokens_total", mode)
        generated = delta.counter("preft_generated_tokens_total", mode)
        out[mode] = {
            "requests": int(requests),
            "error_rate": failed / requests,
            "prompt_tokens_per_s": prompt / duration_s,
            "generated_tokens_per_s": generated / duration_s,
            "tokens_per_s": (prompt + generated) / duration_s,
            **{
                f"ttft_p{round(q * 100)}_s": delta.quantile("preft_time_to_first_token_seconds", mode, q)
                for q in QUANTILES
            },
            **{
                f"itl_p{round(q * 100)}_s": delta.quantile("preft_inter_token_latency_seconds", mode, q)
                for q in QUANTILES
            },
        }
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def write(summary: dict[str, dict], meta: dict, out: Path) -> None:
    """Markdown table + PNG plots next to it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# Load run: {meta.get('title', 'preft-serve')}",
        "",
        "Command: `" + meta.get("command", "") + "`",
        "",
        f"Duration {meta.get('duration_s', 0):.0f} s; Locust: {meta.get('locust', '')}",
        "",
        "| mode | requests | errors | tokens/s (prompt+gen) | gen tokens/s | TTFT p50 / p90 / p99 (ms) "
        "| ITL p50 / p90 / p99 (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, r in summary.items():
        ttft = " / ".join(_ms(r[f"ttft_p{p}_s"]) for p in (50, 90, 99))
        itl = " / ".join(_ms(r[f"itl_p{p}_s"]) for p in (50, 90, 99))
        lines.append(
            f"| {mode} | {r['requests']} | {r['error_rate']:.1%} | {r['tokens_per_s']:.1f} | "
            f"{r['generated_tokens_per_s']:.1f} | {ttft} | {itl} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    _plot(summary, out.with_suffix(".png"))


def _plot(summary: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(summary)
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    axes[0].bar(modes, [summary[m]["tokens_per_s"] for m in modes], color="tab:blue")
    axes[0].set_title("throughput (prompt + generated tokens/s)")
    for ax, metric, title in ((axes[1], "ttft", "time to first token (ms)"), (axes[2], "itl", "inter-token (ms)")):
        width = 0.25
        for i, p in enumerate((50, 90, 99)):
            values = [(summary[m][f"{metric}_p{p}_s"] or 0) * 1000 for m in modes]
            ax.bar([x + i * width for x in range(len(modes))], values, width, label=f"p{p}")
        ax.set_xticks([x + width for x in range(len(modes))], modes)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
