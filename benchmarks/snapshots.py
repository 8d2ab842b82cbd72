"""Snapshot reads of 64 live models: what kvctl list, kvtop and the exporter pay per refresh.

A child process owns 64 segments (``SegmentWriter``, the allocator's own publish path, without
64 allocators' threads competing for the CPU) with 4096 pages each and realistic page maps,
publishes a state change on one of them every millisecond and keeps every heartbeat fresh,
so every model reads as live. Timed here: ``list_models()`` (counters of all 64),
``list_models(with_pages=True)`` (plus all 64 page maps), ``snapshot(name)`` (one model and
its page map, found by name) and ``fragmentation()`` of a snapshot.
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

for w in writers:
    publish(w)

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


def _timed(fn, count: int) -> dict[str, float]:  # noqa: ANN001
    samples = []
    clock = time.perf_counter_ns
    for _ in range(count):
        t0 = clock()
        fn()
        samples.append(clock() - t0)
    return summary_us(samples)


def _sum_every_read(name: str, map_raw: bytes, pages) -> int:  # noqa: ANN001, ARG001
    """The reader's page-map check as it was before ``reader.page_sum``: a sum over every page, every read."""
    return sum(pages) & 0xFFFFFFFFFFFFFFFF


def _baseline(fn):  # noqa: ANN001, ANN202
    """``fn`` run on the previous reader path (the page map summed on every read), for a like-for-like row."""
    from kvcached_core.segment import reader

    def run() -> object:
        kept, reader.page_sum = reader.page_sum, _sum_every_read
        try:
            return fn()
        finally:
            reader.page_sum = kept
    return run


def run(quick: bool) -> list[dict]:
    from kvcached_core.segment.frag import fragmentation
    from kvcached_core.segment.reader import list_models, snapshot

    count = 30 if quick else 300
    with private_segments():
        owner = spawn(OWNER.replace("MODELS", str(MODELS)).replace("PAGES", str(PAGES)))
        try:
            models = list_models()
            live = sum(m.status == "live" for m in models)
            if live != MODELS:
                raise RuntimeError(f"expected {MODELS} live models, found {live}")
            one = snapshot("bench-31")
            results = {
                f"list_models(), {MODELS} models": _timed(list_models, count),
                f"list_models(with_pages=True), {MODELS} models x {PAGES} pages": _timed(
                    lambda: list_models(with_pages=True), count),
                f"list_models(with_pages=True), {MODELS} models x {PAGES} pages, previous reader (sum every read)":
                    _timed(_baseline(lambda: list_models(with_pages=True)), count),
                f"snapshot(name), one of {MODELS} models, with its page map": _timed(
                    lambda: snapshot("bench-31"), count),
                f"fragmentation(snapshot), {PAGES} pages": _timed(lambda: fragmentation(one), count),
            }
        finally:
            stop(owner)
    rows = []
    for name, stats in results.items():
        rows.append({"name": f"snapshot read: {name}", "value": round(stats["p50"] / 1e3, 3), "unit": "ms p50",
                     "note": f"p99 {stats['p99'] / 1e3:.3f} ms; {count} reads while the owner publishes every ms"})
    return rows


if __name__ == "__main__":
    for row in run(quick=True):
        print(f"{row['name']}: {row['value']} {row['unit']}  ({row['note']})")
