"""The report of a comparison: ratios pair by pair (median and range), every run listed with its counters beside
it (warm-ups included, marked as not counted), written as JSON and markdown, and its picture."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .._common import pair_ratios

NA = "n/a"


def ratios(runs: list[dict]) -> dict:
    """p99 and mean TTFT static/elastic and throughput elastic/static per pair (above 1: elastic better), their
    median and range; warm-ups are left out."""
    counted = sorted((r for r in runs if r["counted"]), key=lambda r: (r["pair"], r["configuration"] != "static"))
    return pair_ratios(counted)


def _mib(value: float | None) -> str:
    return NA if value is None else f"{value / (1 << 20):.1f}"


def _n(value: object) -> str:
    if value is None:
        return NA
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items()) or "0"
    return f"{value:g}" if isinstance(value, float) else str(value)


def run_line(run: dict) -> str:
    """One run's row: what it served and the counters that explain it."""
    kind = "warm-up (not counted)" if run["kind"] == "warm-up" else f"pair {run['pair']}"
    given = NA if run.get("gave_count") is None else f"{_mib(run['gave_bytes'])} ({run['gave_count']})"
    taken = NA if run.get("took_count") is None else f"{_mib(run['took_bytes'])} ({run['took_count']})"
    return (f"| {run['run']} | {kind} | {run['configuration']} | {run['answered']}/{run['requests']} | "
            f"{run['ttft_p99_s']:.3f} | {run['ttft_mean_s']:.3f} | {run['tokens_per_s']:.1f} | "
            f"{_n(run.get('requests_per_step'))} | {_n(run.get('waiting_steps'))} | {_n(run.get('refused'))} | "
            f"{_mib(run.get('unused_bytes_peak'))} / {_mib(run.get('unused_bytes_mean'))} | "
            f"{_mib(run.get('pooled_bytes'))} | {_n(run.get('offload_rounds'))} | {_n(run.get('preemptions'))} | "
            f"{given} | {taken} |")


RUNS_HEAD = ["| run | kind | configuration | answered | TTFT p99 s | TTFT mean s | tokens/s | requests per step "
             "| steps with requests waiting | admissions refused by the budget, by gate | MiB claimed but unused, "
             "peak / mean | MiB pooled handles | offload rounds | preemptions | MiB given (times) "
             "| MiB taken (times) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


def markdown(report: dict) -> str:
    """The report as markdown: what ran, the ratios, every run in order with its counters."""
    what = "one model, elastic with one static share's budget, against static" if report.get("single") else \
        f"{report['models']} models, one KV budget"
    lines = [f"# {report['title']}: {what}, {report['shape']} ({report['device']}, {report['date'][:10]})", "",
             f"Command: `{report['command']}`. Machine: {report['machine']}. Seed {report['seed']}.", "",
             *report.get("setup_lines", []),
             f"Method: one warm-up replay per configuration (not counted), then {report['pairs']} ABBA pairs "
             f"(S E, E S, ...), every engine up throughout; {report['trace_requests']} requests a run.", "",
             f"**p99 TTFT static/elastic: median {report['ttft_p99_ratio_median']}x (range "
             f"{report['ttft_p99_ratio_min']}-{report['ttft_p99_ratio_max']}x); throughput elastic/static: median "
             f"{report['throughput_ratio_median']}x (range {report['throughput_ratio_min']}-"
             f"{report['throughput_ratio_max']}x)**", "",
             f"Counters: {report.get('counters_note', '')} {NA}: the engine does not publish it.", "",
             *RUNS_HEAD, *(run_line(r) for r in report["runs"])]
    if report.get("picture"):
        lines += ["", f"![TTFT by arrival and KV memory per model]({report['picture']})"]
    return "\n".join(lines) + "\n"


def save(report: dict, stem: Path) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))


def plot(report: dict, path: Path) -> Path | None:
    """Every counted run's TTFT by arrival (static and elastic), and each model's KV memory mapped in the first
    counted elastic run beside the static shares. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no picture: matplotlib is missing (pip install -e '.[plot]')", file=sys.stderr)
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True)
    colours = {"static": "tab:red", "elastic": "tab:blue"}
    counted = [r for r in report["runs"] if r["counted"]]
    labelled: set[str] = set()
    for run in counted:
        points = [(t, ttft) for t, _, ttft in run.get("ttft_by_arrival", ()) if ttft is not None]
        config = run["configuration"]
        p99s = ", ".join(f"{r['ttft_p99_s']:.2f}" for r in counted if r["configuration"] == config)
        label = None if config in labelled else f"{config}, every counted run (p99 {p99s} s)"
        labelled.add(config)
        top.plot([p[0] for p in points], [p[1] for p in points], ".", alpha=0.6, color=colours[config], label=label)
    top.set_yscale("log")
    top.set_ylabel("TTFT (s), by arrival")
    top.set_title(f"{report['title']}, {report['shape']} ({report['device']}): p99 TTFT static/elastic median "
                  f"{report['ttft_p99_ratio_median']}x, {report['date'][:10]}", fontsize=10)
    top.legend(loc="upper left", fontsize=8)
    elastic = next((r for r in counted if r["configuration"] == "elastic" and r["kv_samples"]), None)
    if elastic is not None:
        names = sorted({n for row in elastic["kv_samples"] for n in row if n != "t"})
        ts = [row["t"] for row in elastic["kv_samples"]]
        stacks = [[(row.get(n) or {}).get("mapped", 0) / (1 << 20) for row in elastic["kv_samples"]] for n in names]
        bottom.stackplot(ts, stacks, labels=names, alpha=0.8)
        share = report["share_bytes"] / (1 << 20)
        for k in range(1, report["models"] + 1):
            bottom.axhline(k * share, color="grey", linestyle="--", linewidth=0.8)
        bottom.set_ylim(0, report["models"] * share * 1.08)  # the whole budget in view
        bottom.legend(loc="upper left", fontsize=8)
    bottom.set_ylabel("elastic: KV MiB mapped, stacked\n(static shares dashed)")
    bottom.set_xlabel("seconds into the trace")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def replot(path: Path) -> Path | None:
    """Draw the picture of a report written here, next to it; the report and its markdown then name it."""
    report = json.loads(path.read_text())
    png = plot(report, path.with_suffix(".png"))
    if png is not None:
        save(dict(report, picture=png.name), path.with_suffix(""))
    return png
