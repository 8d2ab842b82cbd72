"""BENCHMARKS.md's headline table: each figure next to a peer that does the same work the same way.

Like for like: Python against Python, C against a C program making the same calls, one
machine and one run per pair. A pair names two rows of a benchmark module (the rows keep
their full names and notes further down the file); ``headline`` reads them from the rows of a
run, so the table is never typed by hand. ``tests/test_docs_benchmarks.py`` rebuilds it from the
detail tables of BENCHMARKS.md and compares.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

Figures = dict[tuple[str, str], tuple[float, str]]  # (module, row name) -> (value, unit)

FRAG = re.compile(r"fragmentation \[(?P<workload>.*)\] (?P<policy>.*): idle pinned / packed floor")
FRAG_OURS, FRAG_PEER = "affinity + idle packing (default)", "best-fit + page-aware (upstream)"


@dataclass(frozen=True)
class Pair:
    what: str
    module: str
    ours: str  # row name
    peer: str  # row name
    ours_label: str
    peer_label: str
    alike: str  # why the two are comparable


PAIRS = (
    Pair("publish one state change", "publish",
         "publish per state change: ours (seqlock, no syscall)",
         "publish per state change: upstream-style (open/flock/mmap/write/close)",
         "seqlock, no system call", "open, flock, mmap, write, close (upstream's way)",
         "both in Python, one process, back to back"),
    Pair("publish p99 while 3 processes read the segment", "publish",
         "publish p99 with readers hammering: ours", "publish p99 with readers hammering: upstream-style",
         "seqlock: readers never lock", "flock: readers take a shared lock",
         "both in Python, the same readers"),
    Pair("alloc(16) + free, Python", "hotpath",
         "alloc(16)+free pair: ours, affinity, Python path (KVCACHED_FASTPATH=0)",
         "alloc(16)+free pair: upstream-style: best-fit + flock publish per op",
         "affinity placement, seqlock publish", "best-fit placement, flock publish per call",
         "both in Python (no C path on either side), warm pool"),
    Pair("alloc(16), C path", "hotpath", "alloc(16) alone: C path (default)", "alloc(16) alone: Python path",
         "the C path (fastpath.c)", "the same allocator in Python",
         "the same blocks and segment bytes (tests/test_fastpath.py)"),
    Pair("limit applied, from request to publish", "acks",
         "limit applied: ours (allocator published it)", "limit applied: upstream-style (flock write, watcher polls)",
         "control block, acknowledged", "flock write, never acknowledged",
         "both in Python, watchers at the same poll interval"),
)

# Recorded on an H200 by benchmarks/vmm.py: the backend against a C program making the same driver calls.
DEVICE = (("layer", 1, "grow_cold", "grow one page id, layer layout (64 handles)"),
          ("page", 4, "grow_cold", "grow one page id, page layout (1 handle, 4 per call)"))


def _value(value: float, unit: str) -> str:
    text = f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return f"{text} {unit}"


def _row(what: str, ours: str, peer: str, ratio: float, alike: str) -> str:
    shown = f"{ratio:.2f}" if ratio >= 0.1 else f"{ratio:.2g}"
    return f"| {what} | {ours} | {peer} | {shown} | {alike} |"


def headline(figures: Figures, results: Path | None = None) -> list[str]:
    """The markdown lines of the headline table (and a line per pair a run lacks)."""
    lines = ["| what | ours | peer | ours ÷ peer | alike because |", "|---|---|---|---|---|"]
    missing = []
    for p in PAIRS:
        a, b = figures.get((p.module, p.ours)), figures.get((p.module, p.peer))
        if a is None or b is None or a[1] != b[1] or not b[0]:
            missing.append(p.what)
            continue
        lines.append(_row(p.what, f"{_value(*a)} ({p.ours_label})", f"{_value(*b)} ({p.peer_label})",
                          a[0] / b[0], p.alike))
    frag: dict[str, dict[str, float]] = {}
    for (module, name), (value, _unit) in figures.items():
        match = FRAG.fullmatch(name) if module == "fragmentation" else None
        if match:
            frag.setdefault(match["policy"], {})[match["workload"]] = round(value, 2)
    ours, peer = frag.get(FRAG_OURS, {}), frag.get(FRAG_PEER, {})
    common = sorted(set(ours) & set(peer))
    if common:
        a_med = statistics.median(ours[w] for w in common)
        b_med = statistics.median(peer[w] for w in common)
        lines.append(_row(f"idle model: pinned pages ÷ packed floor, median of {len(common)} workloads",
                          f"{a_med:.2f}x (affinity + idle packing)", f"{b_med:.2f}x (best-fit + page-aware, upstream's)",
                          a_med / b_med, "the same traffic, both in Python; 1.00x is no waste"))
    else:
        missing.append("fragmentation")
    lines += _device_rows(results)
    out = [*lines, ""]
    if missing:
        out += [f"Not in this run: {', '.join(missing)}.", ""]
    return out


def _device_rows(results: Path | None) -> list[str]:
    path = (results or Path(__file__).resolve().parent / "results") / "vmm-h200.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    env = data.get("environment", {})
    rows = []
    for layout, batch, op, what in DEVICE:
        for c in data.get("compare", []):
            if (c.get("layout"), c.get("batch"), c.get("op")) == (layout, batch, op) and c.get("backend_us"):
                rows.append(_row(
                    f"{what} on {env.get('gpu', 'a GPU')} ({env.get('date', '?')}, `benchmarks/results/{path.name}`)",
                    f"{_value(c['backend_us'], 'µs')} (the backend, its C loop)",
                    f"{_value(c['native_us'], 'µs')} (a C program, the same driver calls)",
                    c["backend_ratio"], "the same calls in the same order, turn about in one process "
                    "(ratio: median of per-round ratios)"))
    return rows
