"""Run every benchmark, print one table, and write BENCHMARKS.md.

    python -m benchmarks [--quick] [--only NAME[,NAME...]] [--skip NAME[,NAME...]] [--output PATH] [--no-write]
    python -m benchmarks --copy-results     # only the "Recorded on device" copies, nothing run

Each module runs in a child process of its own (a crash, a hang or a leaked thread stays
there); a module that fails is reported in the table and the run goes on. Modules that need a
GPU are skipped without one; results recorded on a GPU machine (``benchmarks/results/*.md``)
are copied into BENCHMARKS.md under "Recorded on device". BENCHMARKS.md is written only
when every module ran (not with ``--only``), unless ``--output`` names a file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pkgutil
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import benchmarks

from ._common import ROOT, child_env, private_segments
from ._headline import headline

MARKER = "@@benchmark-result@@ "
RUNNING = [
    "## Running them", "",
    "```bash",
    "python -m benchmarks --quick     # every benchmark in under a minute; writes BENCHMARKS.md",
    "python -m benchmarks             # the full run (this file)",
    "python -m benchmarks --only publish,hotpath   # some of them (prints, writes nothing)",
    "```", "",
    "Each module of `benchmarks/` runs in a child process of its own. GPU benchmarks are skipped without a GPU; "
    "`benchmarks/vmm.py` is the GPU one (run it on a GPU machine, see its docstring), and results recorded on "
    "GPU machines (`benchmarks/results/*.md`) are copied below as they are. `benchmarks/probes/` holds one-off "
    "GPU probes that explain a figure there, which the command does not run.", "",
    "`benchmarks/multimodel.py` (static shares against one elastic budget, several engines) is its own command, "
    "never part of the suite; one method for every engine (`benchmarks/fair/`): one discarded warm-up replay per "
    "configuration, then ABBA pairs, every run listed with its counters. On a GPU (transformers 5.17 or newer; "
    "each command writes `benchmarks/results/multimodel-transformers-cuda-<shape>[-single].{json,md,png}`):", "",
    "```bash",
    "for shape in steady ramps bursty saturated; do",
    "  python -m benchmarks multimodel --engine transformers --device cuda --shape $shape --pairs 4",
    "done",
    "python -m benchmarks multimodel --engine transformers --device cuda --single --shape steady --pairs 4"
    "   # the allocator alone",
    "python -m benchmarks multimodel --engine transformers --device cpu --quick --single --shape steady "
    "--pairs 2 --duration 3 --no-write   # CPU smoke",
    ".venv-vllm/bin/python -m benchmarks multimodel --quick   # real vLLM servers on CPU, the same method",
    "```", "",
    "At operator scale (`--scale operator`: three models of the largest Llama shape whose engines of both "
    "configurations fit the GPU at once, else the largest that fits with the configurations in turn (one "
    "configuration's engines alive at a time, started outside the timed runs; the output and the report say so), "
    "or `--model`'s shape; a profiling pass measures each configuration's working-memory peak at "
    "`max_batch_tokens` with the longest prompts (`torch.cuda.max_memory_allocated`), and each static share is "
    "what is left of the free memory after every engine's weights, CUDA context and measured peak and the "
    "headroom (`KVCACHED_DEVICE_HEADROOM`), at least 4 GiB; prompts of 1k-8k tokens; the plan printed before the "
    "engines start; the peak rate set so that at the peak the KV in flight reaches two shares, steady excepted), "
    "one command per shape (each writes `benchmarks/results/multimodel-transformers-cuda-"
    "operator-<shape>.{json,md,png}`; `--screenshot PATH` adds kvtop's screen where textual is installed). The "
    "first is the headline on an H100 80 GB: 8B-shaped models, in turn, within 9 minutes:",
    "",
    "```bash",
    "python -m benchmarks multimodel --engine transformers --device cuda --scale operator --model Llama-3.1-8B "
    "--shape ramps --pairs 2 --duration 20 --time-limit 500",
    "python -m benchmarks multimodel --engine transformers --device cuda --scale operator --shape bursty --pairs "
    "4",
    "python -m benchmarks multimodel --engine transformers --device cuda --scale operator --shape saturated "
    "--pairs 4   # + one engine alone with the whole budget",
    "python -m benchmarks multimodel --engine transformers --device cuda --scale operator --shape steady --pairs "
    "4",
    "python -m benchmarks multimodel --engine transformers --device cpu --scale operator --shape saturated "
    "--pairs 1 --duration 1.5 --device-memory 256MiB --no-write   # CPU smoke",
    "```",
    "",
    "How the headline command was sized, an estimate, not a measurement (its own output will say): six engines of"
    " 8B shape (16 GB of weights each) do not fit 80 GB, so the configurations run in turn; pair 1 goes on from "
    "the elastic warm-up, so the engines are started 4 times (about 25 s each: spawn, imports, weights built on "
    "the GPU, a one-share warm-up pass) and the profiling child once (about 60 s: the model built, then two "
    "passes filling about 9 GiB of static cache and 18 GiB of elastic budget with 8k-token prompts); calibration "
    "about 20 s; then 6 runs of the 20 s trace plus about 25 s for the requests queued at the peaks (a share of "
    "about 5 GB holds about 10 requests of 3.7k tokens; an estimated 0.2 s a 2,048-token prefill step and 40 ms a"
    " decode step): about 460 s in all. `--time-limit 500` starts the second pair only if two runs as long as the"
    " longest so far (its engine start included) still fit, so a slower device ends with one pair, said in the "
    "report, rather than past 9 minutes. The other shapes' traces (ramps 30 s, bursty 25 s, saturated 12 s, "
    "steady 25 s; `--duration` changes them) are longer; every run prints its elapsed time and the report is "
    "rewritten after each, so a command stopped at its limit keeps the runs it finished. An engine that dies ends"
    " the command within seconds with its own error line, its log kept under `/tmp/kvc-tcb-logs-*`.",
    "",
]
RESULTS = Path(__file__).resolve().parent / "results"

CHILD = r"""
import importlib, json, sys, traceback
name, quick, marker = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
import benchmarks
def emit(**payload):
    sys.stdout.flush()
    print(marker + json.dumps(payload, ensure_ascii=False, default=str), flush=True)
mod = importlib.import_module("benchmarks." + name)
if not callable(getattr(mod, "run", None)):
    emit(skip="no run(quick): a standalone script, see its docstring")
    sys.exit(0)
if getattr(mod, "REQUIRES", None) == "gpu":
    from kvcached_core.backends import nvml
    if not nvml.available():
        emit(skip="needs an NVIDIA GPU: " + nvml.unavailable_reason())
        sys.exit(0)
try:
    rows = mod.run(quick)
except benchmarks.Skip as exc:
    emit(skip=str(exc))
    sys.exit(0)
report = mod.report(rows) if callable(getattr(mod, "report", None)) else None
emit(rows=rows, report=report)
"""


@dataclass
class Outcome:
    module: str
    title: str
    seconds: float
    rows: list[dict] = field(default_factory=list)
    report: str | None = None
    skipped: str | None = None
    error: str | None = None


def discover() -> list[str]:
    return sorted(info.name for info in pkgutil.iter_modules(benchmarks.__path__)
                  if not info.name.startswith("_") and not info.ispkg)


def _title(module: str) -> str:
    path = Path(benchmarks.__path__[0]) / f"{module}.py"
    try:
        source = path.read_text()
    except OSError:
        return module
    for quote in ('"""', "'''"):
        if source.lstrip().startswith(quote):
            return source.lstrip()[3:].split("\n", 1)[0].strip()
    return module


def run_module(module: str, quick: bool, timeout: float) -> Outcome:
    started = time.monotonic()
    outcome = Outcome(module, _title(module), 0.0)
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, module, "1" if quick else "0", MARKER],
                              cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        outcome.error = f"timed out after {timeout:g} s"
    else:
        payload = None
        for line in proc.stdout.splitlines():
            if line.startswith(MARKER):
                payload = json.loads(line[len(MARKER):])
        if payload is None:
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            outcome.error = (lines[-1] if lines else f"exited with status {proc.returncode} and no result")
        elif "skip" in payload:
            outcome.skipped = payload["skip"]
        else:
            outcome.rows = [dict(row) for row in payload.get("rows") or []]
            outcome.report = payload.get("report")
            bad = [r for r in outcome.rows if not {"name", "value", "unit"} <= set(r)]
            if bad:
                outcome.error = f"{len(bad)} rows lack name/value/unit"
    outcome.seconds = time.monotonic() - started
    return outcome


# -- the machine ---------------------------------------------------------------------------------
def machine() -> dict[str, str]:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    memory = ""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            kib = int(fh.readline().split()[1])
        memory = f"{kib / 2**20:.1f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu": model, "cores": str(os.cpu_count() or "?"), "memory": memory,
        "kernel": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def describe(info: dict[str, str]) -> str:
    parts = [f"{info['cpu']}, {info['cores']} cores", info["memory"], info["kernel"], f"Python {info['python']}"]
    return "; ".join(p for p in parts if p)


# -- output --------------------------------------------------------------------------------------
def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".") if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def print_table(outcomes: list[Outcome]) -> None:
    lines = []
    for o in outcomes:
        if o.error or o.skipped:
            lines.append((o.module, "ERROR" if o.error else "skipped", "", o.error or o.skipped or ""))
        for row in o.rows:
            lines.append((o.module, row["name"], f"{_fmt(row['value'])} {row['unit']}", row.get("note", "")))
    width = [min(64, max(len(line[i]) for line in lines)) for i in range(3)] if lines else [0, 0, 0]
    for module, name, value, note in lines:
        print(f"{module:<{width[0]}}  {name:<{width[1]}}  {value:>{width[2]}}  {note}")


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(outcomes: list[Outcome], info: dict[str, str], quick: bool, elapsed: float,
             skipped: tuple[str, ...] = ()) -> str:
    command = "python -m benchmarks" + (" --quick" if quick else "") + (f" --skip {','.join(skipped)}" if skipped else "")
    out = [
        "# Benchmarks",
        "",
        f"Generated by `{command}` on {info['date']} in {elapsed:.0f} s. Every figure below comes from that one "
        "run (the \"Recorded on device\" section excepted, which copies files that GPU runs left in "
        "`benchmarks/results/`); nothing here is edited by hand. Rerun the command to regenerate this file.",
        "",
        f"Machine: {describe(info)}.",
        "",
    ]
    if quick:
        out += ["Mode: `--quick` (fewer repetitions and shorter traffic; medians are less settled than a full run).", ""]
    figures = {(o.module, str(r["name"])): (float(_fmt(r["value"]).replace(",", "")), str(r["unit"]))  # as shown
               for o in outcomes for r in o.rows if isinstance(r.get("value"), (int, float))}
    out += ["## Headline", "",
            "Each figure next to a peer doing the same work the same way: Python against Python, C against a C "
            "program making the same calls (`benchmarks/_headline.py` picks the rows; the details follow). "
            "Below 1 in `ours ÷ peer`: ours takes less time.", "",
            *headline(figures, RESULTS), *RUNNING]
    out += ["## Summary", "", "| benchmark | status | seconds |", "|---|---|---|"]
    for o in outcomes:
        status = f"error: {_cell(o.error)}" if o.error else f"skipped: {_cell(o.skipped)}" if o.skipped else \
            f"{len(o.rows)} figures"
        out.append(f"| [{o.module}](#{o.module}) | {status} | {o.seconds:.1f} |")
    out.append("")
    for o in outcomes:
        out += [f"## {o.module}", "", f"{o.title} (`benchmarks/{o.module}.py`)", ""]
        if o.error:
            out += [f"Failed: {o.error}", ""]
        if o.skipped:
            out += [f"Skipped: {o.skipped}", ""]
        if o.report:
            out += [o.report, ""]
        if o.rows and not o.report:  # a module's own report already shows its figures
            out += ["| figure | value | unit | note |", "|---|---|---|---|"]
            for row in o.rows:
                out.append(f"| {_cell(row['name'])} | {_fmt(row['value'])} | {_cell(row['unit'])} "
                           f"| {_cell(row.get('note', ''))} |")
            out.append("")
    out += recorded_section()
    return "\n".join(out).rstrip() + "\n"


RECORDED = "## Recorded on device"
_LOCAL_LINK = re.compile(r"(\]\()(?![a-z][a-z0-9+.-]*:|#|/)")  # a relative link target, e.g. ](plot.png)


def recorded_section() -> list[str]:
    """The copies of ``benchmarks/results/*.md`` (headings one level deeper), as BENCHMARKS.md ends."""
    recorded = sorted(RESULTS.glob("*.md")) if RESULTS.is_dir() else []
    if not recorded:
        return []
    out = [RECORDED, "",
           "Copied from `benchmarks/results/` as the runs on other machines wrote them (each names its "
           "machine and command).", ""]
    for path in recorded:
        body = path.read_text().strip().splitlines()
        body = ["#" * 2 + line if line.startswith("#") else line for line in body]  # nest the headings
        body = [_LOCAL_LINK.sub(r"\1benchmarks/results/", line) for line in body]  # links from the repository root
        out += [f"### {path.name}", "", *body, ""]
    orphans = [p.name for p in sorted(RESULTS.glob("*.json")) if not p.with_suffix(".md").exists()]
    if orphans:
        out += ["Raw results without a write-up: " + ", ".join(f"`{n}`" for n in orphans) + ".", ""]
    return out


def copy_results(target: Path) -> None:
    """Rewrite only the "Recorded on device" copies of ``target`` (a file this command wrote): for a
    result recorded on another machine, which needs no new run here."""
    text = target.read_text()
    start = text.find("\n" + RECORDED + "\n")
    kept = text if start < 0 else text[:start + 1]
    target.write_text(kept.rstrip() + "\n\n" + "\n".join(recorded_section()).rstrip() + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["multimodel"]:  # real vLLM engines: its own command, never part of the suite
        from . import multimodel

        return multimodel.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions: the whole run in under a minute")
    parser.add_argument("--only", metavar="NAME", help="comma-separated modules to run (BENCHMARKS.md is not written)")
    parser.add_argument("--output", type=Path, help="write the markdown here (default: BENCHMARKS.md at the "
                        "repository root, only when every module ran)")
    parser.add_argument("--skip", metavar="NAME", help="comma-separated modules to leave out; BENCHMARKS.md is still "
                        "written, naming them (for a module another run is measuring on this machine)")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--timeout", type=float, help="seconds per module (default 120 quick, 1200 full)")
    parser.add_argument("--copy-results", action="store_true", help="run nothing: only copy benchmarks/results/*.md "
                        "anew into BENCHMARKS.md (or --output), after a result recorded elsewhere was added or changed")
    args = parser.parse_args(argv)
    if args.copy_results:
        target = args.output or ROOT / "BENCHMARKS.md"
        copy_results(target)
        print(f"# copied benchmarks/results into {target}", flush=True)
        return 0

    modules = discover()
    if args.only:
        wanted = [name.strip() for name in args.only.split(",") if name.strip()]
        unknown = [name for name in wanted if name not in modules]
        if unknown:
            print(f"unknown benchmark {', '.join(unknown)}: choose from {', '.join(modules)}", file=sys.stderr)
            return 2
        modules = wanted
    skipped = tuple(name.strip() for name in (args.skip or "").split(",") if name.strip())
    unknown = [name for name in skipped if name not in modules]
    if unknown:
        print(f"unknown benchmark {', '.join(unknown)}: choose from {', '.join(modules)}", file=sys.stderr)
        return 2
    timeout = args.timeout or (120.0 if args.quick else 1200.0)
    info = machine()
    print(f"# {describe(info)}; {info['date']}", flush=True)
    started = time.monotonic()
    outcomes = []
    with private_segments():  # children inherit a private KVCACHED_SHM_DIR: no stray segments
        for module in modules:
            if module in skipped:
                outcomes.append(Outcome(module, _title(module), 0.0, skipped="left out of this run (--skip)"))
                continue
            print(f"# running {module} ...", file=sys.stderr, flush=True)
            outcomes.append(run_module(module, args.quick, timeout))
    elapsed = time.monotonic() - started
    print_table(outcomes)
    print(f"# {len(modules)} benchmarks in {elapsed:.1f} s", flush=True)
    target = args.output or (None if args.only or args.no_write else ROOT / "BENCHMARKS.md")
    if target is not None and not args.no_write:
        target.write_text(markdown(outcomes, info, args.quick, elapsed, skipped))
        print(f"# wrote {target}", flush=True)
    return 1 if any(o.error for o in outcomes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
