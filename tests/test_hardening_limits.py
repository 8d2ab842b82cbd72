"""Limits under load: a controller lowers and raises a model's limit while its workload allocates and frees.

The workload (a child process) stamps every block it holds in the real host memory of two
KV buffers and checks the stamps before freeing: an in-use page that got unmapped reads back
as zeros. It also records any block handed out twice. The controller checks every snapshot:
a page with used blocks is mapped, an applied limit is never exceeded, a deferred one keeps
no reserved pages. At the end every block can be handed out exactly once again.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
import time

from conftest import child_env

import kvcached_core as kc
from kvcached_core.segment import layout as L

NUM_BLOCKS, BLOCK_BYTES, PAGE_SIZE, LAYERS = 2048, 16 * 1024, 64 * 1024, 2
BUNDLE = PAGE_SIZE * LAYERS * 2

WORKLOAD = textwrap.dedent(f"""
    import json, random, sys, threading, time
    from kvcached_core import KVCacheManager

    m = KVCacheManager("load", name="load", num_blocks={NUM_BLOCKS}, block_bytes={BLOCK_BYTES},
                       num_layers={LAYERS}, page_size={PAGE_SIZE})
    views = [m.buffer(0, 0), m.buffer({LAYERS - 1}, 1)]
    held, errors, stats = {{}}, [], dict(allocs=0, refused=0, frees=0, checks=0)
    stop = threading.Event()

    def stamp(block, value):
        for view in views:
            view[block * {BLOCK_BYTES}:block * {BLOCK_BYTES} + 8] = value.to_bytes(8, "little")

    def intact(block):
        want = held[block].to_bytes(8, "little")
        return all(view[block * {BLOCK_BYTES}:block * {BLOCK_BYTES} + 8] == want for view in views)

    def free_some(rng, n):
        victims = rng.sample(sorted(held), min(n, len(held)))
        for block in victims:
            if not intact(block):
                errors.append(f"block {{block}} lost its contents while in use (page unmapped?)")
            del held[block]
        m.free(victims)
        stats["frees"] += 1

    def churn():
        rng, generation = random.Random(7), 0
        while not stop.is_set():
            if rng.random() < 0.55 and len(held) < 1500:
                ids = m.alloc(rng.randint(1, 6))
                if ids is None:
                    stats["refused"] += 1
                    free_some(rng, rng.randint(1, 12))
                    continue
                stats["allocs"] += 1
                for block in ids:
                    generation += 1
                    if block in held:
                        errors.append(f"block {{block}} handed out twice")
                    held[block] = generation
                    stamp(block, generation)
            elif held:
                free_some(rng, rng.randint(1, 6))
            if (stats["allocs"] + stats["frees"]) % 400 == 0:
                stats["checks"] += 1
                errors.extend(f"block {{b}} lost its contents while in use" for b in list(held) if not intact(b))

    worker = threading.Thread(target=churn)
    worker.start()
    print("READY", flush=True)
    sys.stdin.readline()  # the controller is done
    stop.set()
    worker.join()
    errors.extend(f"block {{b}} lost its contents at the end" for b in held if not intact(b))
    print(json.dumps(dict(stats, held=len(held), used=m.used_blocks, errors=errors[:20])), flush=True)
    sys.stdin.readline()  # the controller checked the final state
    m.free(list(held))
    m.set_limit(None)
    everything, deadline = None, time.monotonic() + 10
    while everything is None and time.monotonic() < deadline:
        everything = m.alloc({NUM_BLOCKS})  # a miss while the refill thread maps a batch: retried, as engines do
        if everything is None:
            time.sleep(0.01)
    print(json.dumps(dict(all_blocks=sorted(everything) == list(range({NUM_BLOCKS})) if everything else False,
                          used=m.used_blocks)), flush=True)
    if everything:
        m.free(everything)
    m.close()
""")


def read() -> kc.ModelSnapshot:
    """A snapshot of the model; a read that found the writer too busy (no consistent copy) is retried."""
    for _ in range(50):
        try:
            return kc.snapshot("load")
        except BlockingIOError:
            continue
    raise AssertionError("no consistent snapshot in 50 reads")


def check(snap: kc.ModelSnapshot) -> None:
    """What must hold in every snapshot, whatever the controller just did."""
    assert snap.blocks_used <= snap.pages_inuse * snap.blocks_per_page
    for page, entry in enumerate(snap.pages):
        mapped, used, _ = L.decode_page(entry)
        assert mapped or not used, f"page {page} holds {used} blocks but is unmapped"
    assert sum(L.decode_page(e)[1] for e in snap.pages) == snap.blocks_used
    if snap.limit_status == "applied":
        assert snap.mapped_bytes <= snap.limit_bytes, (snap.mapped_bytes, snap.limit_bytes)
    elif snap.limit_status == "deferred":
        assert snap.pages_reserved == 0 and snap.pages_inuse * BUNDLE > snap.limit_bytes


def wait_applied(limit: int | None, timeout: float = 30.0) -> kc.ModelSnapshot:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = read()
        check(snap)
        if snap.limit_status == ("none" if limit is None else "applied"):
            return snap
        time.sleep(0.01)
    raise AssertionError(f"the limit {limit} never applied: {snap.limit_status}, {snap.pages_inuse} pages in use")


def test_limits_going_down_and_up_under_load_never_unmap_in_use_pages():
    proc = subprocess.Popen([sys.executable, "-c", WORKLOAD], env=child_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        rng = random.Random(11)
        statuses = set()
        limits: list[int | None] = [rng.choice([0, 1, 2, 4, 8, 16, 24, 48, 96]) * BUNDLE for _ in range(40)]
        limits[::9] = [None] * len(limits[::9])
        limits.append(6 * BUNDLE + BUNDLE // 2)  # the last one, not a whole number of bundles
        for limit in limits:
            ack = kc.request_limit("load", limit, wait=10)
            statuses.add(ack.status)
            assert ack.status in ("applied", "deferred", "none")
            for _ in range(rng.randint(1, 6)):
                check(read())
        assert {"applied", "deferred"} <= statuses  # the load really pushed against lowered limits

        final = wait_applied(limits[-1])
        assert final.limit_bytes == 6 * BUNDLE  # rounded down to whole page bundles
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        report = json.loads(proc.stdout.readline())
        assert report["errors"] == []
        assert report["allocs"] > 100 and report["refused"] > 0 and report["checks"] > 0
        snap = read()
        check(snap)
        assert snap.limit_status == "applied" and snap.mapped_bytes <= 6 * BUNDLE
        assert snap.blocks_used == report["held"] == report["used"]  # no block lost or counted twice

        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline()) == {"all_blocks": True, "used": NUM_BLOCKS}
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
