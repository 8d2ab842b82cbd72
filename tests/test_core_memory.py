"""Host memory is real: mapping a page raises the allocator's RSS, trimming or freeing lowers it at once."""

from __future__ import annotations

from conftest import send, wait_for

import kvcached_core as kc

MiB = 1024 * 1024
# 2 MiB pages x 8 layers x K/V: one page id costs 32 MiB, far above the interpreter's own noise.
MODEL = dict(num_blocks=8 * 16, block_bytes=256 * 1024, num_layers=8, page_size=2 * MiB)
BUNDLE = 32 * MiB


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")



# The children's pool: three pages, kept (no idle return).
POOL = {"KVCACHED_IDLE_RETURN_S": "-1", "KVCACHED_MIN_RESERVED_PAGES": "3", "KVCACHED_MAX_RESERVED_PAGES": "3"}


def test_rss_rises_with_mapped_pages_and_drops_after_a_trim(spawn_allocator):
    proc = spawn_allocator("rss", env=POOL, **MODEL)
    baseline = rss(proc.pid)
    send(proc, "a = m.alloc(8)")  # one page in use; the refill thread maps three more
    snap = wait_for(lambda: (s := kc.snapshot("rss")).pages_reserved == 3 and s, what="the pool to fill")
    assert snap.mapped_bytes == 4 * BUNDLE
    grown = rss(proc.pid)
    assert grown - baseline >= 0.95 * 4 * BUNDLE, f"RSS grew by {(grown - baseline) / MiB:.0f} MiB only"

    ack = kc.request_trim("rss", wait=5)
    assert ack.bytes_returned == 3 * BUNDLE
    trimmed = rss(proc.pid)
    assert grown - trimmed >= 0.95 * 3 * BUNDLE, f"RSS fell by {(grown - trimmed) / MiB:.0f} MiB only"
    assert trimmed - baseline >= 0.95 * BUNDLE, "the page in use lost its memory"

    send(proc, "m.free(a); m.trim()")
    assert kc.snapshot("rss").mapped_bytes == 0
    assert rss(proc.pid) - baseline < 0.25 * BUNDLE, "memory stayed committed after everything was returned"


def test_pages_freed_beyond_the_pool_maximum_return_their_memory_at_once(spawn_allocator):
    proc = spawn_allocator("spill", env=POOL, **MODEL)
    send(proc, "a = m.alloc(8 * 7)")  # seven pages in use, then the pool fills to three
    wait_for(lambda: kc.snapshot("spill").pages_reserved == 3, what="the pool to fill")
    full = rss(proc.pid)
    send(proc, "m.free(a[:8 * 4])")  # four pages empty; the pool is full, so each is unmapped
    snap = kc.snapshot("spill")
    assert (snap.pages_inuse, snap.pages_reserved, snap.mapped_bytes) == (3, 3, 6 * BUNDLE)
    assert full - rss(proc.pid) >= 0.95 * 4 * BUNDLE


def test_a_lowered_limit_returns_memory_as_pages_empty(spawn_allocator):
    proc = spawn_allocator("capped", env=POOL, **MODEL)
    baseline = rss(proc.pid)
    send(proc, "a = m.alloc(8 * 4)")
    wait_for(lambda: kc.snapshot("capped").pages_reserved == 3, what="the pool to fill")
    full = rss(proc.pid)
    ack = kc.request_limit("capped", 2 * BUNDLE, wait=5)  # below the four pages in use
    assert ack.status == "deferred"
    after_limit = rss(proc.pid)
    assert full - after_limit >= 0.95 * 3 * BUNDLE, "the pool was not returned under a lower limit"
    assert after_limit - baseline >= 0.95 * 4 * BUNDLE, "pages in use lost their memory"
    send(proc, "m.free(a[:8 * 2])")
    snap = kc.snapshot("capped")
    assert (snap.limit_status, snap.mapped_bytes) == ("applied", 2 * BUNDLE)
    assert after_limit - rss(proc.pid) >= 0.95 * 2 * BUNDLE
