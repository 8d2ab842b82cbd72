"""Snapshot reads of 64 live models: what kvctl list, kvtop and the exporter pay per refresh.

A child process owns 64 segments (``SegmentWriter``, the allocator's own publish path, without
64 allocators' threads competing for the CPU) with 4096 pages each and realistic page maps,
publishes a state change on one of them every millisecond (counters and page map, then its
traffic and sleep words, as an engine step does) and keeps every heartbeat fresh, so every model
reads as live with traffic, sleep and compaction words to check. Timed here: ``list_models()`` (counters of all 64),
``list_models(with_pages=True)`` (plus all 64 page maps), ``snapshot(name)`` (one model and
its page map, found by name) and ``fragmentation()`` of a snapshot.

The two ``list_models`` rows have a "previous reader" twin: the reader as of commit 9b05ad6
(``benchmarks/_reader_9b05ad6.py``: every file opened, checked and closed on every scan, /proc
asked once per model), timed turn about with the current one so both share the host's load.
Goal (issue 25): 64 models with 4096-page maps in 2 ms or less.
"""

from __future__ import annotations

import time

from ._common import private_segments, spawn, stop, summary_us

MODELS = 64
PAGES = 4096

OWNER = """
import random, sys, threading, time
from kvcached_core.segment import layout as L
from kvcached_core.segment.writer import Identity, SegmentWriter

rng = random.Random(64)
writers = []
for i in range(MODELS):
    ident = Identity(name=f"bench-{i:02d}", model=f"model-{i:02d}", engine="bench", backend="host", device=0,
                     page_size=2 << 20, block_bytes=32 << 10, num_layers=32, num_kv_buffers=2,
                     blocks_per_page=64, num_blocks=PAGES * 64, pages_total=PAGES)
    writers.append(SegmentWriter(ident))

def publish(w):
    w.begin()
    inuse = used = cached = 0
    for page in range(rng.randrange(PAGES // 4, PAGES // 2)):
        u = rng.randrange(1, 65)
        c = rng.randrange(0, u + 1)
        w.set_page(page, L.page_entry(True, u, c))
        inuse, used, cached = inuse + 1, used + u, cached + c
    fields = dict.fromkeys(L.COUNTER_FIELDS[:-1], 0)
    fields.update(pages_inuse=inuse, blocks_used=used, blocks_cached=cached, mapped_bytes=inuse * (256 << 20),
                  updated_ns=time.time_ns(), effective_limit=-1, requested_limit=-1, ranks_active=1)
    w.publish(tuple(fields.values()))

def words(w, n):
    w.publish_traffic(8, 2, n, 100 * n, 50 * n, 0, time.time_ns())
    w.publish_sleep(1, L.SLEEP_AWAKE, 0, 60_000, 0, 0)

for w in writers:
    publish(w)
    words(w, 1)
    w.publish_compaction((1, 0, 0) + (0,) * (len(L.COMPACT_FIELDS) - 3 + 5 * L.COMPACT_ANSWERS))

def churn():
    n = 0
    while True:
        time.sleep(0.001)
        w = writers[n % len(writers)]
        w.begin()
        page = rng.randrange(PAGES // 4)
        w.set_page(page, L.page_entry(True, rng.randrange(1, 65), 0))
        fields = dict.fromkeys(L.COUNTER_FIELDS[:-1], 0)
        fields.update(updated_ns=time.time_ns(), effective_limit=-1, requested_limit=-1, ranks_active=1)
        w.publish(tuple(fields.values()))
        words(w, n)
        if n % 64 == 0:
            for each in writers:
                each.heartbeat()
        n += 1

threading.Thread(target=churn, daemon=True).start()
print("READY", flush=True)
sys.stdin.readline()
for w in writers:
    w.close()
"""


def _timed(fn, count: int) -> dict[str, float]:
    samples = []
    clock = time.perf_counter_ns
    for _ in range(count):
        t0 = clock()
        fn()
        samples.append(clock() - t0)
    return summary_us(samples)


def _timed_pair(fn, before, count: int) -> tuple[dict[str, float], dict[str, float]]:
    """``fn`` and ``before`` called turn about (ABBA), so a change in the host's load reaches both alike."""
    ours: list[int] = []
    theirs: list[int] = []
    clock = time.perf_counter_ns
    for i in range(count):
        order = ((fn, ours), (before, theirs)) if i % 2 == 0 else ((before, theirs), (fn, ours))
        for call, samples in order:
            t0 = clock()
            call()
            samples.append(clock() - t0)
    return summary_us(ours), summary_us(theirs)


def run(quick: bool) -> list[dict]:
    from kvcached_core.segment.frag import fragmentation
    from kvcached_core.segment.reader import list_models, snapshot

    from . import _reader_9b05ad6 as before

    count = 30 if quick else 300
    with private_segments():
        owner = spawn(OWNER.replace("MODELS", str(MODELS)).replace("PAGES", str(PAGES)))
        try:
            models = list_models()
            live = sum(m.status == "live" for m in models)
            if live != MODELS:
                raise RuntimeError(f"expected {MODELS} live models, found {live}")
            if [m.name for m in before.list_models()] != [m.name for m in models]:
                raise RuntimeError("the previous reader does not see the same models")
            one = snapshot("bench-31")
            counters, counters_before = _timed_pair(list_models, before.list_models, count)
            paged, paged_before = _timed_pair(lambda: list_models(with_pages=True),
                                              lambda: before.list_models(with_pages=True), count)
            prev = "previous reader (9b05ad6)"
            results = {
                f"list_models(), {MODELS} models": counters,
                f"list_models(), {MODELS} models, {prev}": counters_before,
                f"list_models(with_pages=True), {MODELS} models x {PAGES} pages": paged,
                f"list_models(with_pages=True), {MODELS} models x {PAGES} pages, {prev}": paged_before,
                f"snapshot(name), one of {MODELS} models, with its page map": _timed(
                    lambda: snapshot("bench-31"), count),
                f"fragmentation(snapshot), {PAGES} pages": _timed(lambda: fragmentation(one), count),
            }
        finally:
            stop(owner)
    rows = []
    for name, stats in results.items():
        paired = "list_models" in name
        rows.append({"name": f"snapshot read: {name}", "value": round(stats["p50"] / 1e3, 3), "unit": "ms p50",
                     "note": f"p99 {stats['p99'] / 1e3:.3f} ms; {count} reads while the owner publishes every ms"
                             + ("; turn about with its twin" if paired else "")})
    for what, ours, theirs in (("list_models()", counters, counters_before),
                               ("list_models(with_pages=True)", paged, paged_before)):
        rows.append({"name": f"snapshot read: {what}, previous reader / current", "unit": "x",
                     "value": round(theirs["p50"] / ours["p50"], 1),
                     "note": f"ratio of the medians above; goal: {MODELS} models in 2 ms or less "
                             + ("(met)" if ours["p50"] <= 2000 else "(not met on this host)")})
    return rows


if __name__ == "__main__":
    for row in run(quick=True):
        print(f"{row['name']}: {row['value']} {row['unit']}  ({row['note']})")
