"""``alloc`` in a tight loop, nothing between calls: the allocator's own cost on a machine.

Host backend (runs anywhere): 65,536 blocks of 16 KiB on 256 KiB pages, 20,000 allocs of 1-16
blocks in turn, the oldest of 200 held freed after each. Runs the C path and the Python path
(``KVCACHED_FASTPATH=0``), each once warm and once after ``gc.freeze()``.
``PYTHONPATH=. python3 benchmarks/probes/tight_alloc.py``; results: benchmarks/results/vmm-h200.md.
"""

from __future__ import annotations

import gc
import os
import tempfile
import time

os.environ.setdefault("KVCACHED_SHM_DIR", tempfile.mkdtemp())

from kvcached_core import KVCacheManager


def run(m: KVCacheManager) -> tuple[float, float]:
    lat: list[int] = []
    held: list[list[int]] = []
    for i in range(20_000):
        t0 = time.perf_counter_ns()
        ids = m.alloc(1 + i % 16)
        lat.append(time.perf_counter_ns() - t0)
        held.append(ids)
        if len(held) > 200:
            m.free(held.pop(0))
    for ids in held:
        m.free(ids)
    lat.sort()
    return lat[len(lat) // 2] / 1e3, lat[int(len(lat) * 0.99)] / 1e3


def main() -> None:
    for mode, label in (("auto", "C path"), ("0", "Python path")):
        os.environ["KVCACHED_FASTPATH"] = mode
        m = KVCacheManager(f"tight-{mode}", num_blocks=65536, block_bytes=16 * 1024, num_layers=1,
                           page_size=256 * 1024)
        try:
            for _ in range(200):
                m.free(m.alloc(16))
            print(f"{label} ({'C' if m._fast is not None else m.fastpath_reason}): warm p50 %.2f p99 %.2f us"
                  % run(m), flush=True)
            gc.collect()
            gc.freeze()
            print(f"{label}: gc-frozen p50 %.2f p99 %.2f us" % run(m), flush=True)
            gc.unfreeze()
        finally:
            m.close()


if __name__ == "__main__":
    main()
