"""Two-phase compaction (begin, the engine's own copy, commit or abort) on real host mmap memory."""

from __future__ import annotations

import json

import pytest
from test_core_compact import BPP, BUNDLE, ENV, MODEL, cfg, holds, rss, scattered, write

from kvcached_core import KVCacheManager
from kvcached_core.allocator.compact import host_copy
from kvcached_core.allocator.compact_staged import cap_moves


def test_begin_holds_both_ends_until_commit_frees_the_sources_and_unmaps() -> None:
    with KVCacheManager("staged", policy="best-fit", settings=cfg(), **MODEL) as m:  # type: ignore[arg-type]
        kept = scattered(m)
        ticket = m.compact_begin()
        moves = ticket.moves
        assert len(moves) == 8 and all(src // BPP >= 4 and dst // BPP < 4 for src, dst in moves)
        srcs, dsts = [s for s, _ in moves], [d for _, d in moves]
        # in flight: both ends used, neither cached, so nothing evicts, frees or unmaps them
        assert all(m.pages.is_used(b) and b not in m.cache for b in srcs + dsts)
        assert m.pages.pages_inuse == 8 and m.used_blocks == 32 + 8 + len(ticket.held) and m.cached_blocks == 24
        evicted = m.evict(100)
        assert not set(evicted) & set(srcs + dsts) and len(evicted) == 24
        assert all(m.pages.is_used(b) for b in srcs + dsts)
        assert m.pages.pages_inuse == 8  # the source pages stay mapped: their bytes are still to be read
        host_copy(m.backend, m.block_bytes, moves)  # the engine's step
        before = rss()
        step = m.compact_commit(ticket)
        assert step.evicted == [] and step.result.moves == moves
        assert not step.done  # the eviction left 4 pages of 2 destinations each: sparse again
        assert step.result.bytes_returned == 4 * BUNDLE
        assert step.result.bytes_copied == 8 * m.block_bytes * m.num_layers * m.num_kv_buffers
        assert before - rss() >= 0.95 * 4 * BUNDLE
        assert m.pages.pages_inuse == 4 and m.pages.mapped_pages == 4
        assert sorted(m.cache.blocks) == sorted(dsts) and not any(m.pages.is_used(s) for s in srcs)
        for src, dst in moves:
            assert src in kept and holds(m, dst, src)
        assert m.compaction.compactions == 1 and m.compaction.blocks_moved == 8


def test_a_block_allocated_during_a_round_never_lands_on_a_page_it_empties() -> None:
    """A busy engine allocates while the round's copies run with its step: the source pages' free slots are
    held, so the new block goes elsewhere and the commit still returns every page it emptied (on the old code
    best-fit put it in a source page's hole: 3 pages returned of 4)."""
    with KVCacheManager("staged-busy", policy="best-fit", settings=cfg(), **MODEL) as m:  # type: ignore[arg-type]
        scattered(m)
        ticket = m.compact_begin()
        sources = {src // BPP for src, _ in ticket.moves}
        assert sources == {4, 5, 6, 7} and len(ticket.held) == 4 * 6  # each source page's 6 holes
        fresh = m.alloc(1)
        assert fresh is not None and fresh[0] // BPP not in sources
        host_copy(m.backend, m.block_bytes, ticket.moves)
        step = m.compact_commit(ticket)
        assert step.result.bytes_returned == 4 * BUNDLE
        assert not any(m.pages.is_used(b) for b in ticket.held)  # the held slots went with their pages


def test_an_abort_gives_the_held_slots_back() -> None:
    with KVCacheManager("staged-held", policy="best-fit", settings=cfg(), **MODEL) as m:  # type: ignore[arg-type]
        scattered(m)
        used = m.used_blocks
        ticket = m.compact_begin()
        assert ticket.held and all(m.pages.is_used(b) for b in ticket.held)
        m.compact_abort(ticket)
        assert not any(m.pages.is_used(b) for b in ticket.held) and m.used_blocks == used


def test_moves_per_round_are_capped_whole_source_pages_first() -> None:
    assert cap_moves([(32, 0), (33, 1), (40, 2), (41, 3)], 3, BPP) == [(32, 0), (33, 1)]
    assert cap_moves([(32, 0), (33, 1), (34, 2)], 2, BPP) == [(32, 0), (33, 1)]  # one page over the cap: part
    assert cap_moves([(32, 0)], None, BPP) == [(32, 0)]
    with KVCacheManager("staged-cap", policy="best-fit", settings=cfg(), **MODEL) as m:  # type: ignore[arg-type]
        kept = scattered(m)
        rounds, remap = 0, {}
        while True:
            ticket = m.compact_begin(max_moves=3)
            assert len(ticket.moves) <= 3
            host_copy(m.backend, m.block_bytes, ticket.moves)
            step = m.compact_commit(ticket)
            rounds += 1
            remap.update(step.result.moves)
            if step.done:
                break
        assert rounds == 4 and len(remap) == 8 and m.pages.pages_inuse == 4
        assert m.cached_blocks == m.used_blocks == 32
        for block in kept:
            assert holds(m, remap.get(block, block), block)
        empty = m.compact_begin()  # dense: an empty ticket, committed at once
        assert empty.moves == () and m.compact_commit(empty).done


def test_abort_restores_everything() -> None:
    with KVCacheManager("staged-abort", policy="best-fit", settings=cfg(), **MODEL) as m:  # type: ignore[arg-type]
        kept = scattered(m)
        first = m.compact_begin()
        with pytest.raises(RuntimeError, match="in flight"):
            m.compact_begin()
        assert m.compact_abort(first) == []
        assert sorted(m.cache.blocks) == sorted(kept) and m.used_blocks == 32 and m.pages.pages_inuse == 8
        with pytest.raises(ValueError, match="not the compaction in flight"):
            m.compact_commit(first)
        again = m.compact_begin()
        assert again.moves == first.moves  # the same plan: nothing of the first begin was left behind
        m.compact_abort(again)
        assert m.compaction.compactions == 0


def test_a_prefix_hit_may_take_a_destination_before_the_commit() -> None:
    with KVCacheManager("staged-reuse", policy="best-fit", settings=cfg(), **MODEL) as m:  # type: ignore[arg-type]
        scattered(m)
        ticket = m.compact_begin()
        (src0, dst0), (src1, dst1) = ticket.moves[:2]
        with pytest.raises(ValueError, match="not in the prefix cache"):
            m.reuse([src0])  # a held source: the engine re-pointed its index, nothing may hit it
        m.reuse([dst0])  # the engine's index already names the destination
        with pytest.raises(ValueError, match="prefix hit took"):
            m.compact_abort(ticket)
        host_copy(m.backend, m.block_bytes, ticket.moves)
        m.compact_commit(ticket)
        assert dst0 not in m.cache and m.pages.is_used(dst0)  # active: its request holds it
        assert dst1 in m.cache and not m.pages.is_used(src0)
        m.mark_cached([dst0])
        assert m.cached_blocks == m.used_blocks == 32 and m.pages.pages_inuse == 4


def test_idle_packing_waits_for_the_engine_and_keeps_the_cache() -> None:
    """Affinity packs an idle model: with a two-phase engine it compacts instead of evicting (on the old
    code, or with no poke, the sparse cached pages are evicted)."""
    with KVCacheManager("staged-idle", policy="affinity", settings=cfg(), **MODEL) as m:  # type: ignore[arg-type]
        pokes: list[int] = []
        m.set_compact_poke(lambda: pokes.append(1))
        assert m.compaction.capable and not m.compact_wanted
        ids = [b for _ in range(8) for b in m.alloc(BPP) or []]
        assert sorted(b // BPP for b in ids) == sorted(list(range(8)) * BPP)
        for block in ids:
            write(m, block, block)
        drop = [b for b in ids if (b // BPP < 4 and b % BPP < 2) or (b // BPP >= 4 and b % BPP >= 2)]
        m.free(drop)
        kept = [b for b in ids if b not in drop]
        assert m.mark_cached(kept) == []  # idle now: packing waits for the compaction
        assert pokes == [1] and m.compact_wanted and m.cached_blocks == 32 and m.pages.pages_inuse == 8
        assert m.pack() == [] and pokes == [1]  # asked again while it waits: no second poke, still nothing evicted
        remap: dict[int, int] = {}
        while m.compact_wanted:
            ticket = m.compact_begin(max_moves=4)
            host_copy(m.backend, m.block_bytes, ticket.moves)
            step = m.compact_commit(ticket)
            remap.update(step.result.moves)
            assert step.evicted == []
        assert m.pages.pages_inuse == 4 and m.cached_blocks == 32
        for block in kept:
            assert holds(m, remap.get(block, block), block)


SCATTER = f"""
import threading
from kvcached_core.allocator.compact import host_copy
BPP = {BPP}
ids = [m.alloc(1)[0] for _ in range(8 * BPP)]
drop = [b for b in ids if (b // BPP < 4 and b % BPP < 2) or (b // BPP >= 4 and b % BPP >= 2)]
m.free(drop)
m.mark_cached([b for b in ids if b not in drop])
wake = threading.Event()
rounds = []
def engine():
    while wake.wait():
        wake.clear()
        while m.compact_wanted:
            t = m.compact_begin(max_moves=2)
            host_copy(m.backend, m.block_bytes, t.moves)
            rounds.append(m.compact_commit(t).result.planned)
threading.Thread(target=engine, daemon=True).start()
m.set_compact_poke(wake.set)
"""


def test_kvctl_compact_is_answered_when_the_two_phase_engine_finishes(spawn_allocator) -> None:
    from conftest import kvctl

    from kvcached_core import snapshot

    spawn_allocator("cs", env=ENV, policy="best-fit", script=SCATTER, **MODEL)
    before = snapshot("cs")
    assert before.pages_inuse == 8 and before.compaction is not None and before.compaction.capable
    done = kvctl("compact", "cs", "--json")
    assert done.exit_code == 0, done.stderr
    answer = json.loads(done.stdout)
    # four rounds of two moves, one answer with the whole compaction's figures
    assert answer["status"] == "compacted" and answer["bytes_returned"] == 4 * BUNDLE
    assert answer["bytes_copied"] == 8 * MODEL["block_bytes"] * MODEL["num_layers"] * 2
    now = snapshot("cs")
    assert (now.pages_inuse, now.blocks_cached, now.mapped_bytes) == (4, 32, 4 * BUNDLE)
    assert now.compaction is not None and now.compaction.compactions == 4 and now.compaction.blocks_moved == 8
    again = kvctl("compact", "cs")
    assert again.exit_code == 0 and "returned 0 B (0 bytes), copied 0 B (0 bytes)" in again.stdout, again.stdout


def test_set_compact_handler_and_poke_replace_each_other() -> None:
    with KVCacheManager("staged-swap", policy="best-fit", settings=cfg(), **MODEL) as m:  # type: ignore[arg-type]
        m.set_compact_poke(lambda: None)
        m.set_compact_handler(lambda moves: host_copy(m.backend, m.block_bytes, moves))
        assert m.staged.poke is None and m.compaction.capable
        m.set_compact_poke(lambda: None)
        with pytest.raises(RuntimeError, match="no compaction handler"):
            m.compact()
        m.set_compact_poke(None)
        assert not m.compaction.capable


def test_a_closed_allocator_wants_no_compaction() -> None:
    """An engine steps while compact_wanted: after close (the engine shutting down) it must not step for it."""
    m = KVCacheManager("staged-closed", policy="affinity", settings=cfg(), **MODEL)  # type: ignore[arg-type]
    m.set_compact_poke(lambda: None)
    ids = [b for _ in range(8) for b in m.alloc(BPP) or []]
    m.free([b for b in ids if b % 2])
    m.mark_cached([b for b in ids if not b % 2])  # idle and sparse: packing waits for the engine
    assert m.compact_wanted
    m.close()
    assert not m.compact_wanted


@pytest.mark.parametrize("end", ["commit", "abort"])
def test_the_published_page_map_counts_the_cached_blocks_after_the_round(end: str) -> None:
    """The engine steps (allocates, publishes) between begin and the end of a round. The page map a reader sees
    must then still add up to the published cached count: on the old code the destinations (commit) or the
    sources (abort) became cached again without their pages being republished (CI's vLLM run read 8 cached
    blocks in the page map beside a counter of 16)."""
    from kvcached_core.segment.pagemap import decoded
    from kvcached_core.segment.reader import snapshot

    with KVCacheManager(f"staged-map-{end}", policy="best-fit", settings=cfg(), **MODEL) as m:  # type: ignore[arg-type]
        scattered(m)
        ticket = m.compact_begin()
        assert m.alloc(1) is not None  # the step in between publishes the pages touched so far
        if end == "commit":
            host_copy(m.backend, m.block_bytes, ticket.moves)
            m.compact_commit(ticket)
        else:
            m.compact_abort(ticket)
        seen = snapshot(m.name)
        assert seen.pages is not None
        pages = decoded(seen.pages)
        assert sum(p[2] for p in pages) == seen.blocks_cached == m.cached_blocks > 0
        assert sum(p[1] for p in pages) == seen.blocks_used == m.used_blocks
