"""Do the slow allocs after a GPU wait coincide with page faults or context switches? (GPU machine.)

getrusage(RUSAGE_THREAD) around each alloc, 1 ms of GPU work between allocs, with every page
mapped beforehand and while the pool grows. Prints the share of allocs with a minor fault, that
share among the slowest 1 %, and the p99 without them.
``PYTHONPATH=. python3 benchmarks/probes/alloc_faults.py``; results: benchmarks/results/vmm-h200.md.
"""

from __future__ import annotations

import gc
import os
import random
import resource
import sys
import tempfile
import time

os.environ.setdefault("KVCACHED_SHM_DIR", tempfile.mkdtemp())
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import vmm

from kvcached_core import KVCacheManager

SIZES = [1, 1, 2, 2, 4, 8, 16]


def share(rows: list[tuple], *keys: int) -> float:
    return sum(1 for r in rows if any(r[k] for k in keys)) / max(1, len(rows))


def run(pacer: vmm.Pacer, grow: bool) -> None:
    m = KVCacheManager(f"faults-{grow}", num_blocks=64 * 400, block_bytes=32 << 10, num_layers=32,
                       page_size=2 << 20, backend="cuda")
    if not grow:
        m.max_reserved = 10**6
        assert m.try_to_reserve(64 * 300)
    rng = random.Random(5)
    rows: list[tuple[float, int, int, int]] = []  # (µs, minor faults, involuntary, voluntary switches)
    gc.collect()
    gc.freeze()
    for _ in range(2000):
        if grow and m.pages.mapped_pages >= 160:
            break
        pacer.wait("gpu", 0.001)
        r0 = resource.getrusage(resource.RUSAGE_THREAD)
        t0 = time.perf_counter_ns()
        m.alloc(rng.choice(SIZES))
        t1 = time.perf_counter_ns()
        r1 = resource.getrusage(resource.RUSAGE_THREAD)
        rows.append(((t1 - t0) / 1e3, r1.ru_minflt - r0.ru_minflt, r1.ru_nivcsw - r0.ru_nivcsw,
                     r1.ru_nvcsw - r0.ru_nvcsw))
    gc.unfreeze()
    m.close()
    rows.sort()
    top = rows[int(0.99 * len(rows)):]
    clean = [r[0] for r in rows if not (r[1] or r[2] or r[3])]
    print(f"grow={grow} n={len(rows)} p50={rows[len(rows) // 2][0]:.2f} p99={rows[int(.99 * len(rows))][0]:.2f}")
    print(f"  allocs with a minor fault: {share(rows, 1):.3f}; among the slowest 1 %: {share(top, 1):.2f}; "
          f"with a context switch: {share(rows, 2, 3):.3f} / {share(top, 2, 3):.2f}")
    print(f"  without faults or switches: n={len(clean)} p99={clean[int(.99 * len(clean))]:.2f}")
    print("  slowest (µs, faults, switches):", [(round(r[0], 1), r[1], r[2] + r[3]) for r in rows[-8:]])


def main() -> None:
    for path in ("/proc/sys/kernel/numa_balancing", "/sys/devices/system/clocksource/clocksource0/current_clocksource"):
        try:
            with open(path) as fh:
                print(path, fh.read().strip())
        except OSError as exc:
            print(path, exc)
    pacer = vmm.Pacer()
    run(pacer, grow=False)
    run(pacer, grow=True)


if __name__ == "__main__":
    main()
