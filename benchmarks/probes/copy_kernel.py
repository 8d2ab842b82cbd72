"""Probe: the compaction copy kernel's launch shape (words each thread holds in flight, threads a block of
work) against torch's gather and scatter and the device's ``copy_``, all timed in one rotation; and the
default kernel alone, without the move list's trip to the device, to show what that trip costs.

The shape of benchmarks/compact_copy.py (64 ranges of 48 pages of 2 MiB, 32 KiB blocks, 576 blocks moved
from the sparse pages into the holes of the others) in one plain device allocation. Each kernel's result is
checked byte for byte against torch's indexed copy first.

    python3 -m benchmarks.probes.copy_kernel     # on a GPU machine; prints one JSON line per way
"""

from __future__ import annotations

import json
import statistics

import torch

from benchmarks.compact_copy import _interleaved
from benchmarks.probes.batched_copy import BLOCK, BPP, PAGES, RANGES, moves
from kvcached_core.allocator.compact import gather_scatter
from kvcached_core.backends.cuda_copy import _build, fits

SHAPES = [(unroll, threads) for unroll in (1, 4) for threads in (128, 256, 512)]
REPS = 15


def main() -> None:
    plan = moves()
    rows = torch.empty(RANGES, PAGES, BPP, BLOCK, dtype=torch.uint8, device="cuda")
    rows.view(torch.int64).random_()
    assert fits(rows, plan)
    expected = rows.clone()
    gather_scatter(expected, plan)
    kernels = {f"kernel unroll={u} threads={t}": _build(0, u, t) for u, t in SHAPES}
    start = rows.clone()
    for name, k in kernels.items():
        rows.copy_(start)
        k.move(rows, plan)
        torch.cuda.synchronize()
        if not torch.equal(rows, expected):
            raise SystemExit(f"{name}: wrong bytes")
    del start, expected
    ref_src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    ref_dst = torch.empty_like(ref_src)
    ways = {"copy_": lambda: ref_dst.copy_(ref_src), "gather_scatter": lambda: gather_scatter(rows, plan)}
    ways |= {name: (lambda k=k: k.move(rows, plan)) for name, k in kernels.items()}
    pairs = torch.tensor(plan, dtype=torch.long, device="cuda").flatten()
    chosen = _build(0)
    ways["kernel alone (move list already on the device), the default shape"] = lambda: chosen.launch(rows, pairs)
    times = _interleaved(ways, torch, REPS)
    moved = len(plan) * BLOCK * RANGES
    ref = (2 << 30) / statistics.median(times["copy_"]) / 1e9
    print(json.dumps({"gpu": torch.cuda.get_device_name(0), "copy_gbps": round(ref, 1), "moved_bytes": moved}))
    for name, runs in times.items():
        if name == "copy_":
            continue
        rates = [moved / t / 1e9 for t in runs]
        mid = statistics.median(rates)
        print(json.dumps({"way": name, "gbps": round(mid, 1), "of_copy": round(mid / ref, 3),
                          "runs_gbps": [round(r, 1) for r in rates]}))


if __name__ == "__main__":
    main()
