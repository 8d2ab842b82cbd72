"""Fragmentation: what an idle model still pins after decode-heavy traffic, per placement policy.

The engine model and its workloads' shape are ``tests/fragmentation_workload.py`` (the harness
``tests/test_fragmentation.py`` checks the default policy's target on); this runs it on every
workload below under each policy and reports them side by side, with the alloc cost (the only
timing: the counts are deterministic for a workload's seed).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import private_segments  # noqa: E402
from tests.fragmentation_workload import Workload, run_workload  # noqa: E402

KiB = 1024
POLICY_ORDER = ("first-fit", "best-fit", "affinity")
POLICY_LABELS = {"first-fit": "first-fit + LRU (naive)", "best-fit": "best-fit + page-aware (upstream)",
                 "affinity": "affinity + idle packing (default)"}


# Workloads the default policy was developed against (its parameters were chosen on these) ...
TUNING = (
    Workload("base"),
    Workload("seed 7, 64 running", seed=7, concurrency=64),
    Workload("seed 11, long decode", seed=11, decode_tokens=480, suffix_tokens=120),
    Workload("seed 13, 4k-token cache", seed=13, cache_tokens=4000),
    Workload("seed 17, 64 blocks/page", seed=17, page_size=1024 * KiB),
    Workload("seed 19, 8 running", seed=19, concurrency=8, requests=400, after_idle=32),
    Workload("seed 23, Poisson arrivals", seed=23, arrival_gap=120, requests=1500, after_idle=64),
    Workload("seed 29, Poisson, busier", seed=29, arrival_gap=40, requests=1500, after_idle=64),
    Workload("seed 31, Poisson, 64 blocks/page", seed=31, arrival_gap=120, requests=1500, after_idle=64,
             page_size=1024 * KiB),
)
# ... and workloads it was never tuned on (new seeds, other shapes): the table shows these.
HELD_OUT = (
    Workload("seed 101, 128 running", seed=101, concurrency=128),
    Workload("seed 102, 32k-token cache, 128 prefixes", seed=102, cache_tokens=32000, prefixes=128),
    Workload("seed 103, 8k cache, skewed, 30% follow-ups", seed=103, cache_tokens=8000, followup=0.3, zipf=1.3),
    Workload("seed 104, 32 blocks/page, long decode, no follow-ups", seed=104, page_size=512 * KiB,
             decode_tokens=300, followup=0.0),
    Workload("seed 105, 32 running, 16 prefixes, long prompts", seed=105, concurrency=32, prefixes=16,
             suffix_tokens=600),
    Workload("seed 106, Poisson, 64 blocks/page of 32 KiB", seed=106, arrival_gap=60, requests=1500,
             after_idle=64, page_size=2048 * KiB, block_bytes=32 * KiB),
    Workload("seed 107, wide length spread, 90% shared", seed=107, sigma=1.4, shared=0.9),
    Workload("seed 108, 200 running, 24k cache, 64 blocks/page", seed=108, concurrency=200, requests=1600,
             cache_tokens=24000, page_size=1024 * KiB),
)
QUICK = (TUNING[0], HELD_OUT[0], HELD_OUT[3], HELD_OUT[5])


def run(quick: bool) -> list[dict]:
    """One row per workload and policy; ``report`` turns them into the side-by-side table."""
    with private_segments():
        return _rows(quick)


def _rows(quick: bool) -> list[dict]:
    rows: list[dict] = []
    for wl in QUICK if quick else (TUNING[0], *HELD_OUT):
        tuned = wl in TUNING
        if quick:
            wl = replace(wl, requests=max(wl.concurrency * 4, wl.requests // 3), after_idle=min(wl.after_idle, 96))
        results = {policy: run_workload(wl, policy) for policy in POLICY_ORDER}
        compacted = {policy: run_workload(wl, policy, compaction=True) for policy in POLICY_ORDER}
        upstream = results["best-fit"]
        for policy, r in compacted.items():
            plain = results[policy]
            rows.append({
                "name": f"fragmentation [{wl.label}] {POLICY_LABELS[policy]} + compaction: idle pinned / packed floor",
                "value": round(r.ratio, 3), "unit": "x",
                "note": (f"pinned {r.idle_pinned} / floor {r.idle_floor} pages, {r.idle_cached} of {r.cache_budget} "
                         f"cached blocks kept ({r.cache_kept:.0%}; {plain.idle_cached} without compaction); "
                         f"prefix hits after idle {r.hits_after_idle} ({plain.hits_after_idle} without); "
                         f"{r.blocks_moved} blocks moved, {r.copied_bytes / 2**20:.1f} MiB copied in "
                         f"{r.copy_s * 1000:.1f} ms ({r.compact_s * 1000:.1f} ms in compaction)"),
                "workload": wl.label, "tuned": tuned, "policy": policy, "compaction": True,
                "pinned": r.idle_pinned, "floor": r.idle_floor, "cached": r.idle_cached, "budget": r.cache_budget,
                "kept": round(r.cache_kept, 4), "kept_without": plain.idle_cached,
                "hits_after_idle": r.hits_after_idle, "hits_after_idle_without": plain.hits_after_idle,
                "compactions": r.compactions, "blocks_moved": r.blocks_moved, "copied_bytes": r.copied_bytes,
                "copy_ms": round(r.copy_s * 1000, 2), "compact_ms": round(r.compact_s * 1000, 2),
            })
        for policy, r in results.items():
            rows.append({
                "name": f"fragmentation [{wl.label}] {POLICY_LABELS[policy]}: idle pinned / packed floor",
                "value": round(r.ratio, 3), "unit": "x",
                "note": (f"pinned {r.idle_pinned} / floor {r.idle_floor} pages, {r.idle_cached} cached blocks kept; "
                         f"prefix hits {r.hits} blocks ({r.hits / upstream.hits:.3f}x upstream-style); "
                         f"alloc p50 {r.alloc_us_median:.1f} µs"),
                "workload": wl.label, "tuned": tuned, "policy": policy, "pinned": r.idle_pinned,
                "floor": r.idle_floor, "cached": r.idle_cached, "hits": r.hits, "hits_after_idle": r.hits_after_idle,
                "hits_vs_upstream": round(r.hits / upstream.hits, 4), "peak_pages": r.peak_pages,
                "alloc_p50_us": round(r.alloc_us_median, 2), "alloc_p99_us": round(r.alloc_us_p99, 1),
                "returned_mib": round(r.idle_returned_bytes / 2**20, 1),
            })
    return rows


def report(rows: list[dict]) -> str:
    """Markdown: the policies side by side per workload, and whether the default meets the target."""
    lines = [
        "| workload | policy | idle pinned | packed floor | pinned / floor | cached kept | prefix hits "
        "| vs upstream-style | peak pages | alloc p50 µs | alloc p99 µs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    met = []
    compaction = [row for row in rows if row.get("compaction")]
    rows = [row for row in rows if not row.get("compaction")]
    for row in rows:
        tag = " (tuned on)" if row["tuned"] else ""
        lines.append(
            f"| {row['workload']}{tag} | {POLICY_LABELS[row['policy']]} | {row['pinned']} | {row['floor']} "
            f"| {row['value']:.2f}x | {row['cached']} | {row['hits']} | {row['hits_vs_upstream']:.3f}x "
            f"| {row['peak_pages']} | {row['alloc_p50_us']:.1f} | {row['alloc_p99_us']:.0f} |")
        if row["policy"] == "affinity":
            met.append(row["value"] <= 1.10 and row["hits_vs_upstream"] >= 1.0)
    lines.append("")
    lines.append("Idle pinned: pages with a used block once the traffic drained (read from the segment, as "
                 "`kvctl frag` does); packed floor: ceil(used blocks / blocks per page); cached kept: cached blocks "
                 "still held then; prefix hits: blocks found in the prefix cache over the whole run, including a "
                 "burst after the idle phase; peak pages: most pages in use during the traffic; alloc: one "
                 "`alloc` call (the refill thread is off here for determinism, so p99 includes pool misses "
                 "that map on the caller's thread). Workloads marked \"tuned on\" were used to choose the default "
                 "policy's parameters; the others were not.")
    lines.append("")
    lines.append(f"Target (default policy pins at most 1.10x its packed floor once idle, with no fewer prefix-cache "
                 f"hits than the upstream-style policy): met on {sum(met)} of {len(met)} workloads.")
    if compaction:
        lines += ["", *compaction_report(compaction)]
    return "\n".join(lines)


def compaction_report(rows: list[dict]) -> list[str]:
    """The same workloads with an engine that can move its blocks (a compact handler, host memmove)."""
    lines = [
        "With compaction (the engine registers a compact handler; `affinity`'s idle packing compacts before it "
        "evicts, the other policies are compacted once idle as `kvctl compact` would):",
        "",
        "| workload | policy | idle pinned | packed floor | pinned / floor | cached kept / budget | kept without "
        "| hits after idle (without) | blocks moved | copied MiB | copy ms | compaction ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    met = []
    for row in rows:
        tag = " (tuned on)" if row["tuned"] else ""
        lines.append(
            f"| {row['workload']}{tag} | {POLICY_LABELS[row['policy']]} | {row['pinned']} | {row['floor']} "
            f"| {row['value']:.2f}x | {row['cached']} / {row['budget']} ({row['kept']:.0%}) | {row['kept_without']} "
            f"| {row['hits_after_idle']} ({row['hits_after_idle_without']}) | {row['blocks_moved']} "
            f"| {row['copied_bytes'] / 2**20:.1f} | {row['copy_ms']:.1f} | {row['compact_ms']:.1f} |")
        if row["policy"] == "affinity":
            met.append(row["value"] <= 1.10 and row["kept"] >= 0.90)
    lines += [
        "",
        "Cached kept / budget: cached blocks held once idle, of the cache budget (`KVCACHED_MAX_CACHED_TOKENS` in "
        "blocks); kept without: the same run without compaction; hits after idle: prefix-cache hits in the burst "
        "after the idle phase; copy ms: time in the engine's memmove of the KV bytes (one layer here); compaction "
        "ms: the whole compactions (plan, copy, bookkeeping, unmapping), all on the host backend of this machine.",
        "",
        f"Target (issue 20: the default policy with compaction pins at most 1.10x its packed floor once idle AND keeps "
        f"at least 90 % of the cache budget): met on {sum(met)} of {len(met)} workloads.",
    ]
    return lines


