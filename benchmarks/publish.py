"""Publish cost per state change: our seqlocked segment next to upstream's flock-per-publish path.

* ours: the allocator's publish on a real allocator with one dirty page, as every alloc and
  free does: seqlock odd, the page entry, the counters and their checksum, seqlock even. No
  syscall. Two rows each: "ours" is the Python publish (``KVCacheManager._publish_python``: the
  publish before the C path took it over, and the path without the C build; the like-for-like
  peer of upstream's Python), "ours, C path (default)" is ``_publish`` as an allocator runs it,
  the C ``publish`` of ``fastpath.c`` (the same bytes).
* upstream-style: what upstream kvcached does on every state change (see ``_common``): open
  the 24-byte file, flock it, mmap, read-modify-write, unmap, unlock, close.

Then the writer's publish time while reader processes hammer the same file as fast as they
can (ours: ``read_segment`` with the page map, lock-free; upstream-style: shared flock and
read, as upstream's kvtop and limit watcher do) against the same writer alone: p50, p99,
p99.9. Readers never make our writer wait; a reader holding upstream's shared lock does. Our
two publishes are timed turn about, in blocks, under the same readers. Goal (issue 25): p99.9
with 3 readers at 10 µs or less.
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


def _allocator():
    from kvcached_core.allocator.manager import KVCacheManager

    m = KVCacheManager("bench-publish", num_blocks=4096, block_bytes=32 * 1024, num_layers=1,
                       page_size=2 * 1024 * 1024)
    m.free(m.alloc(8))  # map a page so the published entry is a real one
    return m


def _time_ours(m, count: int, publish=None) -> list[int]:
    """``count`` publishes of one dirty page each: ``publish`` (default: the allocator's own, the C one)."""
    publish = publish or m._publish
    samples = []
    clock = time.perf_counter_ns
    with m._lock:  # as in alloc/free: the publish runs under the allocator's lock
        for i in range(count):
            m._dirty.add(i & 7)
            t0 = clock()
            publish()
            samples.append(clock() - t0)
    return samples


BLOCK = 1000  # publishes per turn when the two publishes take turns


def _time_both(m, count: int) -> tuple[list[int], list[int]]:
    """The Python publish and the allocator's own, ``count`` each, in alternating blocks (same load for both)."""
    python: list[int] = []
    default: list[int] = []
    for i in range(0, count, BLOCK):
        n = min(BLOCK, count - i)
        turns = ((m._publish_python, python), (None, default))
        for publish, samples in turns if (i // BLOCK) % 2 == 0 else turns[::-1]:
            samples.extend(_time_ours(m, n, publish))
    return python, default


def _spin(ns: float, count: int) -> list[int]:
    """``count`` busy waits of ``ns`` each, timed as a publish is: what this host does to so short a window."""
    samples = []
    clock = time.perf_counter_ns
    for _ in range(count):
        t0 = clock()
        deadline = t0 + ns
        while clock() < deadline:
            continue  # the busy wait is the measured work
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


def _with_readers(code: str, path: Path, measure):
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
            c_path = m._fast is not None
            c_label = "ours, C path (default)" if c_path else f"ours, C path unavailable ({m.fastpath_reason})"
            python_samples, default_samples = _time_both(m, count)
            ours, ours_c = summary_us(python_samples), summary_us(default_samples)
            upstream = summary_us(_time_upstream(legacy, count))
            cpus = os.cpu_count() or 1
            note = f"{count} publishes each, one after the other in one process; timer overhead included"
            rows.append({"name": "publish per state change: ours (seqlock, no syscall)", "value": round(ours["p50"], 2),
                         "unit": "µs p50", "note": f"p99 {ours['p99']:.2f} µs; Python publish; " + note})
            rows.append({"name": f"publish per state change: {c_label}", "value": round(ours_c["p50"], 2),
                         "unit": "µs p50", "note": f"p99 {ours_c['p99']:.2f} µs; taking turns with the row above; "
                                                    + note})
            rows.append({"name": "publish per state change: upstream-style (open/flock/mmap/write/close)",
                         "value": round(upstream["p50"], 2), "unit": "µs p50",
                         "note": f"p99 {upstream['p99']:.2f} µs; " + note})
            rows.append({"name": "publish: upstream-style / ours", "value": round(upstream["p50"] / ours["p50"], 1),
                         "unit": "x", "note": "ratio of the medians above (both in Python)"})

            seg_path = Path(m.segment.path)
            alone = [summary_us(s) for s in _time_both(m, loaded)]
            loaded_both = [summary_us(s) for s in _with_readers(OUR_READER, seg_path, lambda: _time_both(m, loaded))]
            up_alone = summary_us(_time_upstream(legacy, loaded))
            up_loaded = _with_readers(UPSTREAM_READER, legacy, lambda: summary_us(_time_upstream(legacy, loaded)))
            share = f"{READERS} reader processes on {cpus} CPUs"
            for label, alone_stats, loaded_stats, extra in (
                    ("ours", alone[0], loaded_both[0], "; Python publish"),
                    (c_label, alone[1], loaded_both[1], "; turn about with the Python publish"),
                    ("upstream-style", up_alone, up_loaded, "")):
                for q in ("p50", "p99", "p99.9"):
                    goal = ""
                    if q == "p99.9" and label != "upstream-style":
                        goal = "; goal <= 10 µs: " + ("met" if loaded_stats[q] <= 10 else "not met")
                    rows.append({
                        "name": f"publish {q} with readers hammering: {label}",
                        "value": round(loaded_stats[q], 2), "unit": "µs",
                        "note": f"{share}; the same writer alone: {alone_stats[q]:.2f} µs; "
                                f"max with readers {loaded_stats['max']:.0f} µs{extra}{goal}",
                    })
            # The same percentiles of a busy loop as long as the C publish's median, with no reader: a tail
            # there is the host's (interrupts, other tenants), which no publish of that length can avoid.
            floor = summary_us(_spin(alone[1]["p50"] * 1000, loaded))
            rows.append({"name": "publish p99.9 floor of this host: a busy loop as long as the C publish's p50",
                         "value": round(floor["p99.9"], 2), "unit": "µs",
                         "note": f"{loaded} loops of {alone[1]['p50']:.2f} µs, no readers; p99 {floor['p99']:.2f} µs"})
        finally:
            m.close()
    return rows


if __name__ == "__main__":
    for row in run(quick=True):
        print(f"{row['name']}: {row['value']} {row['unit']}  ({row['note']})")
