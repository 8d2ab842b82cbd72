"""Reclaim that keeps up with growth (allocator/pressure.py): asks answered in full grow, and two busy models
that grow in turn converge. Real processes and real shared memory; counts, never times.

Every model here is 1 MiB a page bundle (256 KiB pages, 2 layers, K and V), 4 blocks a page, and keeps no
warm pool (``KVCACHED_MIN_RESERVED_PAGES=0``): each refused alloc lacks one page, so each ask that is not
grown is one page.
"""

from __future__ import annotations

import os
import time

import pytest
from conftest import wait_for

from kvcached_core import KVCacheManager, list_models
from kvcached_core.segment import layout as L

MiB = 1 << 20
GEOMETRY = dict(num_blocks=256, block_bytes=64 * 1024, num_layers=2, page_size=256 * 1024)
BUDGET_PAGES = 26

# An idle engine with a prefix cache: 2 pages of active blocks, then cached blocks over the rest of the budget.
IDLE_DONOR = f"""
active = m.alloc(8)
cached = m.alloc({(BUDGET_PAGES - 2) * 4})
assert active is not None and cached is not None
m.mark_cached(cached)
m.set_evict_handler(lambda: m.evict_for_limit())
"""


@pytest.fixture
def budget(monkeypatch):
    monkeypatch.setenv("KVCACHED_HOST_CAPACITY", f"{BUDGET_PAGES}MiB")
    monkeypatch.setenv("KVCACHED_IDLE_RETURN_S", "-1")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")


def snap(name: str):
    return next(s for s in list_models() if s.name == name)


def one_page(m: KVCacheManager) -> list[int]:
    """One page's worth of blocks, the alloc retried while it misses, as an engine's scheduler retries each step."""
    deadline = time.monotonic() + 60
    while (ids := m.alloc(4)) is None:
        assert time.monotonic() < deadline, f"{m.name}: no page in 60 s"
        time.sleep(0.001)
    return ids


def test_a_model_growing_a_page_per_alloc_behind_an_idle_donor_asks_for_ever_more(budget, spawn_allocator) -> None:
    # Each refused alloc lacks one page. The old pacing asked for that page, then held the next ask back 250 ms:
    # 18 asks for 18 pages (4.3 s). Asks answered in full grow (1, 2, 4, 8 pages...): 5 asks.
    spawn_allocator("idle", script=IDLE_DONOR, **GEOMETRY)
    wait_for(lambda: snap("idle").mapped_bytes == BUDGET_PAGES * MiB, what="the donor to fill the budget")
    with KVCacheManager("busy", name="busy", **GEOMETRY) as m:
        blocks = [b for _ in range(18) for b in one_page(m)]
        assert len(set(blocks)) == 18 * 4
        # Every ask answered and counted, and what the donor gave mapped by the asker at once: none of it stays free
        # in the budget for a third model to take.
        wait_for(lambda: m.pressure.took_total == snap("idle").pressure.gave_total and not m.pages.inflight
                 and m.backend.ledger.free_bytes() < m.bundle_bytes,  # type: ignore[attr-defined]
                 what="the donor's answers to be counted and what it gave to be mapped by the asker")
        asks = m.pressure.asked_count
        idle = snap("idle")
        assert asks < 8, f"{asks} asks for 18 pages: the ask did not grow"
        assert idle.pressure.gave_count == asks and idle.pressure.given_bytes >= 4 * MiB  # the last ask, grown
        assert idle.blocks_used - idle.blocks_cached == 8  # its active blocks are untouched
        assert idle.mapped_bytes + m.pages.mapped_pages * MiB <= BUDGET_PAGES * MiB


def count_maps(monkeypatch, m: KVCacheManager, events: dict[str, int]) -> None:
    """Count the pages ``m``'s backend maps and unmaps."""
    backend = m.backend
    real_map, real_unmap = backend.map_pages, backend.unmap_pages

    def map_pages(pages):
        mapped = real_map(pages)
        events["map"] += len(mapped)
        return mapped

    def unmap_pages(pages):
        events["unmap"] += len(pages)
        return real_unmap(pages)

    monkeypatch.setattr(backend, "map_pages", map_pages)
    monkeypatch.setattr(backend, "unmap_pages", unmap_pages)


def settled(a: KVCacheManager, b: KVCacheManager) -> bool:
    """Every reclaim request between ``a`` and ``b`` is answered, and what each gave the other counted as taken."""
    answered = all(m.segment.request_numbers()[1] == m.pressure.acked_seq for m in (a, b))
    return answered and a.pressure.took_total == b.pressure.gave_total and b.pressure.took_total == a.pressure.gave_total


def test_two_busy_models_growing_in_turn_converge(budget, monkeypatch) -> None:
    # Six phases: in each, one model frees a page and the other takes one, twelve times; then they swap. Every page
    # that changes hands is at most unmapped once and mapped once, memory flows one way in each phase (the model
    # that gives takes nothing back), and the asks stay few: the old pacing asked once a page (36 asks here), and
    # a model that had given could not ask for its own growth for HOLD_S (it waited 2 s at each swap).
    phases, moved = 6, 12
    events = {"map": 0, "unmap": 0}
    with KVCacheManager("a", name="a", **GEOMETRY) as a, KVCacheManager("b", name="b", **GEOMETRY) as b:
        held: dict[str, list[list[int]]] = {"a": [], "b": []}
        for m in (a, b):
            m.set_evict_handler(lambda m=m: m.evict_for_limit())
            count_maps(monkeypatch, m, events)
        for m, pages in ((a, 4), (b, 16)):
            held[m.name] += [one_page(m) for _ in range(pages)]
        before = dict(events)
        asks_before = a.pressure.asked_count + b.pressure.asked_count
        for phase in range(phases):
            grower, giver = (a, b) if phase % 2 == 0 else (b, a)
            took_before = giver.pressure.took_count
            for _ in range(moved):
                giver.free(held[giver.name].pop())
                held[grower.name].append(one_page(grower))
            wait_for(lambda: settled(a, b), what=f"phase {phase}: every ask to be answered and counted")
            assert giver.pressure.took_count == took_before, f"phase {phase}: {giver.name} took memory back"
            assert snap(grower.name).pressure.wanted_bytes == 0
        asks = a.pressure.asked_count + b.pressure.asked_count - asks_before
        changes = events["map"] - before["map"] + events["unmap"] - before["unmap"]
        assert changes <= 2 * phases * moved, f"{changes} maps and unmaps for {phases * moved} pages moved"
        assert asks <= 4 * phases, f"{asks} asks for {phases * moved} pages moved in {phases} phases"
        assert a.pressure.gave_count + b.pressure.gave_count <= asks
        assert snap("a").pressure.given_to in (0, L.model_id(os.getpid(), "b"))
