"""Limits: raising applies at once; lowering below what is in use defers, never revokes a page in use."""

from __future__ import annotations

import time

import pytest
from conftest import wait_for
from small_allocator import BPP, BUNDLE, assert_stamped, small_manager, stamp

import kvcached_core as kc
from kvcached_core.segment import layout as L


@pytest.fixture
def manager(monkeypatch):
    with small_manager(monkeypatch, "lim") as m:
        yield m


def page_map(m) -> list[tuple[bool, int, int]]:
    return [L.decode_page(e) for e in kc.snapshot(m.name).page_entries()]


def held_pages(m) -> set[int]:
    return {p for p, (mapped, used, _c) in enumerate(page_map(m)) if used}


def test_raising_a_limit_applies_at_once(manager):
    m = manager
    assert m.set_limit(2 * BUNDLE) == "applied"
    first = m.alloc(2 * BPP)
    assert first is not None
    assert m.alloc(1) is None, "a third page under a two-page limit"
    assert m.available_size() == 0
    assert m.set_limit(5 * BUNDLE) == "applied"
    assert m.available_size() == 3 * BPP
    more = m.alloc(3 * BPP)
    assert more is not None
    snap = kc.snapshot("lim")
    assert (snap.limit_bytes, snap.limit_status, snap.mapped_bytes) == (5 * BUNDLE, "applied", 5 * BUNDLE)


def test_a_limit_is_rounded_down_to_whole_page_bundles(manager):
    assert manager.set_limit(2 * BUNDLE + BUNDLE // 2) == "applied"
    snap = kc.snapshot("lim")
    assert (snap.limit_bytes, snap.limit_status) == (2 * BUNDLE, "applied")
    assert manager.set_limit(BUNDLE - 1) == "applied"  # less than one page: nothing new may map
    assert manager.alloc(1) is None
    assert kc.snapshot("lim").mapped_bytes == 0


@pytest.mark.parametrize("via", ["set_limit", "request_limit"])
def test_lowering_below_in_use_defers_until_pages_empty(manager, via):
    m = manager
    blocks = [m.alloc(BPP) for _ in range(6)]  # six whole pages
    tail = m.alloc(2)  # a seventh page, half used
    everything = [b for run in blocks for b in run] + tail
    stamp(m, everything)
    wait_for(lambda: kc.snapshot("lim").pages_reserved == 2, what="the pool to refill")
    held = held_pages(m)
    assert len(held) == 7

    if via == "set_limit":
        status = m.set_limit(3 * BUNDLE)
    else:
        ack = kc.request_limit("lim", 3 * BUNDLE, wait=5)
        status, revision = ack.status, ack.revision
    assert status == "deferred"
    snap = kc.snapshot("lim")
    assert (snap.limit_status, snap.pages_inuse, snap.pages_reserved) == ("deferred", 7, 0)
    assert held_pages(m) == held and all(page_map(m)[p][0] for p in held), "a page in use was unmapped"
    assert_stamped(m, everything)
    assert m.alloc(BPP) is None, "a new page was mapped above the limit"
    assert m.alloc(2) is not None, "free slots on pages in use stay usable"

    for run, in_use_after in zip(blocks[:4], (6, 5, 4, 3), strict=True):
        m.free(run)
        snap = kc.snapshot("lim")
        assert (snap.pages_inuse, snap.pages_reserved) == (in_use_after, 0), "an emptied page was kept"
        assert snap.mapped_bytes == in_use_after * BUNDLE
        assert snap.limit_status == ("deferred" if in_use_after > 3 else "applied")
    assert_stamped(m, [b for run in blocks[4:] for b in run] + tail)
    if via == "request_limit":
        assert (snap.limit_revision, snap.applied_revision) == (revision, revision)

    m.free(blocks[4])  # now below the limit: the page stays as the pool, still within the limit
    time.sleep(0.1)
    snap = kc.snapshot("lim")
    assert snap.mapped_bytes <= 3 * BUNDLE and snap.limit_status == "applied"
    assert m.alloc(2 * BPP) is None, "more than the limit allows"


def test_a_zero_limit_with_nothing_in_use_returns_everything_and_keeps_it_returned(manager):
    m = manager
    m.free(m.alloc(1))
    wait_for(lambda: kc.snapshot("lim").pages_reserved >= 2, what="the pool to refill")
    assert m.set_limit(0) == "applied"
    assert kc.snapshot("lim").mapped_bytes == 0
    assert m.alloc(1) is None and not m.try_to_reserve(1)
    time.sleep(0.2)  # the refill thread must not map under a zero limit
    assert kc.snapshot("lim").mapped_bytes == 0
    assert m.set_limit(None) == "none"
    assert m.alloc(1) is not None


def test_negative_limits_are_refused(manager):
    with pytest.raises(ValueError, match="negative"):
        manager.set_limit(-1)
    with pytest.raises(kc.ControlError, match="negative"):
        kc.request_limit("lim", -1)
    assert kc.snapshot("lim").limit_bytes is None


def test_a_deferred_limit_packs_new_blocks_into_the_fullest_pages_so_sparse_ones_drain(manager):
    m = manager
    bpp = m.blocks_per_page
    runs = [m.alloc(bpp) for _ in range(3)]  # three full pages
    sparse, fuller = runs[0][0] // bpp, {runs[1][0] // bpp, runs[2][0] // bpp}
    m.free(runs[0][1:])  # the sparse page keeps one block
    m.free(runs[1][:1] + runs[2][:1])  # two fuller pages with one free slot each
    assert m.set_limit(m.bundle_bytes) == "deferred"
    got = m.alloc(2)  # kept together, it would land on the sparse page (the only one with room for both)
    assert got is not None and {b // bpp for b in got} == fuller
    m.free([runs[0][0]])  # so the sparse page empties: it is unmapped at once
    assert m.pages.mapped[sparse] == 0
    m.free(runs[1][1:] + runs[2][1:] + got)
    assert kc.snapshot(m.name).limit_status == "applied"
