"""Placement and eviction order of each policy, idle packing and idle return, on a real allocator.

Pages of 4 blocks (64 KiB pages, 16 KiB blocks); the background refill is off so page choice is
deterministic; the prefix-cache budget is unlimited unless a test says otherwise.
"""

from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner
from conftest import configured

from kvcached_core.allocator.manager import KVCacheManager
from kvcached_core.allocator.placement import POLICIES, make_policy
from kvcached_core.segment.frag import fragmentation
from kvcached_core.segment.reader import snapshot
from kvtop.cli import main as kvctl

KiB = 1024
BPP = 4
PAGE_AWARE = ["best-fit", "affinity"]


QUIET = {"KVCACHED_MIN_RESERVED_PAGES": "0", "KVCACHED_MAX_RESERVED_PAGES": "2", "KVCACHED_MAX_CACHED_BLOCKS": "-1"}


def manager(policy: str, num_blocks: int = 256, **env: str) -> KVCacheManager:
    """A small allocator with a quiet pool and an unbounded prefix cache; ``env``: other settings
    (``KVCACHED_...=value``), passed in, not set in the environment."""
    return KVCacheManager(f"pol-{policy}", num_blocks=num_blocks, block_bytes=16 * KiB, num_layers=1,
                          page_size=64 * KiB, policy=policy, settings=configured({**QUIET, **env}))


def page_of(block: int) -> int:
    return block // BPP


def pages_of(blocks: list[int]) -> set[int]:
    return {page_of(b) for b in blocks}


# -- eviction order ----------------------------------------------------------------------------
@pytest.mark.parametrize("policy", PAGE_AWARE)
def test_whole_pages_go_first(policy: str) -> None:
    with manager(policy) as m:
        active = m.alloc(1)
        older = m.alloc(3)  # fills the active block's page
        assert pages_of(older) == pages_of(active)
        whole = m.alloc(4)  # a page of its own
        m.mark_cached(older)  # cached first: the oldest blocks...
        m.mark_cached(whole)  # ...but only this page can empty
        inuse = m.pages.pages_inuse
        assert sorted(m.evict(4)) == sorted(whole)
        assert m.pages.pages_inuse == inuse - 1


def test_lru_baseline_ignores_pages() -> None:
    with manager("first-fit") as m:
        m.alloc(1)
        older = m.alloc(3)
        whole = m.alloc(4)
        m.mark_cached(older)
        m.mark_cached(whole)
        assert m.evict(4) == older + whole[:1]


@pytest.mark.parametrize("policy", PAGE_AWARE)
def test_oldest_first_among_equal_pages(policy: str) -> None:
    with manager(policy) as m:
        m.alloc(1)  # something stays active, so the model never goes idle here
        first, second = m.alloc(4), m.alloc(4)
        m.mark_cached(second)
        m.mark_cached(first)  # `first` was cached last: the younger page
        assert sorted(m.evict(4)) == sorted(second)
        assert sorted(m.evict(4)) == sorted(first)


@pytest.mark.parametrize("policy", PAGE_AWARE)
def test_cheapest_whole_page_first(policy: str) -> None:
    with manager(policy) as m:
        m.alloc(4)  # stays active
        full = m.alloc(4)
        half = m.alloc(2)
        assert pages_of(half).isdisjoint(pages_of(full))
        m.mark_cached(full)  # older, but emptying its page costs 4 blocks
        m.mark_cached(half)
        assert m.evict(3) == half + full[:1]  # then the oldest block tops up the count


def test_default_eviction_spares_young_whole_pages() -> None:
    """Upstream's rule takes the cheapest whole page however young; ours looks at the oldest quarter only."""
    evicted = {}
    for policy in PAGE_AWARE:
        with manager(policy) as m:
            old = []
            for _ in range(4):  # four pages: one active block and three old cached blocks each
                m.alloc(1)
                blocks = m.alloc(3)
                m.mark_cached(blocks)
                old += blocks
            young = m.alloc(4)
            m.mark_cached(young)
            evicted[policy] = m.evict(4)
            assert len(evicted[policy]) == 4
    assert sorted(evicted["best-fit"]) == sorted(young)
    assert pages_of(evicted["affinity"]).isdisjoint(pages_of(young))


def test_budget_eviction_keeps_the_cache_within_budget() -> None:
    with manager("affinity", KVCACHED_MAX_CACHED_BLOCKS="6") as m:
        m.alloc(1)
        a, b = m.alloc(4), m.alloc(4)
        assert m.mark_cached(a) == []
        evicted = m.mark_cached(b)
        assert sorted(evicted) == sorted(a[:2]) or pages_of(evicted) == pages_of(a)
        assert m.cached_blocks == 6


# -- placement ---------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", PAGE_AWARE)
def test_best_fit_takes_the_fullest_page_that_fits(policy: str) -> None:
    with manager(policy) as m:
        roomy = m.alloc(2)  # 2 free
        tight = m.alloc(3)  # does not fit beside `roomy`: a page of its own, 1 free
        assert pages_of(tight).isdisjoint(pages_of(roomy))
        assert pages_of(m.alloc(1)) == pages_of(tight)
        assert pages_of(m.alloc(2)) == pages_of(roomy)


def test_first_fit_takes_the_lowest_page() -> None:
    for policy, expect_lowest in (("first-fit", True), ("best-fit", False)):
        with manager(policy) as m:
            low = m.alloc(4)
            m.alloc(4)
            m.alloc(3)  # a third page with 1 free slot
            m.free(low[:2])  # the lowest page now has 2
            assert (pages_of(m.alloc(1)) == pages_of(low)) is expect_lowest


def test_affinity_keeps_a_request_on_its_page() -> None:
    for policy, expect_own_page in (("affinity", True), ("best-fit", False)):
        with manager(policy) as m:
            request = m.alloc(2)
            other = m.alloc(3)
            step = m.alloc(1, near=request[-1])
            assert (pages_of(step) == pages_of(request)) is expect_own_page
            assert (pages_of(step) == pages_of(other)) is not expect_own_page


def test_affinity_opens_a_page_for_a_decode_stream_whose_page_is_full() -> None:
    with manager("affinity") as m:
        m.alloc(40)  # ten full pages: plenty of room under the slack bound
        request = m.alloc(2)
        other = m.alloc(3)
        request += m.alloc(1, near=request[-1]) + m.alloc(1, near=request[-1])
        assert len(pages_of(request)) == 1 and m.pages.used[page_of(request[0])] == BPP
        step = m.alloc(1, near=request[-1])
        assert pages_of(step).isdisjoint(pages_of(request) | pages_of(other))
        assert m.pages.used[page_of(step[0])] == 1


def test_affinity_shares_pages_when_slack_runs_out() -> None:
    with manager("affinity") as m:
        request = m.alloc(4)
        other = m.alloc(3)  # 1 free slot; a new page would leave 5 open slots for 7 blocks in use
        step = m.alloc(1, near=request[-1])
        assert pages_of(step) == pages_of(other)


def test_near_outside_the_model_is_only_a_hint() -> None:
    with manager("affinity") as m:
        assert len(m.alloc(2, near=10**9)) == 2
        assert len(m.alloc(2, near=-1)) == 2


# -- idle --------------------------------------------------------------------------------------
def _scatter(m: KVCacheManager) -> tuple[list[int], list[int]]:
    """Ten pages holding one cached block each, and one page of 4 active blocks."""
    singles = []
    for _ in range(10):
        ids = m.alloc(4)
        m.mark_cached(ids[:1])
        m.free(ids[1:])
        singles += ids[:1]
    return singles, m.alloc(4)


def test_going_idle_packs_to_the_floor_and_shows_in_the_segment() -> None:
    with manager("affinity") as m:
        singles, last = _scatter(m)
        before = snapshot(m.name)
        evicted = m.mark_cached(last)  # the last active blocks go: the model is idle now
        assert set(evicted) <= set(singles) and len(evicted) == 9
        snap = snapshot(m.name)
        frag = fragmentation(snap)
        assert snap.pages_inuse == 2 and snap.blocks_cached == 5
        assert frag.pinned_over_floor is not None and frag.pinned_over_floor <= 1.10
        assert snap.idle_returned - before.idle_returned == 9 * m.bundle_bytes
        assert snap.mapped_bytes == (2 + snap.pages_reserved) * m.bundle_bytes
        for block in evicted:
            assert not m.pages.is_used(block)
        # What the allocator did on idle is what the tools show.
        assert frag.idle_returned_bytes == snap.idle_returned
        report = CliRunner().invoke(kvctl, ["frag", m.name, "--json"])
        assert report.exit_code == 0, report.output
        assert json.loads(report.output)["idle_returned_bytes"] == snap.idle_returned > 0
        text = CliRunner().invoke(kvctl, ["frag", m.name]).output
        assert "idle return" in text


def test_upstream_policy_does_not_pack() -> None:
    with manager("best-fit") as m:
        _singles, last = _scatter(m)
        assert m.mark_cached(last) == []
        assert m.pages.pages_inuse == 11
        assert m.pack() == []


def test_pack_on_request_leaves_active_pages_alone() -> None:
    with manager("affinity") as m:
        singles, _last = _scatter(m)  # the last page stays active
        evicted = m.pack()
        assert set(evicted) <= set(singles)
        assert m.pages.pages_inuse <= 1.10 * -(-m.pages.blocks_used // BPP)


def test_idle_model_returns_its_warm_pool() -> None:
    with manager("affinity", KVCACHED_MIN_RESERVED_PAGES="3", KVCACHED_MAX_RESERVED_PAGES="4",
                 KVCACHED_IDLE_RETURN_S="0.1") as m:
        m.free(m.alloc(2))
        deadline = time.monotonic() + 10
        snap = snapshot(m.name)
        while (snap.pages_reserved or not snap.idle_returned) and time.monotonic() < deadline:
            time.sleep(0.02)
            snap = snapshot(m.name)
        assert snap.pages_reserved == 0 and snap.mapped_bytes == 0
        assert snap.idle_returned >= m.bundle_bytes
        assert m.alloc(1) is not None  # traffic resumes: the pool refills in the background
        deadline = time.monotonic() + 10
        while len(m.pages.reserved) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(m.pages.reserved) >= 2


def test_idle_return_can_be_turned_off() -> None:
    with manager("affinity", KVCACHED_MIN_RESERVED_PAGES="2", KVCACHED_IDLE_RETURN_S="-1") as m:
        m.free(m.alloc(2))
        deadline = time.monotonic() + 5
        while len(m.pages.reserved) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
        snap = snapshot(m.name)
        assert snap.pages_reserved >= 2 and snap.idle_returned == 0


# -- choosing a policy -------------------------------------------------------------------------
def test_policy_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_POLICY", "first-fit")
    assert make_policy(None).name == "first-fit"
    monkeypatch.delenv("KVCACHED_POLICY")
    assert make_policy(None).name == "affinity"
    assert set(POLICIES) == {"first-fit", "best-fit", "affinity"}


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown placement policy 'packed': use one of first-fit, best-fit, affinity"):
        manager("packed")


@pytest.mark.parametrize("policy", PAGE_AWARE)
def test_a_run_splits_over_holes_when_no_page_can_be_mapped(policy: str) -> None:
    with manager(policy, KVCACHED_MAX_RESERVED_PAGES="0") as m:
        a, b = m.alloc(4), m.alloc(4)
        m.free(a[:2] + b[:2])  # two holes of 2 blocks, on two pages
        assert m.set_limit(2 * m.bundle_bytes) == "applied"  # and no third page
        got = m.alloc(3)
        assert got is not None and len(set(got)) == 3
        assert pages_of(got) == pages_of(a) | pages_of(b)
        assert m.alloc(2) is None  # one slot left: a miss, nothing changes
        assert m.pages.blocks_used == 7
