"""The engine's hot path: one ``alloc(16)`` and its ``free`` on a warm KVCacheManager (host backend).

A 2-layer model with K and V, 2 MiB pages and 32 KiB blocks (64 blocks per page); the reserve
pool is warm, so no pair maps or unmaps anything: what is measured is placement, bookkeeping
and the publish of each state change. Rows:

* each placement policy (``affinity`` is the default) with our seqlocked publish; ``alloc`` and
  ``free`` run in C where they can (``kvcached_core/allocator/fastpath.c``), and once more in Python for comparison;
* upstream-style: the same allocator (``best-fit``, upstream's policy, Python path) with every
  publish replaced by upstream's status update (open, flock, mmap, write, close the 24-byte file);
* bookkeeping alone (Python path, publish disabled), to show what the publish costs inside the pair;
* a tensor-parallel scheduler with two host rank workers, C path and Python path: a warm pool maps
  nothing, so no rank is asked and the pair is placement plus a publish that writes the ranks' records;
* ``alloc`` alone (its ``free`` untimed), C path and Python path side by side.
"""

from __future__ import annotations

import os
import time

from ._common import legacy_create, legacy_publish, private_segments, summary_us

BLOCKS = 16


def _manager(policy: str, fastpath: bool = True, world: int = 1):
    """A warm allocator; ``world`` > 1: a tensor-parallel scheduler with that many host rank workers."""
    from kvcached_core.allocator.manager import KVCacheManager

    saved = os.environ.get("KVCACHED_FASTPATH")
    os.environ["KVCACHED_FASTPATH"] = "auto" if fastpath else "0"
    geometry = dict(num_blocks=64 * 256, block_bytes=32 * 1024, num_layers=2, page_size=2 * 1024 * 1024,
                    policy=policy)
    try:
        if world > 1:
            m = KVCacheManager.tensor_parallel(f"bench-hot-tp{world}-{policy}", world=world, **geometry)  # type: ignore[arg-type]
        else:
            m = KVCacheManager(f"bench-hot-{policy}", **geometry)  # type: ignore[arg-type]
    finally:
        if saved is None:
            del os.environ["KVCACHED_FASTPATH"]
        else:
            os.environ["KVCACHED_FASTPATH"] = saved
    deadline = time.monotonic() + 5
    m.free(m.alloc(BLOCKS))
    while len(m.pages.reserved) < m.min_reserved and time.monotonic() < deadline:
        time.sleep(0.01)  # the refill thread warms the pool
    return m


def _pairs(m, count: int) -> list[int]:
    alloc, free, clock = m.alloc, m.free, time.perf_counter_ns
    for _ in range(min(2000, count)):  # warm caches and the pool
        free(alloc(BLOCKS))
    samples = []
    for _ in range(count):
        t0 = clock()
        ids = alloc(BLOCKS)
        free(ids)
        samples.append(clock() - t0)
    return samples


def _allocs(m, count: int) -> list[int]:
    """``alloc`` alone: its ``free`` happens outside the timed span."""
    alloc, free, clock = m.alloc, m.free, time.perf_counter_ns
    for _ in range(min(2000, count)):
        free(alloc(BLOCKS))
    samples = []
    for _ in range(count):
        t0 = clock()
        ids = alloc(BLOCKS)
        samples.append(clock() - t0)
        free(ids)
    return samples


def _upstream_publish(m, path):
    def publish() -> None:
        m._dirty.clear()
        legacy_publish(path, m.pages.blocks_used * m.block_bytes, len(m.pages.reserved) * m.bundle_bytes)
    return publish


def run(quick: bool) -> list[dict]:
    count = 20_000 if quick else 200_000
    rows: list[dict] = []
    results: dict[str, dict[str, float]] = {}
    with private_segments(KVCACHED_HOST_CAPACITY="1GiB") as directory:
        for label, policy, publish, fast in (
            ("ours, affinity (default)", "affinity", "seqlock", True),
            ("ours, affinity, Python path (KVCACHED_FASTPATH=0)", "affinity", "seqlock", False),
            ("ours, best-fit", "best-fit", "seqlock", True),
            ("ours, first-fit", "first-fit", "seqlock", True),
            ("upstream-style: best-fit + flock publish per op", "best-fit", "legacy", False),
            ("bookkeeping only (affinity, publish disabled)", "affinity", "off", False),
        ):
            m = _manager(policy, fast)
            try:
                if publish == "legacy":
                    path = directory / f"kvcached_hot_{policy}"
                    legacy_create(path, 1 << 40)
                    m._publish = _upstream_publish(m, path)
                elif publish == "off":
                    m._publish = m._dirty.clear
                stats = summary_us(_pairs(m, count))
            finally:
                if publish != "seqlock":
                    del m._publish  # back to the real publish for close()
                m.close()
            results[label] = stats
            rows.append({"name": f"alloc({BLOCKS})+free pair: {label}", "value": round(stats["p50"], 2),
                         "unit": "µs p50", "note": f"p99 {stats['p99']:.2f} µs; {count} pairs, pool warm"})
        for label, fast in (("C path", True), ("Python path", False)):
            label = f"ours, affinity, 2 ranks (tensor parallelism), {label}"
            m = _manager("affinity", fast, world=2)
            try:
                assert (m._fast is not None) == (fast and m.fastpath_reason == ""), m.fastpath_reason
                stats = summary_us(_pairs(m, count // 4))  # each rank worker is a process of its own: fewer pairs
            finally:
                m.close()
            results[label] = stats
            rows.append({"name": f"alloc({BLOCKS})+free pair: {label}", "value": round(stats["p50"], 2),
                         "unit": "µs p50", "note": f"p99 {stats['p99']:.2f} µs; {count // 4} pairs, pool warm "
                                                   "(no page is mapped, so no rank is asked)"})
        for label, fast in (("C path (default)", True), ("Python path", False)):
            m = _manager("affinity", fast)
            try:
                path_used = "C" if m._fast is not None else f"Python: {m.fastpath_reason}"
                stats = summary_us(_allocs(m, count))
            finally:
                m.close()
            results[f"alloc {label}"] = stats
            rows.append({"name": f"alloc({BLOCKS}) alone: {label}", "value": round(stats["p50"], 2), "unit": "µs p50",
                         "note": f"p99 {stats['p99']:.2f} µs; ran on the {path_used} path"})
    ours = results["ours, affinity (default)"]["p50"]
    upstream = results["upstream-style: best-fit + flock publish per op"]["p50"]
    rows.append({"name": "alloc+free pair: upstream-style / ours", "value": round(upstream / ours, 2), "unit": "x",
                 "note": "ratio of the medians above"})
    rows.append({"name": "alloc alone: Python path / C path",
                 "value": round(results["alloc Python path"]["p50"] / results["alloc C path (default)"]["p50"], 2),
                 "unit": "x", "note": "ratio of the medians above"})
    return rows


if __name__ == "__main__":
    for row in run(quick=True):
        print(f"{row['name']}: {row['value']} {row['unit']}  ({row['note']})")
