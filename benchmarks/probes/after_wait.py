"""Is the slowness right after a wait the allocator's or the machine's? (GPU machine.)

Times an alloc (C path, every page mapped beforehand) and a plain-Python workload of ~1.3 µs,
each right after a 1 ms wait (GPU work + synchronize, or a Python spin) and once more straight
after, and with no wait. Run from the checkout: ``PYTHONPATH=. python3 benchmarks/probes/after_wait.py``.
Results: benchmarks/results/vmm-h200.md.
"""

from __future__ import annotations

import gc
import os
import random
import sys
import tempfile
import time

os.environ.setdefault("KVCACHED_SHM_DIR", tempfile.mkdtemp())
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import vmm

from kvcached_core import KVCacheManager

DATA = {i: [i] * 4 for i in range(64)}
SIZES = [1, 1, 2, 2, 4, 8, 16]


def workload(n: int) -> list[int]:
    """A couple of µs of dict and list work, nothing of ours."""
    return [DATA[i & 63][0] + i for i in range(n + 12)]


def wait(mode: str, pacer: vmm.Pacer) -> None:
    if mode == "gpu":
        pacer.wait("gpu", 0.001)
    elif mode == "spin-py":
        end = time.perf_counter() + 0.001
        while time.perf_counter() < end:
            pass


def report(label: str, xs: list[float]) -> None:
    print(f"{label:48s} p50 {vmm.pct(xs, .5):6.2f} p90 {vmm.pct(xs, .9):6.2f} p99 {vmm.pct(xs, .99):6.2f} us", flush=True)


def timed(fn, n: int) -> float:
    t0 = time.perf_counter_ns()
    fn(n)
    return (time.perf_counter_ns() - t0) / 1e3


def main() -> None:
    pacer = vmm.Pacer()
    m = KVCacheManager("after-wait", num_blocks=64 * 400, block_bytes=32 << 10, num_layers=32, page_size=2 << 20,
                       backend="cuda")
    m.max_reserved = 10**6  # freed pages stay mapped: no growth, no unmapping
    assert m.try_to_reserve(64 * 300)
    rng = random.Random(3)
    held: list[list[int]] = []

    def alloc(n: int) -> None:
        held.append(m.alloc(n))
        if len(held) > 400:
            m.free(held.pop(0))

    gc.collect()
    gc.freeze()
    for mode in ("gpu", "spin-py", "none"):
        rows: dict[str, list[float]] = {k: [] for k in ("alloc1", "alloc2", "work1", "work2")}
        for _ in range(2000):
            n = rng.choice(SIZES)
            wait(mode, pacer)
            rows["alloc1"].append(timed(alloc, n))
            rows["alloc2"].append(timed(alloc, n))
            wait(mode, pacer)
            rows["work1"].append(timed(workload, n))
            rows["work2"].append(timed(workload, n))
        report(f"{mode}: alloc right after the wait", rows["alloc1"])
        report(f"{mode}: the alloc after that", rows["alloc2"])
        report(f"{mode}: plain-Python workload after the wait", rows["work1"])
        report(f"{mode}: the same workload again", rows["work2"])
    gc.unfreeze()
    for ids in held:
        m.free(ids)
    m.close()


if __name__ == "__main__":
    main()
