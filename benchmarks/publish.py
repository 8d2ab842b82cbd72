"""Publish cost per state change: our seqlocked segment next to upstream's flock-per-publish path.

* ours: ``KVCacheManager._publish`` on a real allocator with one dirty page, as every alloc
  and free does: seqlock odd, the page entry, the counters and their checksum, seqlock even.
  No syscall.
* upstream-style: what upstream kvcached does on every state change (see ``_common``): open
  the 24-byte file, flock it, mmap, read-modify-write, unmap, unlock, close.

Then the writer's publish time while reader processes hammer the same file as fast as they
can (ours: ``read_segment`` with the page map, lock-free; upstream-style: shared flock and
read, as upstream's kvtop and limit watcher do) against the same writer alone: p50, p99,
p99.9. Readers never make our writer wait; a reader holding upstream's shared lock does.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ._common import legacy_create, legacy_publish, private_segments, spawn, stop, summary_us

READERS = 3

OUR_READER = """
from pathlib import Path
from kvcached_core.segment.reader import read_segment
print("READY", flush=True)
while True:
    try:
        read_segment(PATH, with_pages=True)
    except (BlockingIOError, FileNotFoundError):
        pass
"""

UPSTREAM_READER = """
from pathlib import Path
from benchmarks._common import legacy_read
print("READY", flush=True)
while True:
    legacy_read(PATH)
"""


def _allocator():  # noqa: ANN202
    from kvcached_core.allocator.manager import KVCacheManager

    m = KVCacheManager("bench-publish", num_blocks=4096, block_bytes=32 * 1024, num_layers=1,
                       page_size=2 * 1024 * 1024)
    m.free(m.alloc(8))  # map a page so the published entry is a real one
    return m


def _time_ours(m, count: int) -> list[int]:  # noqa: ANN001
    samples = []
    clock = time.perf_counter_ns
    with m._lock:  # as in alloc/free: the publish runs under the allocator's lock
        for i in range(count):
            m._dirty.add(i & 7)
            t0 = clock()
            m._publish()
            samples.append(clock() - t0)
    return samples


def _time_upstream(path: Path, count: int) -> list[int]:
    samples = []
    clock = time.perf_counter_ns
    for i in range(count):
        t0 = clock()
        legacy_publish(path, i * 4096, 8192)
        samples.append(clock() - t0)
    return samples


def _with_readers(code: str, path: Path, measure):  # noqa: ANN001, ANN202
    readers = [spawn(code.replace("PATH", f"Path({str(path)!r})")) for _ in range(READERS)]
    try:
        time.sleep(0.2)  # let every reader get going
        return measure()
    finally:
        for proc in readers:
            stop(proc)


def run(quick: bool) -> list[dict]:
    count = 20_000 if quick else 200_000
    loaded = 5_000 if quick else 50_000
    rows: list[dict] = []
    with private_segments(KVCACHED_MIN_RESERVED_PAGES="1") as directory:
        m = _allocator()
        legacy = directory / "kvcached_bench_0"
        legacy_create(legacy, 1 << 40)
        try:
            ours = summary_us(_time_ours(m, count))
            upstream = summary_us(_time_upstream(legacy, count))
            cpus = os.cpu_count() or 1
            note = f"{count} publishes each, one after the other in one process; timer overhead included"
            rows.append({"name": "publish per state change: ours (seqlock, no syscall)", "value": round(ours["p50"], 2),
                         "unit": "µs p50", "note": f"p99 {ours['p99']:.2f} µs; " + note})
            rows.append({"name": "publish per state change: upstream-style (open/flock/mmap/write/close)",
                         "value": round(upstream["p50"], 2), "unit": "µs p50",
                         "note": f"p99 {upstream['p99']:.2f} µs; " + note})
            rows.append({"name": "publish: upstream-style / ours", "value": round(upstream["p50"] / ours["p50"], 1),
                         "unit": "x", "note": "ratio of the medians above"})

            seg_path = Path(m.segment.path)
            ours_alone = summary_us(_time_ours(m, loaded))
            ours_loaded = _with_readers(OUR_READER, seg_path, lambda: summary_us(_time_ours(m, loaded)))
            up_alone = summary_us(_time_upstream(legacy, loaded))
            up_loaded = _with_readers(UPSTREAM_READER, legacy, lambda: summary_us(_time_upstream(legacy, loaded)))
            share = f"{READERS} reader processes on {cpus} CPUs"
            for label, alone, loaded_stats in (("ours", ours_alone, ours_loaded),
                                               ("upstream-style", up_alone, up_loaded)):
                for q in ("p50", "p99", "p99.9"):
                    rows.append({
                        "name": f"publish {q} with readers hammering: {label}",
                        "value": round(loaded_stats[q], 2), "unit": "µs",
                        "note": f"{share}; the same writer alone: {alone[q]:.2f} µs; "
                                f"max with readers {loaded_stats['max']:.0f} µs",
                    })
        finally:
            m.close()
    return rows


if __name__ == "__main__":
    for row in run(quick=True):
        print(f"{row['name']}: {row['value']} {row['unit']}  ({row['note']})")
