"""Issue 6's table: one object per model, workload and configuration, over the runs that measured it.

One H200 command runs 10 minutes, so the table is measured in runs of ``bench_table1`` (each one engine in one
process, its base requests beside its adapters), and the Qwen engine's pace follows the lent host's CPU, which
varied 2 x between passes of one run. So each PreFT row pools every full pass of its configuration over the
runs given: each pass's tokens/s over the median base-request pass of its own run's engine at that workload
(``bench_table1.pool_ratios`` within one run), and the median of those over all passes. Stock multi-LoRA and
the base model (vLLM without our plugin) keep the ratio to the base model of their own report;
``ratio_to_stock`` is tokens/s over stock's (stock is device-bound: its runs agreed within 2%).

``paced_ratio`` compares at equal host pace: decode is the base model's in every prefill-mode configuration,
so a pass's median decode-step period measures how fast the host ran during it. A log-log fit of the base passes'
tokens/s on their periods (one slope over the runs of this workload, an intercept per run) predicts the base
at each adapted pass's own period in its run; the median of the passes' tokens/s over those predictions is the
ratio, and the fit's residual spread (``paced_fit_sd``, in log tokens/s) how far one base pass strays from it.

Rows come from ``--current`` reports (the code as it is) and, for a configuration none of those measured,
from ``--earlier`` ones (marked ``"code": "earlier"``); ``[kernels: ...]``/``[launch: ...]`` A/B rows are left
out.

    python3 -m loadtest.engine.table1_summary --current RUN.json ... --earlier OLD.json ... --out OUT

(docs/benchmarks.md has the command that made the committed table.)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from loadtest.engine.bench_table1 import _pairs, _run_workload, base_passes, finish, own_passes

BASE_MODEL = "base model (vLLM without LoRA)"
BASE_REQUESTS = "base requests (PreFT engine)"
TARGET = 0.9  # issue 6: LoRAP and DiReFTP at >= 0.9 x the base model
SETTINGS = ("max_loras", "max_lora_rank", "max_cpu_loras", "max_num_seqs", "gpu_memory_utilization")
STEADY_PACE = 0.05  # base passes whose log decode periods spread less than this: the fit is their mean


@dataclass
class Summary:
    """One configuration at one workload of one model, over every run given that measured it."""

    model: str
    prompt_len: int
    output_len: int
    config: str
    engine: str
    method: str | None
    mode: str | None
    rank: int | None
    requests: int
    code: str  # "current" or "earlier"
    runs: list[str]
    passes: int  # full passes pooled (rows' own and their --pairs passes)
    tokens_per_s: float  # median over those passes
    ratio_to_base: float | None
    ratio_to_base_per_run: dict[str, float] = field(default_factory=dict)
    paired_ratio: float | None = None  # median over every --pairs pair of these runs
    pairs: int = 0
    paced_ratio: float | None = None  # over the base at each pass's own host pace (module docstring)
    paced_passes: int = 0
    paced_fit_sd: float | None = None
    ratio_to_stock: float | None = None
    prompt_only_s: float | None = None
    prompt_only_ratio_to_base: float | None = None
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    adapter_first_load_s: float | None = None
    settings: dict = field(default_factory=dict)


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 4) if values else None


@dataclass(frozen=True)
class PaceFit:
    """log(tokens/s) = intercept[run] + slope · log(decode-step period) over base passes: one slope, fitted
    within runs (another lease's machine may differ as a whole: its own intercept)."""

    intercepts: dict[str, float]
    slope: float
    sd: float  # residual standard deviation, in log tokens/s

    @classmethod
    def of(cls, points: list[tuple[str, float, float]]) -> PaceFit | None:
        """The fit of (run, tokens/s, period ms) points; None under three. Runs whose periods spread less than
        STEADY_PACE (a device-bound engine) leave the slope at 0: each run's base is then its mean."""
        if len(points) < 3:
            return None
        runs = np.array([run for run, _, _ in points])
        tps, period = np.log(np.array([(t, p) for _, t, p in points], dtype=float)).T
        mean = {run: (tps[runs == run].mean(), period[runs == run].mean()) for run in dict.fromkeys(runs)}
        d_tps = tps - np.array([mean[run][0] for run in runs])
        d_period = period - np.array([mean[run][1] for run in runs])
        steady = d_period.std() < STEADY_PACE
        slope = 0.0 if steady else float(d_period @ d_tps / (d_period @ d_period))
        intercepts = {run: float(t - slope * p) for run, (t, p) in mean.items()}
        return cls(intercepts, slope, float(np.std(d_tps - slope * d_period)))

    def base_at(self, run: str, period_ms: float) -> float | None:
        """The base's tokens/s in that run at that decode-step period (None: no base pass of that run)."""
        if run not in self.intercepts:
            return None
        return math.exp(self.intercepts[run] + self.slope * math.log(period_ms))


def _paces(r: dict) -> tuple[list[tuple[str, float, float]], list[tuple[str, float, float]]]:
    """The row's full passes with a decode-step period, as (run, tokens/s, period ms): (base passes, others)."""
    notes = r.get("notes") or {}
    period = notes.get("decode_step_period_ms_median")
    own = [(r["run"], r["tokens_per_s"], period)] if period else []
    pairs = list(zip(_pairs(r), notes.get("pairs_decode_step_period_ms", []), strict=False))
    base = [(r["run"], b, pb) for (b, _), (pb, _) in pairs if pb]
    others = [(r["run"], c, pc) for (_, c), (_, pc) in pairs if pc]
    return (own + base, others) if r["method"] is None else (base, own + others)


def _config(r: dict) -> str:
    if r["engine"] == "base":
        return BASE_MODEL
    return BASE_REQUESTS if r["engine"] == "preft" and r["method"] is None else r["config"]


def _rows(paths: list[Path], device: str | None = None) -> list[dict]:
    """Every row of these reports with its run (a merged report's rows keep theirs), its engine's settings and
    the device it ran on (`device` for reports that do not say: those made before bench_table1 recorded it)."""
    out = []
    for path in paths:
        report = finish(json.loads(path.read_text()))
        engines = report.get("engines", {})
        parts = report["settings"].get("parts", [report["settings"]])
        ran_on = {part.get("device") or device for part in parts}
        if len(ran_on) != 1 or None in ran_on:
            raise ValueError(f"{path}: on which device it ran is not recorded (give --device) or not one: {ran_on}")
        for r in report["results"]:
            if "[" in r["config"]:  # an A/B row of other kernels or launches, not the default code
                continue
            engine = engines.get(f"{r['model']} {r['engine']}", {})
            kwargs = engine.get("kwargs", {})
            settings = {k: kwargs[k] for k in SETTINGS if k in kwargs}
            settings["max_num_batched_tokens"] = engine.get("max_num_batched_tokens")
            part = parts[0] if len(parts) == 1 else {}
            settings.update({k: part[k] for k in ("vllm", "triton", "lora_kernels") if k in part})
            run = r.get("run") or path.stem
            out.append({"run": run, **r, "summary_settings": settings, "device": next(iter(ran_on))})
    return out


def one_device(rows: list[dict]) -> str | None:
    """The device all these rows ran on: ratios pool across runs of one kind of accelerator and host, not across
    kinds (ValueError)."""
    devices = {r["device"] for r in rows}
    if len(devices) > 1:
        raise ValueError(f"reports from different devices ({', '.join(sorted(devices))}): summarize each on its own")
    return next(iter(devices), None)


def summarize(current: list[dict], earlier: list[dict]) -> list[Summary]:
    """One Summary per (model, workload, configuration): the current rows', else the earlier ones'."""
    groups: dict[tuple, tuple[str, list[dict]]] = {}
    fits: dict[tuple, PaceFit | None] = {}
    for code, rows in (("current", current), ("earlier", earlier)):
        mine: dict[tuple, list[dict]] = {}
        paces: dict[tuple, list[tuple[str, float, float]]] = {}
        for r in _compared(rows):
            mine.setdefault((r["model"], r["prompt_len"], r["output_len"], _config(r)), []).append(r)
            if r["engine"] == "preft":
                paces.setdefault((code, r["model"], r["prompt_len"], r["output_len"]), []).extend(_paces(r)[0])
        fits.update({k: PaceFit.of(v) for k, v in paces.items()})
        for key, group in mine.items():
            groups.setdefault(key, (code, group))
    bases = base_passes(current + earlier)
    out = [_summary(key, code, group, bases, fits.get((code, *key[:3]))) for key, (code, group) in groups.items()]
    stock = {(s.model, s.prompt_len, s.output_len, s.rank): s for s in out if s.engine == "stock"}
    for s in out:
        ref = stock.get((s.model, s.prompt_len, s.output_len, s.rank)) if s.method == "lora" else None
        s.ratio_to_stock = round(s.tokens_per_s / ref.tokens_per_s, 3) if ref else None
    return sorted(out, key=_order)


def _compared(rows: list[dict]) -> list[dict]:
    """These rows less the base requests of a run and workload where no adapter ran (a run cut short after its
    base pass): a base that nothing is compared with."""
    adapted = {_run_workload(r) for r in rows if r["engine"] == "preft" and r["method"] is not None}
    return [r for r in rows if _config(r) != BASE_REQUESTS or _run_workload(r) in adapted]


def _order(s: Summary) -> tuple:
    """By model, workload (issue 6's main one first), then base model, stock, base requests, DiReFTP, LoRAP,
    LoRA `all`, each by rank."""
    workloads = [(256, 256), (1024, 128), (128, 1024)]
    workload = (s.prompt_len, s.output_len)
    kind = (
        0 if s.engine == "base" else 1 if s.engine == "stock" else 2 if s.method is None
        else 3 if s.method == "direft" else 4 if s.mode == "prefill" else 5
    )  # fmt: skip
    return (s.model, workloads.index(workload) if workload in workloads else 3, workload, kind, s.rank or 0, s.config)


def _summary(key: tuple, code: str, group: list[dict], bases: dict[tuple, list[float]], fit: PaceFit | None) -> Summary:
    """`bases`: every base-request pass by (run, model, workload) (``bench_table1.base_passes``); `fit`: the base
    passes' pace at this model and workload, over the reports of `code`."""
    model, prompt_len, output_len, config = key
    first = group[0]
    adapted = first["engine"] == "preft" and first["method"] is not None
    runs = list(dict.fromkeys(r["run"] for r in group))
    if config == BASE_REQUESTS:  # the base rows' passes and every pair's base pass in these runs
        passes = [t for run in runs for t in bases.get((run, *key[:3]), [])]
    else:
        passes = [t for r in group for t in own_passes(r)]
    pairs = [c / b for r in group for b, c in _pairs(r)]
    per_run: dict[str, list[float]] = {}
    for r in group if adapted else []:
        if bases.get(_run_workload(r)):
            base = statistics.median(bases[_run_workload(r)])
            per_run.setdefault(r["run"], []).extend(t / base for t in own_passes(r))
    paced = []
    if adapted and fit and first["mode"] == "prefill":  # (`all` mode decodes with the adapter: not the base's)
        at_pace = [(t, fit.base_at(run, period)) for r in group for run, t, period in _paces(r)[1]]
        paced = [t / base for t, base in at_pace if base]
    if first["engine"] == "preft":
        ratio = _median([x for v in per_run.values() for x in v]) if adapted else 1.0
        prompt_only = _median([r.get("prompt_only_ratio_to_engine_base") for r in group])
    else:
        ratio = _median([r.get("ratio_to_base") for r in group])
        prompt_only = _median([r.get("prompt_only_ratio_to_base") for r in group])
    return Summary(
        model=model,
        prompt_len=prompt_len,
        output_len=output_len,
        config=config,
        engine=first["engine"],
        method=first["method"],
        mode=first["mode"],
        rank=first["rank"],
        requests=statistics.mode(r["requests"] for r in group),
        code=code,
        runs=runs,
        passes=len(passes),
        tokens_per_s=round(statistics.median(passes), 1),
        ratio_to_base=round(ratio, 3) if ratio is not None else None,
        ratio_to_base_per_run={run: round(statistics.median(v), 3) for run, v in per_run.items()},
        paired_ratio=round(statistics.median(pairs), 3) if pairs else None,
        pairs=len(pairs),
        paced_ratio=round(statistics.median(paced), 3) if paced else None,
        paced_passes=len(paced),
        paced_fit_sd=round(fit.sd, 3) if paced else None,
        prompt_only_s=_median([r["prompt_only_s"] for r in group]),
        prompt_only_ratio_to_base=round(prompt_only, 3) if prompt_only is not None else None,
        ttft_p50_s=_median([r["ttft_p50_s"] for r in group]),
        ttft_p95_s=_median([r["ttft_p95_s"] for r in group]),
        adapter_first_load_s=_median([r.get("adapter_first_load_s") for r in group]),
        settings=first["summary_settings"],
    )


def markdown(rows: list[Summary]) -> str:
    """The table as docs/benchmarks.md shows it."""
    columns = (
        "model", "workload", "configuration", "tokens/s", "÷ base", "per run", "paired", "at equal pace",
        "÷ stock", "prompt-only", "TTFT p50 / p95",
    )  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    shown: set = set()
    for s in rows:
        head = (s.model, s.prompt_len, s.output_len)
        cells = [*(("", "") if head in shown else (s.model, f"{s.prompt_len}+{s.output_len}"))]
        shown.add(head)
        config = (
            s.config
            + (f", {s.requests} requests" if s.requests != 1024 else "")
            + (f" ({', '.join(r.removeprefix('gpu-table1-') for r in s.runs)})" if s.code == "earlier" else "")
        )
        per_run = " / ".join(f"{v:.2f}" for v in s.ratio_to_base_per_run.values()) if len(s.runs) > 1 else ""
        fmt = lambda v, spec=".2f": "" if v is None else format(v, spec)  # noqa: E731
        cells += [
            config,
            f"{s.tokens_per_s:,.0f}",
            fmt(s.ratio_to_base, ".3f"),
            per_run,
            fmt(s.paired_ratio, ".3f") + (f" ({s.pairs})" if s.pairs else ""),
            fmt(s.paced_ratio, ".3f") + (f" ({s.paced_passes}, ±{s.paced_fit_sd:.0%})" if s.paced_passes else ""),
            fmt(s.ratio_to_stock),
            fmt(s.prompt_only_s) + (" s" if s.prompt_only_s is not None else ""),
            f"{fmt(s.ttft_p50_s)} / {fmt(s.ttft_p95_s)} s",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[Summary], path: Path, device: str | None = None) -> None:
    """Each model and workload's ratios to the base model: bars pooled over runs, a dot per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[tuple, list[Summary]] = {}
    for s in rows:
        panels.setdefault((s.model, s.prompt_len, s.output_len), []).append(s)
    models = list(dict.fromkeys(k[0] for k in panels))
    columns = max(sum(k[0] == m for k in panels) for m in models)
    fig, axes = plt.subplots(len(models), columns, figsize=(6.2 * columns, 4.4 * len(models)), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    used = dict.fromkeys(models, 0)  # panels placed in each model's row
    for (model, p_len, o_len), group in panels.items():
        ax = axes[models.index(model)][used[model]]
        used[model] += 1
        ax.set_visible(True)
        values = [s.ratio_to_base or 0.0 for s in group]
        colors = ["#888888" if s.engine != "preft" else "#4a7ebb" if s.code == "current" else "#a9c1e0" for s in group]
        ax.bar(range(len(group)), values, color=colors)
        for i, s in enumerate(group):
            runs = list(s.ratio_to_base_per_run.values())
            if len(runs) > 1:
                ax.plot([i] * len(runs), runs, "o", color="black", markersize=3)
            if s.paced_ratio is not None:
                ax.plot([i], [s.paced_ratio], "x", color="#c0504d", markersize=6)
            label = "n/a" if s.ratio_to_base is None else f"{values[i]:.2f}"  # no base model in its run
            ax.text(i, values[i], label, ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.axhline(TARGET, color="#c0504d", linestyle=":", linewidth=1)
        labels = [s.config + ("*" if s.code == "earlier" else "") for s in group]
        ax.set_xticks(range(len(group)), labels, rotation=40, ha="right", fontsize=7)
        ax.set_ylabel("÷ base (PreFT rows: their engine's base requests)", fontsize=7)
        ax.set_title(f"{model}, {p_len}+{o_len}", fontsize=9)
    fig.suptitle(
        f"{device or 'Device not recorded'}. Pooled over runs (dots: each run; red x: at equal host pace); dotted: "
        "the 0.9 target; * and pale: measured on earlier code",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--current", type=Path, nargs="+", required=True, help="bench_table1 reports of today's code")
    ap.add_argument("--earlier", type=Path, nargs="*", default=[], help="reports for configurations not in those")
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.png")
    ap.add_argument("--device", default=None, help="the device of reports that do not record one (the oldest: H200)")
    args = ap.parse_args()
    try:
        current, earlier = _rows(args.current, args.device), _rows(args.earlier, args.device)
        device = one_device(current + earlier)
    except ValueError as e:
        raise SystemExit(f"table1_summary: {e}") from None
    rows = summarize(current, earlier)
    report = {
        "settings": {
            "current": [str(p) for p in args.current],
            "earlier": [str(p) for p in args.earlier],
            "device": device,
        },
        "results": [asdict(s) for s in rows],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    plot(rows, args.out.with_suffix(".png"), device)
    print(markdown(rows))
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
