"""The report of a comparison: ratios pair by pair (median and range), every run listed with its counters beside
it (warm-ups included, marked as not counted), written as JSON and markdown, and its picture."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from .._common import pair_ratios

NA = "n/a"


def ratios(runs: list[dict]) -> dict:
    """p99 and mean TTFT static/elastic and throughput elastic/static per pair (above 1: elastic better), their
    median and range; warm-ups are left out."""
    counted = sorted((r for r in runs if r["counted"]), key=lambda r: (r["pair"], r["configuration"] != "static"))
    return pair_ratios(counted)


def preemptions(runs: list[dict]) -> dict:
    """Per counted pair, the requests (trace indices) each configuration preempted, and the check that elastic
    preempted none that static did not preempt too: ``ok`` (None when the engine does not say which), ``line``."""
    pairs: dict[int, dict[str, list[int] | None]] = {}
    for r in runs:
        if r["counted"]:
            pairs.setdefault(r["pair"], {})[r["configuration"]] = r.get("preempted")
    extra = {p: sorted(set(c.get("elastic") or ()) - set(c.get("static") or ())) for p, c in sorted(pairs.items())}
    known = all(c.get("static") is not None and c.get("elastic") is not None for c in pairs.values())
    rounds = {c: [r.get("offload_rounds") for r in runs if r["counted"] and r["configuration"] == c]
              for c in ("static", "elastic")}
    said = "; ".join(f"{c} {', '.join(_n(x) for x in v)}" for c, v in rounds.items())
    counts = "; ".join(f"pair {p}: static {len(c.get('static') or ())}, elastic {len(c.get('elastic') or ())}"
                       for p, c in sorted(pairs.items()))
    if not pairs or not known:
        ok, verdict = None, f"{NA} (the engine does not say which requests it preempted)"
    elif any(extra.values()):
        ok = False
        verdict = "NO: " + "; ".join(f"pair {p}: elastic preempted requests {', '.join(map(str, v))} that static "
                                     "did not" for p, v in extra.items() if v)
    else:
        ok, verdict = True, "yes, in every pair"
    return {"preemption_check": ok, "preemption_extra": {str(p): v for p, v in extra.items()},
            "preemption_lines": [f"Preemptions (offload rounds) per counted run: {said}. Requests preempted: "
                                 f"{counts or NA}.", "",
                                 f"**Check: nothing preempted by elastic that static did not preempt too: "
                                 f"{verdict}.**", ""]}


def limit_of_sharing(runs: list[dict], busy: str = "m0") -> dict:
    """The busy model of elastic's pair runs against one plain engine given the whole budget (``alone``), run by
    run in order: tokens/s elastic/alone and p99 TTFT alone/elastic (1.0: sharing costs nothing), median and
    range; empty when no alone run was made."""
    elastic = [r for r in runs if r["counted"] and r["configuration"] == "elastic"]
    alone = [r for r in runs if r["configuration"] == "alone" and r["kind"] != "warm-up"]
    if not alone:
        return {}
    tok, p99 = [], []
    for e, a in zip(sorted(elastic, key=lambda r: r["pair"]), alone, strict=False):
        eb, ab = e.get("by_model", {}).get(busy), a.get("by_model", {}).get(busy)
        if eb and ab and ab["tokens_per_s"]:
            tok.append(eb["tokens_per_s"] / ab["tokens_per_s"])
        if eb and ab and eb["ttft_p99_s"]:
            p99.append(ab["ttft_p99_s"] / eb["ttft_p99_s"])

    def stats(xs: list[float]) -> str:
        return f"median {statistics.median(xs):.3f}x (range {min(xs):.3f}-{max(xs):.3f}x)" if xs else NA

    figures = "; ".join(f"run {r['run']} {r['configuration']}: {r['by_model'].get(busy, {}).get('tokens_per_s', NA)} "
                        f"tokens/s, p99 {r['by_model'].get(busy, {}).get('ttft_p99_s', NA)} s"
                        for r in [*elastic, *alone] if "by_model" in r)
    return {"alone_tokens_ratio_median": round(statistics.median(tok), 3) if tok else None,
            "alone_ttft_p99_ratio_median": round(statistics.median(p99), 3) if p99 else None,
            "alone_lines": [f"**The limit of sharing ({busy}, the busy model): tokens/s elastic/alone {stats(tok)}; "
                            f"p99 TTFT alone/elastic {stats(p99)}** (alone: one plain engine whose static cache is the "
                            f"whole budget, its runs after the pairs; run by run: {figures}).", ""]}


def _mib(value: float | None) -> str:
    return NA if value is None else f"{value / (1 << 20):.1f}"


def _n(value: object) -> str:
    if value is None:
        return NA
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items()) or "0"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _ms(seconds: float | None) -> str:
    return NA if seconds is None else f"{seconds * 1000:.2f}"


def run_line(run: dict) -> str:
    """One run's row: what it served and the counters that explain it."""
    kind = "warm-up (not counted)" if run["kind"] == "warm-up" else \
        f"alone {run['pair']} (not counted)" if run["kind"] == "alone" else f"pair {run['pair']}"
    preempted = run.get("preempted")
    given = NA if run.get("gave_count") is None else f"{_mib(run['gave_bytes'])} ({run['gave_count']})"
    taken = NA if run.get("took_count") is None else f"{_mib(run['took_bytes'])} ({run['took_count']})"
    return (f"| {run['run']} | {kind} | {run['configuration']} | {run['answered']}/{run['requests']} | "
            f"{run['ttft_p99_s']:.3f} | {run['ttft_mean_s']:.3f} | {run['tokens_per_s']:.1f} | {_ms(run.get('tpot_mean_s'))} | "
            f"{_n(run.get('requests_per_step'))} | {_n(run.get('waiting_steps'))} | {_n(run.get('refused'))} | "
            f"{_mib(run.get('unused_bytes_peak'))} / {_mib(run.get('unused_bytes_mean'))} | "
            f"{_mib(run.get('pooled_bytes'))} | {_n(run.get('offload_rounds'))} | {_n(run.get('preemptions'))} | "
            f"{given} | {taken} | {NA if preempted is None else len(preempted)} | {_n(run.get('elapsed_s'))} |")


RUNS_HEAD = ["| run | kind | configuration | answered | TTFT p99 s | TTFT mean s | tokens/s | TPOT mean ms "
             "| requests per step "
             "| steps with requests waiting | admissions refused by the budget, by gate | MiB claimed but unused, "
             "peak / mean | MiB pooled handles | offload rounds | preemptions | MiB given (times) "
             "| MiB taken (times) | requests preempted | s elapsed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


def markdown(report: dict) -> str:
    """The report as markdown: what ran, the ratios, every run in order with its counters."""
    what = "one model, elastic with one static share's budget, against static" if report.get("single") else \
        f"{report['models']} models, one KV budget"
    lines = [f"# {report['title']}: {what}, {report['shape']} ({report['device']}, {report['date'][:10]})", "",
             f"Command: `{report['command']}`. Machine: {report['machine']}. Seed {report['seed']}.", "",
             *report.get("setup_lines", []),
             f"Method: one warm-up replay per configuration (not counted), then {report['pairs']} ABBA pairs "
             f"{_order(report)}; {report['trace_requests']} requests a run.", "",
             *([f"**Time limit: {report['stopped_early']}.**", ""] if report.get("stopped_early") else []),
             f"**p99 TTFT static/elastic: median {report['ttft_p99_ratio_median']}x (range "
             f"{report['ttft_p99_ratio_min']}-{report['ttft_p99_ratio_max']}x); throughput elastic/static: median "
             f"{report['throughput_ratio_median']}x (range {report['throughput_ratio_min']}-"
             f"{report['throughput_ratio_max']}x)**", "",
             *([f"Decode time per output token (each request's mean TPOT, averaged over the run) static/elastic: "
                f"median {report['tpot_ratio_median']}x (range {report['tpot_ratio_min']}-{report['tpot_ratio_max']}x)"
                f"; above 1, elastic's requests decode faster.", ""] if "tpot_ratio_median" in report else []),
             *report.get("alone_lines", []), *report.get("preemption_lines", []),
             *report.get("screenshot_lines", []),
             f"Counters: {report.get('counters_note', '')} {NA}: the engine does not publish it.", "",
             *RUNS_HEAD, *(run_line(r) for r in report["runs"])]
    if report.get("picture"):
        lines += ["", f"![TTFT by arrival and KV memory per model]({report['picture']})"]
    return "\n".join(lines) + "\n"


def _order(report: dict) -> str:
    """The order of the runs, as the method line says it."""
    if report.get("together", True):
        return "(S E, E S, ...), every engine up throughout"
    return ("(E S, S E, ...: pair 1 goes on from the elastic warm-up), one configuration's engines up at a time, "
            "started before its runs outside the timed replays")


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
