"""Do the allocator's own background threads make the engine's alloc wait? (GPU machine.)

The refill thread looks for work every ``REFILL_POLL_S`` and the process's poller every
``HEARTBEAT_INTERVAL_S`` (a variant here makes it look far more often, as the old 5 ms watcher did);
each look takes the GIL for a moment. An alloc that arrives in that moment sleeps until the GIL
comes back, and a woken thread may land on another CPU with cold caches. This probe grows a CUDA
model with 1 ms of GPU work between allocs (as ``benchmarks/vmm.py``'s grow runs) under several
settings, interleaved, and classifies every alloc: a voluntary context switch inside it (it slept),
an involuntary one, a move to another CPU since the previous alloc.

``PYTHONPATH=. python3 benchmarks/probes/background.py [--repeat N]``; results: benchmarks/results/vmm-h200.md.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import random
import resource
import statistics
import sys
import tempfile
import time

os.environ.setdefault("KVCACHED_SHM_DIR", tempfile.mkdtemp())
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import vmm

from kvcached_core import KVCacheManager
from kvcached_core.allocator import poller as poller_module
from kvcached_core.allocator import refill as refill_module

SIZES = [1, 1, 2, 2, 4, 8, 16]
LIBC = ctypes.CDLL(None, use_errno=True)
VARIANTS = {  # name: (refill poll s, watch interval s, pin the engine thread)
    "default": (None, None, False),
    "poll-5ms": (0.005, None, False),
    "watch-50ms": (None, 0.05, False),
    "both-slow": (0.005, 0.05, False),
    "pinned": (None, None, True),
}


def run(pacer: vmm.Pacer, layout: str, variant: str, seed: int) -> dict:
    poll, watch, pin = VARIANTS[variant]
    saved = refill_module.REFILL_POLL_S, poller_module.HEARTBEAT_INTERVAL_S
    if poll is not None:
        refill_module.REFILL_POLL_S = poll
    if watch is not None:  # the watcher is the process's poller: it wakes when poked and at each heartbeat
        poller_module.HEARTBEAT_INTERVAL_S = watch
    os.environ["KVCACHED_CUDA_LAYOUT"] = layout
    m = KVCacheManager(f"bg-{layout}-{variant}", num_blocks=64 * 400, block_bytes=32 << 10, num_layers=32,
                       page_size=2 << 20, backend="cuda")
    allowed = os.sched_getaffinity(0)
    if pin:
        os.sched_setaffinity(0, {max(allowed)})
    rng = random.Random(seed)
    rows: list[tuple[float, int, int, int]] = []  # µs, voluntary, involuntary switches, moved CPU
    held = []
    gc.collect()
    gc.freeze()
    cpu = LIBC.sched_getcpu()
    try:
        while m.pages.mapped_pages < 160 and len(rows) < 4000:
            pacer.wait("gpu", 0.001)
            r0 = resource.getrusage(resource.RUSAGE_THREAD)
            t0 = time.perf_counter_ns()
            held.append(m.alloc(rng.choice(SIZES)))
            t1 = time.perf_counter_ns()
            r1 = resource.getrusage(resource.RUSAGE_THREAD)
            now = LIBC.sched_getcpu()
            rows.append(((t1 - t0) / 1e3, r1.ru_nvcsw - r0.ru_nvcsw, r1.ru_nivcsw - r0.ru_nivcsw, int(now != cpu)))
            cpu = now
    finally:
        gc.unfreeze()
        if pin:
            os.sched_setaffinity(0, allowed)
        for ids in held:
            if ids:
                m.free(ids)
        m.close()
        refill_module.REFILL_POLL_S, poller_module.HEARTBEAT_INTERVAL_S = saved
    lat = [r[0] for r in rows]
    top = sorted(rows)[int(0.99 * len(rows)):]
    calm = [r[0] for r in rows if not (r[1] or r[2] or r[3])]
    return {
        "n": len(rows), "p50": vmm.pct(lat, .5), "p99": vmm.pct(lat, .99),
        "slept": sum(1 for r in rows if r[1]) / len(rows), "slept_top": sum(1 for r in top if r[1]) / len(top),
        "preempted": sum(1 for r in rows if r[2]) / len(rows),
        "moved": sum(1 for r in rows if r[3]) / len(rows), "moved_top": sum(1 for r in top if r[3]) / len(top),
        "calm_p99": vmm.pct(calm, .99) if calm else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    pacer = vmm.Pacer()
    variants = args.variants.split(",")
    results: dict[tuple[str, str], list[dict]] = {}
    for rep in range(args.repeat):
        for layout in ("layer", "page"):
            for variant in variants[rep % len(variants):] + variants[:rep % len(variants)]:
                row = run(pacer, layout, variant, seed=rep)
                results.setdefault((layout, variant), []).append(row)
                print(f"{rep} {layout:5s} {variant:11s} " + " ".join(
                    f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    print("\n| layout | variant | p50 median | p99 median | p99 runs | slept (all / slowest 1 %) "
          "| moved CPU (all / slowest 1 %) | p99 without switches or moves |")
    print("|---|---|---|---|---|---|---|---|")
    for (layout, variant), rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"| {layout} | {variant} | {med['p50']:.2f} | {med['p99']:.2f} | "
              f"{' / '.join(format(r['p99'], '.1f') for r in rows)} | {med['slept']:.3f} / {med['slept_top']:.2f} | "
              f"{med['moved']:.3f} / {med['moved_top']:.2f} | {med['calm_p99']:.2f} |")


if __name__ == "__main__":
    main()
