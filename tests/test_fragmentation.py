"""The fragmentation target on traffic the default policy was not tuned on (counts, not timings).

The engine model (tests/fragmentation_workload.py, which benchmarks/fragmentation.py also runs) drives
a real KVCacheManager; after the traffic drains we read the model's segment as kvctl frag does.
Seeds 201 and 202 were never used while the policy was developed (see TUNING / HELD_OUT in
benchmarks/fragmentation.py).
"""

from __future__ import annotations

import pytest
from fragmentation_workload import Workload, run_workload

KiB = 1024

UNSEEN = [
    Workload("seed 201", seed=201, requests=600, after_idle=96),
    Workload("seed 202, 64 running, 32 blocks/page, 8k cache", seed=202, requests=600, after_idle=96,
             concurrency=64, page_size=512 * KiB, cache_tokens=8000),
]


@pytest.mark.parametrize("workload", UNSEEN, ids=lambda wl: wl.label)
def test_default_policy_meets_the_target(workload: Workload) -> None:
    ours = run_workload(workload, "affinity")
    upstream = run_workload(workload, "best-fit")
    assert ours.idle_floor > 0, "the idle model should still hold cached blocks"
    assert ours.idle_pinned <= 1.10 * ours.idle_floor, (
        f"idle model pins {ours.idle_pinned} pages for a packed floor of {ours.idle_floor}")
    assert ours.hits >= upstream.hits, f"prefix hits {ours.hits} < upstream-style {upstream.hits}"
    assert ours.idle_returned_bytes > 0, "what the model gave back on idle must show in its segment"


def test_naive_baseline_fragments() -> None:
    """The workload does expose fragmentation: first fit leaves an idle model pinning far above its floor."""
    naive = run_workload(UNSEEN[0], "first-fit")
    assert naive.idle_pinned >= 2 * naive.idle_floor


def test_counts_are_deterministic() -> None:
    first = run_workload(UNSEEN[1], "affinity")
    again = run_workload(UNSEEN[1], "affinity")
    assert (first.idle_pinned, first.idle_floor, first.idle_cached, first.hits) == \
        (again.idle_pinned, again.idle_floor, again.idle_cached, again.hits)


def test_with_compaction_idle_packing_keeps_the_cache_at_the_floor() -> None:
    """An engine that can move its blocks (a compact handler): the idle model pins its packed floor and keeps
    its cache budget, where eviction alone keeps far less. The idle moments of Poisson arrivals compact in
    the middle of the traffic too, and the cache budget's evictions in the same call must not confuse the
    engine's prefix index (a block evicted there may be a move's destination)."""
    for wl in (Workload("seed 203, 32 blocks/page, long decode", seed=203, page_size=512 * KiB, decode_tokens=300,
                        followup=0.0, requests=500, after_idle=96),
               Workload("seed 204, Poisson, 64 blocks/page", seed=204, arrival_gap=60, requests=600, after_idle=64,
                        page_size=2048 * KiB, block_bytes=32 * KiB, decode_tokens=300, followup=0.0)):
        evicting = run_workload(wl, "affinity")
        compacting = run_workload(wl, "affinity", compaction=True)
        assert evicting.cache_kept < 0.75, "the workload should make eviction alone drop much of the cache"
        assert compacting.compactions >= 1 and compacting.blocks_moved > 0 and compacting.copied_bytes > 0
        assert compacting.idle_pinned <= 1.10 * compacting.idle_floor, wl.label
        assert compacting.cache_kept >= 0.90, f"{wl.label}: kept {compacting.idle_cached} of {compacting.cache_budget}"
        assert compacting.hits_after_idle > 0  # the moved blocks are found again
