"""A lowered limit takes memory from the prefix cache: through the engine's evict handler the allocator has
the engine evict whole cached pages (cheapest first, only as many as the limit needs), so the limit applies
at once, idle or busy; active blocks are never touched. Without a handler the limit waits, as before."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import wait_for
from small_allocator import BPP, BUNDLE, assert_stamped, small_manager, stamp

import kvcached_core as kc


@pytest.fixture
def manager(monkeypatch):
    with small_manager(monkeypatch, "lev", KVCACHED_MAX_CACHED_TOKENS="-1") as m:
        yield m


class Index:
    """The engine's prefix index, as a dict: block -> its prefix hash. Whatever the allocator evicts leaves it."""

    def __init__(self, m: kc.KVCacheManager) -> None:
        self.m = m
        self.hashes: dict[int, int] = {}

    def cache(self, blocks: list[int]) -> None:
        for b in blocks:
            self.hashes[b] = hash(("prefix", b))
        self.forget(self.m.mark_cached(blocks))

    def forget(self, blocks: list[int]) -> None:
        for b in blocks:
            del self.hashes[b]  # a KeyError: the allocator evicted a block the engine did not index


def cached_layout(m: kc.KVCacheManager, index: Index) -> dict[str, list[int]]:
    """Six pages in use: one active, three whole cached pages of 4, one whole cached page of 2 (the cheapest),
    one with 2 active and 2 cached blocks."""
    runs = {name: m.alloc(BPP) for name in ("active", "b", "c", "d", "e", "mixed")}
    assert all(runs.values()) and len({r[0] // BPP for r in runs.values()}) == 6
    stamp(m, [b for run in runs.values() for b in run])
    for name in ("b", "c", "d"):  # b is the oldest
        index.cache(runs[name])
    index.cache(runs["e"][:2])
    m.free(runs["e"][2:])
    runs["e"] = runs["e"][:2]
    index.cache(runs["mixed"][2:])
    assert m.cached_blocks == 16 and kc.snapshot("lev").pages_inuse == 6
    return runs


@pytest.mark.parametrize("via", ["set_limit", "request_limit"])
def test_a_lowered_limit_evicts_the_cheapest_whole_cached_pages_and_applies_at_once(manager, via):
    m = manager
    index = Index(m)
    runs = cached_layout(m, index)
    asked: list[str] = []

    def handler() -> None:  # as an engine that guards its index with the allocator's lock does
        asked.append(threading.current_thread().name)
        with m.lock:
            index.forget(m.evict_for_limit())

    m.set_evict_handler(handler)
    assert not asked, "no limit: nothing to ask"
    limit = 4 * BUNDLE
    status = m.set_limit(limit) if via == "set_limit" else kc.request_limit("lev", limit, wait=5).status
    assert status == "applied" and asked
    snap = kc.snapshot("lev")
    assert (snap.limit_status, snap.pages_inuse) == ("applied", 4) and snap.mapped_bytes <= 4 * BUNDLE
    # Two pages over: the cheapest whole cached page (e, 2 blocks) and the oldest of the full ones (b).
    kept = runs["c"] + runs["d"] + runs["mixed"][2:]
    assert sorted(index.hashes) == sorted(kept) == sorted(m.cache.blocks)
    assert m.used_blocks == len(kept) + BPP + 2
    assert_stamped(m, runs["active"] + runs["mixed"] + runs["c"] + runs["d"])
    assert snap.evicted_blocks == 6


def test_without_a_handler_the_limit_stays_deferred(manager):
    m = manager
    index = Index(m)
    cached_layout(m, index)
    assert m.set_limit(4 * BUNDLE) == "deferred"
    time.sleep(1.2)  # two poller ticks
    snap = kc.snapshot("lev")
    assert (snap.limit_status, snap.pages_inuse, snap.blocks_cached) == ("deferred", 6, 16)
    got = m.evict_for_limit()  # an engine may still evict for the limit by itself, between its steps
    index.forget(got)
    assert len(got) == 6 and kc.snapshot("lev").limit_status == "applied"


def test_a_deferred_limit_asks_again_once_finished_requests_leave_whole_cached_pages(manager):
    """The engine serves the request on its own thread (as vLLM does): the handler only wakes it. While
    active blocks pin every page there is nothing to ask; once requests end and their pages hold only
    cached blocks, the poller asks and the limit applies, the still-active page untouched."""
    m = manager
    index = Index(m)
    runs = [m.alloc(BPP) for _ in range(4)]
    assert all(runs)
    stamp(m, [b for run in runs for b in run])
    wake = threading.Event()
    m.set_evict_handler(wake.set)
    assert m.set_limit(2 * BUNDLE) == "deferred"
    time.sleep(0.7)
    assert not wake.is_set(), "asked to evict while only active blocks hold the limit up"

    evicted: list[int] = []
    stop = threading.Event()

    def engine() -> None:
        while not stop.is_set():
            if wake.wait(0.05):
                wake.clear()
                got = m.evict_for_limit()
                index.forget(got)
                evicted.extend(got)

    thread = threading.Thread(target=engine)
    thread.start()
    try:
        for run in runs[1:]:
            index.cache(run)  # three requests end; their blocks stay cached, one request still runs
        wait_for(lambda: kc.snapshot("lev").limit_status == "applied", timeout=30, what="the limit to apply")
    finally:
        stop.set()
        thread.join()
    snap = kc.snapshot("lev")
    assert snap.pages_inuse == 2 and snap.mapped_bytes <= 2 * BUNDLE
    assert len(evicted) == 2 * BPP and sorted(index.hashes) == sorted(m.cache.blocks)
    assert {b // BPP for b in m.cache.blocks} <= {r[0] // BPP for r in runs[1:]}
    assert_stamped(m, runs[0] + sorted(m.cache.blocks))


def test_evict_for_limit_evicts_nothing_without_a_deferred_limit(manager):
    m = manager
    index = Index(m)
    runs = cached_layout(m, index)
    assert m.evict_for_limit() == []
    assert m.set_limit(8 * BUNDLE) == "applied"
    assert m.evict_for_limit() == [] and m.cached_blocks == 16
    m.free(runs["active"])
    assert m.set_limit(5 * BUNDLE) == "applied"  # the freed page was the only one over
    assert m.evict_for_limit() == [] and m.cached_blocks == 16
